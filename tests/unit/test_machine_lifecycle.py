"""A job's life in the pure core: a run ends exactly once, with an outcome and its reason; nothing
re-forms a finishing job; stop drains every node at one step; waiting too long fails the run."""

from dataclasses import replace

import pytest

from muster.coordinator.core.machine import (Context, Finishing, Join, Leave, NodeLost, Regroup, Rejoin, SlotDown, SlotsUp,
                                             Stop, Tick, decide)
from muster.coordinator.core.policy import JobSpec, Timing
from muster.coordinator.core.state import JobState, Outcome, decode, encode
from muster.coordinator.errors import FailedPrecondition, NotFound, RunEnded, Unavailable
from muster.coordinator.job.frames import member_of

TIMING = Timing(last_call_s=1.0, switch_lead_s=0.5, waiting_timeout_s=30.0)


def ctx(now=0.0, max_step=0):
    return Context(now=now, wall_ms=1_700_000_000_000 + int(now * 1000), term=7, timing=TIMING, max_step=max_step,
                   step_time_s=0.1)


def running(n=3, spec=JobSpec(2, 3, 1)):
    state = decide(JobState("job", spec), [Join(f"n{i}", "10.0.0.1", 29500 + i, 2) for i in range(1, n + 1)], ctx())
    return decide(state.state, [Tick()], ctx(now=2.0)).state


def test_every_node_finishing_succeeds_once_and_nothing_reforms_meanwhile():
    state = running()
    d = decide(state, [Finishing("n1", "local rank 0 completed its script")], ctx(now=3))
    assert d.state.finishing and d.persist and not d.new_generation and not d.state.ended
    assert [e.kind for e in d.events] == ["finishing"]
    # a rank dying now (the others left the final collective) re-forms nothing
    d = decide(d.state, [SlotDown("n2", 1, "rank_exited", "killed by signal 6"),
                         Regroup("group_broken", "holding")], ctx(now=4))
    assert not d.new_generation and d.state.generation == state.generation
    failed = d.state
    d = decide(state, [Leave("n1", False, "done", finished=True), Leave("n2", False, "done", finished=True)],
               ctx(now=5))
    assert d.state.finishing and not d.state.ended
    d = decide(d.state, [Leave("n3", False, "done", finished=True)], ctx(now=6))
    assert d.ended and d.state.outcome is Outcome.SUCCEEDED and d.state.ended_ms == 1_700_000_006_000
    assert "completed its script" in d.state.outcome_reason and d.events[-1].kind == "succeeded"
    assert decode(encode(d.state)) == d.state
    again = decide(d.state, [Tick()], ctx(now=7))
    assert not again.ended and again.state.outcome is Outcome.SUCCEEDED and again.state.ended_ms == d.state.ended_ms
    # ...and with the rank that died while finishing: failed, naming it
    d = decide(failed, [Leave(n, False, "done", finished=True) for n in ("n1", "n2", "n3")], ctx(now=6))
    assert d.state.outcome is Outcome.FAILED and "rank 3" in d.state.outcome_reason


@pytest.mark.parametrize("high_step, said", [
    (17, "every rank that trained completed its script before generation 3's switch after step 17: the ranks it "
         "placed anew never trained"),
    (20, "every rank of generation 3 completed its script (world size 6)"),
])
def test_a_run_that_finished_before_its_maps_planned_switch_says_the_ranks_placed_anew_never_trained(high_step, said):
    """A killed rank's survivors re-form without it (abort), its replacement gets a place at a planned
    switch, and the job finishes before that step: its agent ends the replacement (`outrun`), and the
    run does not claim that the map's ranks completed their script."""
    state = running()
    aborted = decide(state, [SlotDown("n2", 1, "rank_exited", "killed by signal 9")], ctx(now=3, max_step=10)).state
    assert aborted.rank_map.abort_previous and aborted.rank_map.world_size == 5
    switched = decide(aborted, [SlotsUp("n2", (1,))], ctx(now=4, max_step=11)).state
    rm = switched.rank_map
    assert (rm.generation, rm.world_size, rm.abort_previous, rm.switch_at_step) == (3, 6, False, 17)
    d = decide(switched, [Leave(n, False, "done", finished=True) for n in ("n1", "n2", "n3")],
               replace(ctx(now=5, max_step=12), high_step=high_step))
    assert d.state.outcome is Outcome.SUCCEEDED and d.state.outcome_reason == said


@pytest.mark.parametrize("multiple", [1, 4])
def test_a_forming_job_waits_its_last_call_only_once_it_could_run(multiple):
    """The last call starts once the nodes gathered could form a map (a size rule may still cut them
    below min_nodes), and the job forms at its end, or at once with max_nodes."""
    state = JobState("job", JobSpec(2, 5, multiple))
    d = decide(state, [Join("n1", "10.0.0.1", 29500, 1)], ctx(now=0))
    assert d.state.forming_deadline is None and d.state.rank_map is None  # below min_nodes
    d = decide(d.state, [Join("n2", "10.0.0.2", 29500, 1)], ctx(now=0.5))
    runnable = multiple == 1  # 2 slots: no world size of a multiple of 4
    assert d.state.forming_deadline == (0.5 + TIMING.last_call_s if runnable else None)
    d = decide(d.state, [Join("n3", "10.0.0.3", 29500, 1), Join("n4", "10.0.0.4", 29500, 1)], ctx(now=1.0))
    assert d.state.rank_map is None and d.state.forming_deadline == (0.5 if runnable else 1.0) + TIMING.last_call_s
    d = decide(d.state, [Tick()], ctx(now=2.6))
    assert d.new_generation and d.state.rank_map.world_size == 4 and d.state.forming_deadline is None
    assert decide(JobState("job", JobSpec(2, 2, multiple)), [Join(f"n{i}", "10.0.0.1", 29500 + i, 2) for i in (1, 2)],
                  ctx(now=0)).new_generation  # max_nodes: no last call


