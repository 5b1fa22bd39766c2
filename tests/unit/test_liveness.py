"""Liveness: silence, stalls with a calibrated progress timeout, long phases, grace."""

import json
import statistics
from dataclasses import replace

from muster.coordinator.core import liveness
from muster.coordinator.core.kinds import FailureKind
from muster.coordinator.core.liveness import Liveness, RankReport, Recovery, Vouch
from muster.coordinator.core.machine import Context, Join, Regroup, Tick, decide
from muster.coordinator.core.policy import JobSpec, Timing
from muster.coordinator.core.stalls import judge_ranks
from muster.coordinator.core.state import JobState
from muster.v1 import muster_pb2 as pb

TIMING = Timing(heartbeat_timeout_s=2.0, progress_floor_s=1.0, progress_factor=10.0,
                startup_progress_timeout_s=30.0, long_phase_timeout_s=60.0, grace_s=5.0)


def job(n=2):
    c = Context(now=0, wall_ms=0, term=1, timing=TIMING)
    return decide(JobState("job", JobSpec(1, n, 1)), [Join(f"n{i}", "h", 1, 1) for i in range(n)], c).state


def report(step, state="running", pid=100, step_time_s=0.05, heard_ms_ago=0, compute_s=0.0):
    return [RankReport(0, pid, step, step_time_s, state, heard_ms_ago, compute_s=compute_s)]


def steady(live, node, start, steps, now, dt=0.05):
    for i in range(steps):
        live.observe(node, 1, report(start + i), now + i * dt)
    return now + steps * dt


def test_silent_node_fails_after_heartbeat_timeout():
    state = job()
    live = Liveness(TIMING, now=0)
    live.observe("n0", 1, report(1), 0)
    live.observe("n1", 1, report(1), 0)
    live.observe("n0", 1, report(1), 2.5)
    assert [(f.kind, f.node_id) for f in live.failures(state, 2.5)] == [("node_silent", "n1")]


def test_after_the_leaders_own_pause_silence_counts_again_only_a_heartbeat_timeout_later():
    """The leader did not run from 0.5 to 12 (its host starved it): the nodes' frames of that time wait
    unread. Nothing is judged silent or stalled until a heartbeat timeout after it resumed, save an
    exit; a node whose frames come is never judged, one that stays silent is, once the hold is over."""
    state = job()
    live = Liveness(TIMING, now=0)
    for node in ("n0", "n1"):
        live.observe(node, 1, report(1), 0.5)
    live.after_a_pause(12.0)
    assert live.failures(state, 12.0) == [] and live.failures(state, 13.9) == []
    live.observe("n0", 1, report(2), 12.1)  # its frames, read once the leader runs
    live.observe("n0", 1, report(3), 13.5)
    assert [(f.kind, f.node_id) for f in live.failures(state, 14.1)] == [("node_silent", "n1")]
    live.after_a_pause(20.0)
    live.observe("n0", 1, report(4, state="exited"), 20.0)
    assert [(f.kind, f.node_id) for f in live.failures(state, 20.0)] == [("rank_exited", "n0")]  # at once


def test_progress_timeout_is_calibrated_from_step_times_with_a_floor():
    live = Liveness(TIMING, now=0)
    assert live.progress_timeout() == 30.0  # not calibrated yet
    steady(live, "n0", 1, 20, 0, dt=0.05)
    assert live.progress_timeout() == 1.0  # 10 x 0.05 s is under the floor
    for i in range(20):
        live.observe("n0", 1, report(100 + i, step_time_s=0.5), 10 + i)
    assert live.progress_timeout() == 5.0


def test_stalled_rank_is_found_while_frames_keep_arriving():
    state = job()
    live = Liveness(TIMING, now=0)
    now = steady(live, "n0", 1, 20, 0)
    steady(live, "n1", 1, 20, 0)
    for t in (now, now + 0.5, now + 1.2):
        live.observe("n0", 1, report(20), t)
        live.observe("n1", 1, report(int(t * 100)), t)
    failures = live.failures(state, now + 1.2)
    assert [(f.kind, f.node_id) for f in failures] == [("rank_stalled", "n0")]
    assert "has not advanced" in failures[0].reason


def test_declared_long_phase_suspends_stall_detection_until_its_ceiling():
    state = job()
    live = Liveness(TIMING, now=0)
    now = steady(live, "n0", 1, 20, 0)
    live.observe("n1", 1, report(20), now)
    for t in range(0, 61, 10):
        live.observe("n0", 1, report(20, state="long_phase"), now + t)
        live.observe("n1", 1, report(20 + t), now + t)
    assert live.failures(state, now + 59.9) == []
    live.observe("n0", 1, report(20, state="long_phase"), now + 61)
    live.observe("n1", 1, report(99), now + 61)
    assert [f.kind for f in live.failures(state, now + 61)] == ["rank_stalled"]


