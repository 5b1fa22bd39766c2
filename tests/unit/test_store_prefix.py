"""A generation's store prefix and store key: fresh per generation, the same from every leader of
the job, and unguessable without the leader's word (the stores they name have no auth, and any
client lists the prefix, so the key that seals their values is never derivable from it)."""

import json
import re
from dataclasses import replace

from muster.coordinator.core.policy import JobSpec
from muster.coordinator.core.state import JobState, Phase, Placement, RankMap, decode, encode
from muster.coordinator.wire import Assignments, store_key, store_prefix
from muster.worker.library.reform import group_spec


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


def test_every_placed_node_gets_the_generations_store_key_and_a_rank_seals_with_it():
    rm = RankMap(7, 4, (Placement("a", 0, 0, (0, 1)), Placement("b", 1, 2, (0, 1))), "127.0.0.1:29500", True, 0)
    state = JobState("j", JobSpec(), generation=7, phase=Phase.RUNNING, rank_map=rm)
    maps = Assignments(state, "test")
    keys = {maps.directive(n).assignment.store_key for n in ("a", "b")}
    assert keys == {store_key(state)} and len(store_key(state)) == 32
    assert store_key(state).hex() not in store_prefix(state) and store_key(decode(encode(state))) == store_key(state)
    assert store_key(replace(state, generation=8)) != store_key(state)
    assert group_spec(maps.directive("b").assignment, 1, 1).store_key == store_key(state)
