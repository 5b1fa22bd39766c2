"""A generation's store prefix: fresh per generation, the same from every leader of the job, and
unguessable without the leader's word (the stores it names have no auth)."""

import json
import re
from dataclasses import replace

from muster.coordinator.core.policy import JobSpec
from muster.coordinator.core.state import JobState, decode, encode
from muster.coordinator.wire import store_prefix


def test_the_prefix_has_128_unguessable_bits_per_generation_and_job():
    state = JobState("j", JobSpec(), generation=7)
    prefix = store_prefix(state)
    assert re.fullmatch(r"muster/j/g7-[0-9a-f]{32}", prefix)
    assert store_prefix(JobState("j", JobSpec(), generation=7)) != prefix  # same name and history, another job
    later = {store_prefix(replace(state, generation=g)) for g in range(8, 40)}
    assert len(later) == 32 and prefix not in later  # one generation's prefix tells nothing of the next


def test_a_new_leader_hands_out_the_same_prefix_and_the_salt_is_never_shown():
    state = JobState("j", JobSpec(), generation=7)
    assert store_prefix(decode(encode(state))) == store_prefix(state)
    assert state.store_salt not in repr(state)


def test_a_state_written_before_salts_gets_one():
    doc = json.loads(encode(JobState("j", JobSpec(), generation=3)))
    del doc["store_salt"]
    old = decode(json.dumps(doc).encode())
    assert re.fullmatch(r"[0-9a-f]{32}", old.store_salt) and store_prefix(old).startswith("muster/j/g3-")