def test_a_spare_left_over_does_not_hold_the_end():
    state = running(3, JobSpec(1, 2, 1))
    assert len(state.spares) == 1
    d = decide(state, [Leave(n, False, "done", finished=True) for n in state.rank_map.node_ids], ctx(now=3))
    assert d.state.outcome is Outcome.SUCCEEDED and [m.node_id for m in d.state.members] == list(state.spares)


def test_stop_drains_every_node_at_one_step_and_refuses_joins_and_a_second_stop():
    state = running()
    d = decide(state, [Stop("maintenance")], ctx(now=3, max_step=40))
    assert d.ended and d.state.outcome is Outcome.STOPPED and d.state.outcome_reason == "maintenance"
    steps = {step for _, step in d.drains}
    assert sorted(n for n, _ in d.drains) == ["n1", "n2", "n3"] and len(steps) == 1 and steps.pop() > 40
    d2 = decide(d.state, [Stop("again", ticket=1), Join("n9", "10.0.0.9", 1, 1, ticket=2)], ctx(now=4))
    assert isinstance(d2.rejected[1], FailedPrecondition) and isinstance(d2.rejected[2], Unavailable)
    d3 = decide(d2.state, [NodeLost("n1", "node_silent", "x"), Leave("n2", False, "drained")], ctx(now=5))
    assert not d3.new_generation and d3.state.outcome is Outcome.STOPPED and d3.state.outcome_reason == "maintenance"


@pytest.mark.parametrize("how, outcome", [("left", Outcome.STOPPED), ("left_now", Outcome.FAILED),
                                          ("lost", Outcome.FAILED)])
def test_the_last_node_going_ends_the_run(how, outcome):
    state = running(2, JobSpec(1, 2, 1))
    events = {"left": [Leave("n1", False, "drain"), Leave("n2", False, "drain")],
              "left_now": [Leave("n1", True, "form timeout"), Leave("n2", True, "form timeout")],
              "lost": [NodeLost("n1", "node_silent", "x"), NodeLost("n2", "node_silent", "x")]}[how]
    d = decide(state, events, ctx(now=3))
    assert d.ended and d.state.outcome is outcome


def test_a_job_below_min_nodes_fails_after_the_waiting_timeout():
    state = running(2, JobSpec(2, 2, 1))
    d = decide(state, [NodeLost("n2", "node_silent", "x")], ctx(now=3))
    assert d.state.phase.value == "waiting" and not d.ended
    d = decide(d.state, [Tick()], ctx(now=20))
    assert not d.ended
    d = decide(d.state, [Tick()], ctx(now=3 + 30))
    assert d.ended and d.state.outcome is Outcome.FAILED and "min_nodes" in d.state.outcome_reason


def test_a_job_no_node_ever_joined_fails_after_the_form_timeout():
    """The Join that created it never reached it (its deadline passed while the job was being made)
    and its node did not come back: the run ends, named so, instead of forming for good. A job being
    rebuilt from its nodes, or one a node joins in time, waits on."""
    empty = JobState("job", JobSpec(1, 2, 1))
    d = decide(empty, [Tick()], ctx(now=1))
    assert d.state.waiting_deadline == 1 + TIMING.form_timeout_s and not d.ended
    assert not decide(d.state, [Tick()], ctx(now=TIMING.form_timeout_s)).ended
    d = decide(d.state, [Tick()], ctx(now=1 + TIMING.form_timeout_s))
    assert d.ended and d.state.outcome is Outcome.FAILED and d.persist
    assert d.state.outcome_reason.startswith(f"no node joined within {TIMING.form_timeout_s:g}s of the job's creation")
    joined = decide(decide(empty, [Tick()], ctx(now=1)).state, [Join("n1", "10.0.0.1", 29500, 2)], ctx(now=2))
    assert joined.state.waiting_deadline is None
    assert not decide(joined.state, [Tick()], ctx(now=10 + TIMING.form_timeout_s)).ended
    rebuilding = decide(replace(empty, rebuilding=True), [Tick()], ctx(now=1))
    assert rebuilding.state.waiting_deadline is None


def test_a_node_claiming_its_place_back_in_an_ended_run_is_told_how_it_ended():
    """Its stream came back after the run ended (a leader change near the end): told the outcome, as
    a replica that already forgot the run tells it, never "join first" (which would make run 2)."""
    state = running(1, JobSpec(1, 1, 1))
    ended = decide(state, [Leave("n1", False, "done", finished=True)], ctx(now=3)).state
    assert ended.outcome is Outcome.SUCCEEDED
    d = decide(ended, [Rejoin("n1", 1, ended.generation, "", "10.0.0.1", 29501, 2, ticket=5)], ctx(now=4))
    refusal = d.rejected[5]
    assert isinstance(refusal, RunEnded) and (refusal.run, refusal.outcome) == (ended.run, "succeeded"), refusal
    assert not d.persist and not d.state.members


def test_a_node_that_left_a_run_which_ended_is_told_how_it_ended_not_to_join_first():
    """Its stream back before the leader wrote the run's record and forgot the job (CI run L): "join
    first" would have it join again, and make a new run of a job that ended."""
    state = running(1, JobSpec(1, 1, 1))
    ended = decide(state, [Leave("n1", False, "done", finished=True)], ctx(now=3)).state
    assert ended.ended and not ended.members
    with pytest.raises(RunEnded, match=r"run 1 of job 'job' has ended \(succeeded\)"):
        member_of(ended, "n1", 1)
    with pytest.raises(NotFound, match="join first"):
        member_of(state, "n9", 1)