def test_grace_after_a_leader_change_suppresses_silence_and_stalls():
    state = job()
    live = Liveness(TIMING, now=100)
    live.start_grace(["n0", "n1"], now=100)
    assert live.failures(state, 104.9) == []
    live.observe("n0", 1, report(1), 103.0)
    live.observe("n0", 1, report(2), 104.5)
    assert live.failures(state, 104.9) == []  # in grace, whoever is silent
    assert [f.node_id for f in live.failures(state, 105.1)] == ["n1"]  # silent since the first frame and the grace


def test_agent_reported_silent_rank_is_a_rank_failure():
    state = job()
    live = Liveness(TIMING, now=0)
    live.observe("n0", 1, report(1, heard_ms_ago=2500), 0)
    live.observe("n1", 1, report(1), 0)
    assert [(f.kind, f.local_rank) for f in live.failures(state, 0.1)] == [("rank_silent", 0)]


def test_a_new_process_in_a_failed_slot_is_reported_as_recovered():
    live = Liveness(TIMING, now=0)
    live.observe("n0", 1, report(5, pid=100), 0)
    live.exits.mark_failed("n0", 0, 100)
    assert live.observe("n0", 1, report(5, pid=100, state="exited"), 0.1) == []
    assert live.observe("n0", 1, report(0, pid=101, state="starting"), 0.2) == [0]


def test_new_generation_resets_progress_so_reforming_is_not_a_stall():
    state = job()
    live = Liveness(TIMING, now=0)
    now = steady(live, "n0", 1, 20, 0)
    steady(live, "n1", 1, 20, 0)
    live.generation_published(1, now + 0.9)
    live.observe("n0", 1, report(20), now + 1.5)
    live.observe("n1", 1, report(20), now + 1.5)
    assert live.failures(state, now + 1.5) == []
    assert live.max_step(decide(state, [Tick()], Context(now=9, wall_ms=0, term=1, timing=TIMING)).state) == 20


def test_the_step_a_planned_switch_counts_from_is_the_last_report_projected_to_now():
    state = decide(job(), [Tick()], Context(now=0, wall_ms=0, term=1, timing=TIMING)).state
    live = Liveness(TIMING, now=0)
    live.observe("n0", 1, report(20), 10.0)  # (times and steps of binary fractions: exact arithmetic)
    live.observe("n1", 1, report(18), 10.125)
    assert live.max_step(state) == 20  # as reported
    assert live.max_step(state, 10.1875, 0.0625) == 23  # n0's frame is 0.1875 s old: 3 steps of 0.0625 s since
    assert live.max_step(state, 10.1875, None) == 20  # no step time known yet: as reported
    # a silent node is judged, not projected past the heartbeat timeout (2 s: 32 steps)
    assert live.max_step(state, 30.0, 0.0625) == 20 + 32


def test_a_rank_that_never_completes_a_step_is_stalled_after_the_startup_timeout():
    state = job()
    live = Liveness(TIMING, now=0)
    for t in range(0, 31, 5):
        live.observe("n0", 1, report(0, state="starting"), t)
        live.observe("n1", 1, report(t), t)
    assert live.failures(state, 30) == []
    live.observe("n0", 1, report(0, state="starting"), 30.5)
    live.observe("n1", 1, report(31), 30.5)
    failures = live.failures(state, 30.5)
    assert [(f.kind, f.node_id) for f in failures] == [("rank_stalled", "n0")]
    assert "since it started" in failures[0].reason


def digest_report(step, digest):
    return [RankReport(0, 100, step, 0.05, "running", 0, "", step, digest)]


def test_a_rank_whose_digest_differs_from_the_majority_is_flagged_once():
    c = Context(now=0, wall_ms=0, term=1, timing=TIMING)
    state = decide(JobState("job", JobSpec(1, 3, 1)), [Join(f"n{i}", "h", 1, 1) for i in range(3)], c).state
    live = Liveness(TIMING, now=0)
    live.observe("n0", 1, digest_report(10, b"a"), 1)
    live.observe("n1", 1, digest_report(10, b"a"), 1)
    assert live.divergence(state) is None  # n2 has not reported yet
    live.observe("n2", 1, digest_report(10, b"b"), 1)
    d = live.divergence(state)
    assert (d.step, d.ranks, d.nodes) == (10, (2,), ("n2",)) and "differ from the majority (2 of 3)" in d.reason
    assert live.divergence(state) is None  # judged once
    for node, digest in (("n0", b"c"), ("n1", b"c"), ("n2", b"d")):
        live.observe(node, 1, digest_report(15, digest), 2)
    assert live.divergence(state) is None  # the same rank again: already flagged
    for node in ("n0", "n1", "n2"):
        live.observe(node, 1, digest_report(20, b"e"), 3)
    assert live.divergence(state) is None
    live.observe("n1", 1, digest_report(25, b"x"), 4)
    live.observe("n0", 1, digest_report(25, b"f"), 4)
    live.observe("n2", 1, digest_report(25, b"f"), 4)
    assert live.divergence(state).ranks == (1,)


def test_without_a_majority_every_rank_is_flagged():
    state = job()
    live = Liveness(TIMING, now=0)
    live.observe("n0", 1, digest_report(5, b"a"), 1)
    live.observe("n1", 1, digest_report(5, b"b"), 1)
    d = live.divergence(state)
    assert d.ranks == (0, 1) and "no majority" in d.reason


def test_a_rank_reported_exited_in_the_map_fails_even_during_the_grace():
    """Its exit report went to the previous leader: the new one learns it from the frames."""
    c = Context(now=0, wall_ms=0, term=1, timing=TIMING)
    state = decide(JobState("job", JobSpec(1, 2, 1)), [Join("n0", "h", 1, 2)], c).state
    state = decide(state, [Tick()], Context(now=5, wall_ms=0, term=1, timing=TIMING)).state
    live = Liveness(TIMING, now=10)
    live.start_grace(["n0"], now=10)
    live.observe("n0", 1, [RankReport(0, 100, 7, 0.05, "running"), RankReport(1, 101, 7, 0.05, "exited")], 10.1)
    failures = live.failures(state, 10.2)
    assert [(f.kind, f.local_rank) for f in failures] == [("rank_exited", 1)]
    assert "reported exited (pid 101)" in failures[0].reason
    assert live.observe("n0", 1, [RankReport(1, 102, 0, 0.0, "starting")], 11) == [1]  # its replacement


def ranks(state="running", step=20, generation=1, pid=100):
    return [RankReport(0, pid, step, 0.05, state, 0, "", 0, b"", generation)]


def test_a_rank_waiting_for_its_group_to_form_is_not_stalled_before_the_form_timeout():
    """Survivors waiting at a reform for a joiner that is still starting are not to blame."""
    state = job()
    live = Liveness(TIMING, now=0)
    live.generation_published(1, 0)
    for t in (1, 10, 20, 30):
        live.observe("n0", 1, ranks("forming", generation=1), t)
        live.observe("n1", 1, ranks("starting", step=0, generation=0), t)
        assert live.failures(state, t) == []  # far past the 1 s progress timeout
    # The starting one is judged by the start-up bound (30 s here), not the waiting one.
    live.observe("n0", 1, ranks("forming", generation=1), 31.5)
    live.observe("n1", 1, ranks("starting", step=0, generation=0), 31.5)
    assert [(f.kind, f.node_id) for f in live.failures(state, 31.5)] == [("rank_stalled", "n1")]


def test_a_generation_not_formed_in_time_names_the_ranks_that_never_reached_it():
    state = job()
    live = Liveness(TIMING, now=0)
    live.generation_published(1, 0)
    late = TIMING.form_timeout_s + 1
    for t in (1, late):
        live.observe("n0", 1, ranks("forming", generation=1), t)
        live.observe("n1", 1, ranks("holding", generation=0), t)  # stuck on an older group
    assert live.failures(state, TIMING.form_timeout_s - 1) == []
    failures = live.failures(state, late)
    assert [(f.kind, f.node_id, f.local_rank) for f in failures] == [("rank_not_formed", "n1", 0)]
    assert "did not reach generation 1" in failures[0].reason


def test_a_generation_every_rank_reached_but_that_did_not_form_is_decided_again():
    state = job()
    live = Liveness(TIMING, now=0)
    live.generation_published(1, 0)
    late = TIMING.form_timeout_s + 1
    for node in ("n0", "n1"):
        live.observe(node, 1, ranks("forming", generation=1), late)
    assert [f.kind for f in live.failures(state, late)] == ["group_not_formed"]
    for node in ("n0", "n1"):
        live.observe(node, 1, ranks("running", generation=1, step=21), late + 1)
    assert live.failures(state, late + 1) == []  # formed


def test_ranks_holding_after_a_failed_collective_break_the_group_after_the_heartbeat_timeout():
    """Nobody was found failed (an exit report lost with the leader, a transient fault): the same
    members re-form rather than wait forever."""
    state = job()
    live = Liveness(TIMING, now=0)
    live.generation_published(1, 0)
    live.observe("n0", 1, ranks("running", generation=1), 1)
    live.observe("n1", 1, ranks("running", generation=1), 1)
    live.observe("n0", 1, ranks("holding", generation=1), 2)
    live.observe("n1", 1, ranks("running", generation=1), 2)
    assert live.failures(state, 2 + TIMING.heartbeat_timeout_s - 0.1) == []
    for node in ("n0", "n1"):
        live.observe(node, 1, ranks("holding" if node == "n0" else "running", generation=1), 4)
    failures = live.failures(state, 2 + TIMING.heartbeat_timeout_s + 0.1)
    assert [f.kind for f in failures] == ["group_broken"]
    assert "ranks [0] of generation 1 hold" in failures[0].reason


def test_a_rank_restarting_in_place_re_forms_the_job_once_with_its_slot():
    """A script without the library: its agent restarts the crashed rank in its place. The job
    re-forms with the slot (never a map without it first), even when the exit report went to a
    previous leader; once a newer generation is out, the report is no new fault."""
    state = job()
    live = Liveness(TIMING, now=0)
    live.start_grace(["n0", "n1"], now=0)
    live.observe("n0", 1, ranks("script", step=0, generation=0), 0.1)
    live.observe("n1", 1, ranks("restarting", step=0, generation=1, pid=101), 0.1)
    failures = live.failures(state, 0.2)  # during the grace too, like an exit
    assert [(f.kind, f.node_id, f.local_rank) for f in failures] == [("rank_restarted", "n1", 0)]
    assert "pid 101" in failures[0].reason and "restarting in place" in failures[0].reason
    d = decide(state, [Regroup(f.kind, f.reason, (f.node_id,)) for f in failures] * 2,
               Context(now=1, wall_ms=0, term=1, timing=TIMING))
    assert d.new_generation and d.state.rank_map.abort_previous
    assert d.state.rank_map.placements == state.rank_map.placements, "the slot keeps its place"
    assert [e.kind for e in d.events] == ["rank_restarted", "generation"], "one fault, noted once"
    live.observe("n1", 2, ranks("restarting", step=0, generation=1, pid=101), 1.1)
    assert live.failures(d.state, 1.2) == []  # answered: generation 2 restarts it
    assert live.assess(d.state, 1.2).prestart is False, "no rank runs the library"


def test_recovery_ends_once_every_node_of_its_map_reports_a_step_past_the_decision():
    state = job()
    live = Liveness(TIMING, now=0)
    recovery = Recovery(generation=1, decided_at=10.0, step=5)
    live.observe("n0", 1, report(6), 11)
    live.observe("n1", 1, report(5), 11)
    assert live.assess(state, 11.5, recovering=recovery).recovered == (False, None)  # n1 not past its step
    live.observe("n1", 0, report(7), 12)
    assert live.assess(state, 12, recovering=recovery).recovered == (False, None)  # n1 runs the previous generation
    live.observe("n1", 1, report(7), 12.5)
    assert live.assess(state, 13.0).recovered is None, "none asked about"
    assert live.assess(state, 13.0, recovering=recovery).recovered == (True, 3.0)


def test_a_relayed_nodes_recovery_ends_on_its_relays_word_for_the_steps_it_no_longer_forwards():
    """A summarising relay forwards a node's first advance after a change and no later one: a node
    whose first step in the generation is not past the decision's is past it by its relay's summary."""
    state = job()
    live, vouch = Liveness(TIMING, now=0), Vouch()
    recovery = Recovery(generation=1, decided_at=10.0, step=5)
    live.observe("n0", 1, report(6), 11)
    live.observe("n1", 1, report(5), 11, vouched=True, vouch=vouch)  # its first advance; the rest summarised
    vouch.at, vouch.low, vouch.high = 11.5, 5, 9
    assert live.assess(state, 11.5, recovering=recovery).recovered == (False, None)
    vouch.at, vouch.low = 12.5, 8  # every node of its relay past step 8
    assert live.assess(state, 12.5, recovering=recovery).recovered == (True, 2.5)


def test_a_scripts_recovery_ends_once_each_of_its_ranks_steps_in_a_process_of_the_generation():
    """A script's ranks restart with each map and their probe counts steps from their process's
    start: the job's step before the decision is no measure for them."""
    state = job()
    live = Liveness(TIMING, now=0)
    recovery = Recovery(generation=1, decided_at=10.0, step=50)
    live.observe("n0", 1, ranks("script", step=3, generation=1), 11)
    live.observe("n1", 1, ranks("script", step=40, generation=0), 11)  # its process of the map before
    assert live.assess(state, 11.5, recovering=recovery).recovered == (False, None)
    live.observe("n1", 1, ranks("script", step=0, generation=1, pid=101), 11.6)  # restarted, not stepping yet
    assert live.assess(state, 11.7, recovering=recovery).recovered == (False, None)
    live.observe("n1", 1, ranks("script", step=1, generation=1, pid=101), 12)
    assert live.assess(state, 12.5, recovering=recovery).recovered == (True, 2.5)


def test_a_scripts_recovery_whose_steps_no_probe_measures_ends_once_its_ranks_run_the_generation():
    """`muster run -- bash train.sh`, another interpreter, or --no-step-probe: the ranks' steps stay
    0, and their recovery never ended (no recovery on the page, in `events`, in the metrics)."""
    state = job()
    live = Liveness(TIMING, now=0)
    recovery = Recovery(generation=1, decided_at=10.0, step=0)
    unmeasured = lambda generation: [r._replace(steps_unmeasured=True)  # noqa: E731
                                     for r in ranks("script", step=0, generation=generation)]
    live.observe("n0", 1, unmeasured(1), 11)
    live.observe("n1", 1, unmeasured(0), 11)  # its process of the map before
    assert live.assess(state, 11.5, recovering=recovery).recovered == (False, None)
    live.observe("n1", 1, ranks("script", step=0, generation=1, pid=101), 11.6)  # measured: not stepping yet
    assert live.assess(state, 11.7, recovering=recovery).recovered == (False, None)
    live.observe("n1", 1, [r._replace(pid=101) for r in unmeasured(1)], 12)
    assert live.assess(state, 12.5, recovering=recovery).recovered == (True, 2.5)


def test_a_superseded_recovery_is_over_without_a_time():
    live = Liveness(TIMING, now=0)
    assert live.assess(job(), 5.0, recovering=Recovery(generation=2, decided_at=1.0, step=0)).recovered == (True, None)


def test_failure_kinds_are_the_strings_of_the_history_and_the_wire():
    kind = FailureKind.NODE_SILENT
    assert kind == "node_silent" and f"{kind}: why" == "node_silent: why" and json.dumps(kind) == '"node_silent"'
    assert pb.Event(kind=kind).kind == "node_silent"


def test_an_abort_generation_is_reforming_until_every_library_rank_runs_in_it():
    state = job()
    live = Liveness(TIMING, now=0)
    assert not live.assess(state, 0, slots_back=True).reforming, "generation 1 formed at once is no abort generation"
    aborted = decide(state, [Regroup("group_broken", "held")], Context(now=1, wall_ms=0, term=1, timing=TIMING)).state
    live.observe("n0", 2, ranks("running", generation=2), 1)
    live.observe("n1", 1, ranks("holding", generation=1), 1)
    assert live.assess(aborted, 1, slots_back=True).reforming
    assert not live.assess(aborted, 1).reforming, "asked only when slots came back (O(ranks))"
    live.observe("n1", 2, ranks("forming", generation=2), 2)
    assert live.assess(aborted, 2, slots_back=True).reforming
    live.observe("n1", 2, ranks("running", generation=2, step=21), 3)
    assert not live.assess(aborted, 3, slots_back=True).reforming


# ---- a tally costs O(what changed) -------------------------------------------------------------


def big_job(nodes):
    c = Context(now=0, wall_ms=0, term=1, timing=TIMING)
    state = decide(JobState("job", JobSpec(1, nodes, 1)), [Join(f"n{i}", "h", 1, 1) for i in range(nodes)], c).state
    return decide(state, [Tick()], Context(now=TIMING.last_call_s + 1, wall_ms=0, term=1, timing=TIMING)).state


class CountingNodes(dict):
    """`Liveness.nodes`, counting the nodes a tally looks up."""

    lookups = 0

    def get(self, key, default=None):
        CountingNodes.lookups += 1
        return super().get(key, default)

    def __getitem__(self, key):
        CountingNodes.lookups += 1
        return super().__getitem__(key)


def test_a_quiet_tally_looks_at_no_node_however_big_the_job():
    state = big_job(3000)
    live = Liveness(replace(TIMING, progress_floor_s=30.0), now=0)  # nothing due again for 15 s at least
    now = 10.0
    for m in state.members:
        live.observe(m.node_id, state.generation, report(1), now)
    for i in range(3000 // 256 + 1):  # the first judgement of every node (it reported for the first time)
        live.failures(state, now + 0.01 * (i + 1))
    live.nodes = CountingNodes(live.nodes)
    for i in range(4):
        for m in state.members[:50]:
            live.observe(m.node_id, state.generation, report(2 + i), now + 0.2 + i * 0.1)
        CountingNodes.lookups = 0
        assert live.failures(state, now + 0.25 + i * 0.1) == []
        assert CountingNodes.lookups == 0


def test_silence_is_found_at_every_tally_until_the_node_is_forgotten():
    state = job(3)
    live = Liveness(TIMING, now=0)
    for t in (0, 1, 2, 2.5):
        live.observe("n0", 1, report(int(t * 10) + 1), t)
        live.observe("n2", 1, report(int(t * 10) + 1), t)
    live.observe("n1", 1, report(1), 0.3)
    assert live.failures(state, 2.25) == []
    for t in (2.35, 2.4, 2.6):
        assert [(f.kind, f.node_id) for f in live.failures(state, t)] == [("node_silent", "n1")]
    live.forget("n1")
    assert live.failures(state, 2.7) == []


def test_deadlines_that_bunch_are_all_judged_within_a_few_tallies():
    state = big_job(1000)
    live = Liveness(Timing(heartbeat_timeout_s=100.0, progress_timeout_s=1.0), now=0)
    for m in state.members:
        live.observe(m.node_id, state.generation, report(5), 0)  # every rank then stalls at once
    failed = set()
    tallies = 0
    while len(failed) < 1000 and tallies < 20:
        tallies += 1
        failed |= {f.node_id for f in live.failures(state, 1.5 + tallies * 0.05) if f.kind == "rank_stalled"}
    assert len(failed) == 1000 and tallies <= 1000 // 256 + 1


def test_a_stall_is_found_with_the_calibrated_timeout_not_the_one_when_its_deadline_was_set():
    state = job(2)
    live = Liveness(TIMING, now=0)
    live.observe("n0", 1, report(1, step_time_s=0), 0)  # no step time yet: the start-up timeout (30 s)
    now = 0.0
    for i in range(40):  # n1 calibrates the timeout to its floor (1 s); n0 keeps reporting step 1
        now = 0.05 * (i + 1)
        live.observe("n1", 1, report(i + 2), now)
        live.observe("n0", 1, report(1, state="running"), now)
        assert live.failures(state, now) == [] or now > 1.0
    found = []
    while not found and now < 5:
        now += 0.05
        live.observe("n1", 1, report(int(now * 100)), now)
        live.observe("n0", 1, report(1, state="running"), now)
        found = live.failures(state, now)
    assert [(f.kind, f.node_id) for f in found] == [("rank_stalled", "n0")] and now < 2.5


def test_a_generation_larger_than_one_look_is_judged_over_several_tallies():
    state = big_job(3000)
    live = Liveness(TIMING, now=0)
    live.generation_published(state.generation, 0)
    for m in state.members:  # all formed but the last node, still forming an older group
        live.observe(m.node_id, state.generation, [RankReport(0, 7, 0, 0.0, "forming", generation=state.generation)], 1)
    for m in state.members[:-1]:
        live.observe(m.node_id, state.generation, [RankReport(0, 7, 1, 0.05, "running", generation=state.generation)],
                     61 + TIMING.heartbeat_timeout_s / 2)
    live.observe("n2999", state.generation, [RankReport(0, 7, 0, 0.0, "forming", generation=0)],
                 61 + TIMING.heartbeat_timeout_s / 2)
    found, tallies = [], 0
    while not found and tallies < 10:
        tallies += 1
        now = 61.0 + TIMING.heartbeat_timeout_s / 2 + tallies * 0.01
        found = live.failures(state, now)
    assert [(f.kind, f.node_id) for f in found] == [("rank_not_formed", "n2999")] and tallies == 3


def test_nodes_that_progress_together_are_judged_spread_over_tallies(monkeypatch):
    state = big_job(1000)
    live = Liveness(TIMING, now=0)  # progress floor 1 s: each node judged again within 0.5-1 s of its progress
    judged = []
    monkeypatch.setattr(liveness, "judge_ranks", lambda *a: (judged.append(1), judge_ranks(*a))[1])
    per_tally = []
    for tick in range(1, 200):
        now = tick * 0.05
        if tick % 4 == 0:  # every node steps at once
            for m in state.members:
                live.observe(m.node_id, state.generation, report(tick), now)
        judged.clear()
        assert live.failures(state, now) == []
        per_tally.append(len(judged))
    steady = per_tally[40:]
    # Without the spread every node would come due in the same tally after each step (256 a tally,
    # the cap, for four tallies in a row); with it they come due over half a second.
    assert statistics.mean(steady) < 120 and sum(n == 256 for n in steady) <= len(steady) // 20


# ---- relayed nodes: their relay judges silence ---------------------------------------------------


def test_a_node_its_relay_vouches_for_is_never_found_silent_here():
    state = job(2)
    live = Liveness(TIMING, now=0)
    live.observe("n0", 1, report(1), 0, vouched=True)
    live.observe("n1", 1, report(1), 0)
    for t in (1.0, 2.0, 3.0):  # the relay forwards n0's frames only now and then; n1 streams directly
        live.observe("n1", 1, report(int(t * 10)), t)
    assert live.failures(state, 3.0) == []


def test_a_node_its_relay_found_silent_fails_at_the_next_tally():
    state = job(2)
    live = Liveness(TIMING, now=0)
    for t in (0.0, 1.0, 2.0, 2.4):
        live.observe("n0", 1, report(int(t * 10) + 1), t, vouched=True)
        live.observe("n1", 1, report(int(t * 10) + 1), t)
    live.silent_since("n0", 0.3)  # the relay's last frame of it: 2.1 s before
    assert [(f.kind, f.node_id) for f in live.failures(state, 2.45)] == [("node_silent", "n0")]


def test_a_node_whose_relay_went_away_has_a_heartbeat_timeout_to_come_back():
    state = job(2)
    live = Liveness(TIMING, now=0)
    live.observe("n0", 1, report(1), 0, vouched=True)
    live.observe("n1", 1, report(1), 0)
    live.unvouched("n0", 5.0)
    live.observe("n1", 1, report(2), 6.9)
    assert live.failures(state, 6.9) == []
    live.observe("n1", 1, report(3), 7.2)
    assert [(f.kind, f.node_id) for f in live.failures(state, 7.2)] == [("node_silent", "n0")]
    live.observe("n0", 1, report(2), 7.3, vouched=True)  # back through a relay: vouched for again
    live.observe("n1", 1, report(4), 20)
    assert live.failures(state, 20) == []


def test_a_steps_only_frame_records_what_the_full_frame_would():
    """`advance` (NodeFrame.steps_only, the hot path) against `observe` of the same frames: the same
    steps, progress times, step times and judgements, a stall and a rank its agent lost included."""
    state = job()
    full, fast = Liveness(TIMING, now=0), Liveness(TIMING, now=0)
    frames = [(1, 0), (2, 0), (3, 0), (3, 0), (4, 0), (4, 0), (4, 2500)]  # (step, heard_ms_ago)
    for i, (step, heard) in enumerate(frames):
        now = i * 0.05
        for live in (full, fast):
            live.observe("n1", 1, report(1), now)
        full.observe("n0", 1, report(step, heard_ms_ago=heard, compute_s=0.03), now)
        if i == 0:
            fast.observe("n0", 1, report(step, heard_ms_ago=heard, compute_s=0.03), now)
        else:
            assert fast.advance("n0", 1, [0], [(step, 50_000, heard, 30_000)], now)
    a, b = full.nodes["n0"].ranks[0], fast.nodes["n0"].ranks[0]
    assert (a.step, a.progress_at, a.heard_ms_ago, a.step_time_s, a.compute_s) == \
        (b.step, b.progress_at, b.heard_ms_ago, b.step_time_s, b.compute_s)
    assert list(full.step_times) == list(fast.step_times)
    end = len(frames) * 0.05
    assert [(f.kind, f.node_id) for f in fast.failures(state, end)] == [(f.kind, f.node_id)
                                                                        for f in full.failures(state, end)]
    assert [f.kind for f in fast.failures(state, end + 60)] == [f.kind for f in full.failures(state, end + 60)]


def test_a_steps_only_frame_for_other_ranks_or_another_generation_records_nothing():
    live = Liveness(TIMING, now=0)
    live.observe("n0", 1, report(1), 0)
    assert not live.advance("n0", 1, [0, 1], [(2, 1, 0, 0), (2, 1, 0, 0)], 0.1)  # rank 1 never reported
    assert not live.advance("n0", 2, [0], [(2, 1, 0, 0)], 0.1)  # a new generation: read in full
    assert not live.advance("n9", 1, [0], [(2, 1, 0, 0)], 0.1)  # never seen
    assert live.nodes["n0"].ranks[0].step == 1


def test_a_takeover_no_node_reaches_goes_on_in_grace_and_then_judges_from_the_first_frame():
    """Every node silent at once after a takeover is the path to the new leader (nodes behind a
    relay tied to the frozen predecessor, or trying it first), not every node dead: the grace goes
    on, bounded, until the first frame; from then on each node's silence counts from that frame."""
    state = job()
    live = Liveness(TIMING, now=100)
    live.start_grace(["n0", "n1"], now=100)  # grace 5 s, heartbeat timeout 2 s
    assert live.failures(state, 107.5) == []  # past the grace and a heartbeat timeout: nobody judged
    live.observe("n0", 1, report(1), 110)
    assert not live.in_grace(110.1)
    live.observe("n0", 1, report(2), 111.5)
    assert live.failures(state, 111.9) == []  # n1 gets a heartbeat timeout from the first frame
    assert [f.node_id for f in live.failures(state, 112.1)] == ["n1"]


def test_a_first_frame_just_inside_the_grace_leaves_the_others_a_heartbeat_timeout():
    """The first node reaches the new leader moments before its grace ends: the others, on their
    way the same path, are judged a heartbeat timeout after that frame, not at the grace's end."""
    state = job()
    live = Liveness(TIMING, now=100)
    live.start_grace(["n0", "n1"], now=100)  # grace 5 s, heartbeat timeout 2 s
    live.observe("n0", 1, report(1), 104.9)
    live.observe("n0", 1, report(2), 106.0)
    live.observe("n0", 1, report(3), 106.8)
    assert live.failures(state, 106.8) == []
    assert [f.node_id for f in live.failures(state, 107.0)] == ["n1"]


def test_a_member_that_does_not_reattach_is_judged_a_heartbeat_timeout_after_the_takeover_not_at_the_grace_end():
    """Issue 40: a node lost during an etcd outage held the new leader's decision for its whole 5 s
    grace although the survivors attached within 0.25 s of its election. The grace ends a heartbeat
    timeout after the first frame: the node that never came is judged then."""
    state = job(3)
    live = Liveness(TIMING, now=100)
    live.start_grace(["n0", "n1", "n2"], now=100)  # grace 5 s, heartbeat timeout 2 s
    live.observe("n0", 1, report(1), 100.1)
    live.observe("n1", 1, report(1), 100.25)
    for t in (100.5, 101.0, 101.5, 102.0):
        live.observe("n0", 1, report(2), t)
        live.observe("n1", 1, report(2), t)
    assert live.in_grace(102.05) and live.failures(state, 102.05) == []
    assert not live.in_grace(102.15)
    assert [(f.node_id, f.kind) for f in live.failures(state, 102.15)] == [("n2", FailureKind.NODE_SILENT)]


def test_the_grace_ends_once_every_member_has_attached():
    """Nobody is left to wait for: a member silent again after it attached is judged as usual, a
    heartbeat timeout after its last frame, not at the grace's end."""
    state = job()
    live = Liveness(TIMING, now=100)
    live.start_grace(["n0", "n1"], now=100)
    live.observe("n0", 1, report(1), 100.1)
    assert live.in_grace(100.2)
    live.observe("n1", 1, report(1), 100.2)
    assert not live.in_grace(100.2)
    steady(live, "n0", 2, 50, 100.2)  # to 102.7; n1 silent since 100.2
    assert [(f.node_id, f.kind) for f in live.failures(state, 102.3)][0] == ("n1", FailureKind.NODE_SILENT)


def test_a_member_that_reattaches_within_a_heartbeat_timeout_of_the_first_frame_is_kept():
    """The agents retry at most a quarter of the heartbeat timeout apart: one that comes after the
    first frame, but within the heartbeat timeout of it, is not judged."""
    state = job()
    live = Liveness(TIMING, now=100)
    live.start_grace(["n0", "n1"], now=100)
    live.observe("n0", 1, report(1), 100.1)
    live.observe("n1", 1, report(1), 102.0)
    for t in (102.5, 103.0):
        live.observe("n0", 1, report(2), t)
        live.observe("n1", 1, report(2), t)
    assert live.failures(state, 103.1) == []


def test_a_member_removed_during_the_grace_is_not_waited_for():
    live = Liveness(TIMING, now=100)
    live.start_grace(["n0", "n1", "n2"], now=100)
    live.observe("n0", 1, report(1), 100.1)
    live.observe("n1", 1, report(1), 100.1)
    live.forget("n2")  # its process exited: evicted during the grace
    assert not live.in_grace(100.2)


def test_a_takeover_nobody_ever_reaches_ends_its_grace_within_the_bound():
    state = job()
    live = Liveness(TIMING, now=0)
    live.start_grace(["n0", "n1"], now=0)
    bound = TIMING.grace_s + liveness.TAKEOVER_UNHEARD_TIMEOUTS * TIMING.heartbeat_timeout_s
    assert live.in_grace(bound - 0.1) and live.failures(state, bound - 0.1) == []
    assert sorted(f.node_id for f in live.failures(state, bound + 0.1)) == ["n0", "n1"]


def test_a_relays_summary_stands_for_its_nodes_progress_until_it_names_one_lagging():
    state = job(2)
    live, vouch = Liveness(TIMING, now=0), Vouch()
    live.observe("n0", 1, report(1), 0, vouched=True, vouch=vouch)
    for t in range(1, 21):  # n1 streams directly; its steps calibrate the timeout to its 1 s floor
        live.observe("n1", 1, report(t), t * 0.05)
    assert live.progress_timeout() == 1.0
    for t in (1.5, 2.5, 3.5, 4.5):  # n0's progress is its relay's word, no frame of it comes
        vouch.at, vouch.high = t, 90
        live.observe("n1", 1, report(int(t * 20)), t)
        assert live.failures(state, t) == []
    assert live.max_step(state) == 90
    live.lagging("n0", 1, since=4.0)  # its relay names it lagging: step 1 did not advance since 4.0
    vouch.at = 5.5
    live.observe("n1", 1, report(110), 5.5)
    assert [(f.kind, f.node_id) for f in live.failures(state, 5.5)] == [("rank_stalled", "n0")]
    live.resumed("n0")
    assert live.failures(state, 5.5) == []
    live.lagging("n0", 1, since=5.0)
    live.observe("n0", 1, report(111), 5.6, vouched=True, vouch=Vouch())  # through another relay now
    assert live.nodes["n0"].vouch is not vouch and not live.nodes["n0"].lagging  # the old relay's word is void


def test_nodes_of_the_map_that_never_trained_are_the_unformed_ones_as_the_job_finishes():
    """A node placed as the job finished: its ranks starting, forming their first group, or not
    reported yet (still importing) never trained; a node heard training, running a script, or not
    heard at all (a member a leader that just took over tracks, or one joined and on its way) is
    waited for."""
    state = job(4)
    live = Liveness(TIMING, now=0)
    live.start_grace(["n0", "n1", "n2"], now=0)
    live.track("n3", 0)
    assert live.assess(state, 0.05).unformed == set()  # nothing heard yet: nothing judged
    live.observe("n0", 1, report(20, state="finished"), 0.1)
    live.observe("n1", 1, report(0, state="forming"), 0.1)
    live.observe("n2", 1, [], 0.1)  # heard, its ranks not connected yet
    assert live.assess(state, 0.2).unformed == {"n1", "n2"}  # n3: never heard
    live.observe("n1", 1, report(0, state="starting"), 0.3)
    live.observe("n2", 1, report(0, state="script"), 0.3)
    assert live.assess(state, 0.4).unformed == {"n1"}
    live.observe("n1", 1, report(1), 0.5)
    assert live.assess(state, 0.6).unformed == set()
