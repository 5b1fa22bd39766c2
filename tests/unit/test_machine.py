"""The generation state machine: forming, unplanned and planned changes, spares, history."""

import asyncio

import pytest

from muster.coordinator.core.kinds import FailureKind
from muster.coordinator.core.machine import Context, Diverged, Join, Leave, NodeLost, SlotDown, SlotsUp, Tick, decide
from muster.coordinator.core.policy import JobSpec, Timing
from muster.coordinator.core.state import JobState, NodeKind, Phase, decode, encode
from muster.coordinator.errors import AlreadyExists, NotFound
from muster.coordinator.job.inbox import Inbox, settle

TIMING = Timing(last_call_s=1.0, switch_lead_s=0.5)


def ctx(now=0.0, max_step=0, step_time_s=None, term=7):
    return Context(now=now, wall_ms=1_700_000_000_000 + int(now * 1000), term=term, timing=TIMING,
                   max_step=max_step, step_time_s=step_time_s)


def join(i, slots=2, ticket=0):
    return Join(f"n{i}", f"10.0.0.{i}", 29500 + i, slots, ticket=ticket)


def running(n=3, spec=JobSpec(2, 3, 1)):
    state = JobState("job", spec)
    state = decide(state, [join(i) for i in range(1, n + 1)], ctx()).state
    return decide(state, [Tick()], ctx(now=2.0)).state


def test_job_forms_after_the_last_call_once_min_nodes_joined():
    state = JobState("job", JobSpec(2, 4, 1))
    d = decide(state, [join(1), join(2)], ctx(now=0.0))
    assert d.state.phase is Phase.FORMING and not d.new_generation and d.persist
    d = decide(d.state, [Tick()], ctx(now=0.5))
    assert not d.new_generation
    d = decide(d.state, [Tick()], ctx(now=1.0))
    assert d.new_generation and d.state.generation == 1 and d.state.rank_map.world_size == 4
    assert d.state.rank_map.store_address == "10.0.0.1:29501"
    assert [e.kind for e in d.events] == ["formed"]


def test_job_forms_at_once_when_max_nodes_joined():
    d = decide(JobState("job", JobSpec(1, 2, 1)), [join(1), join(2)], ctx())
    assert d.new_generation and d.state.rank_map.node_ids == ("n1", "n2")


def test_lost_node_publishes_an_abort_generation_without_it():
    state = running()
    d = decide(state, [NodeLost("n2", "node_silent", "no frame for 2.1s")], ctx(now=5, max_step=40))
    assert d.new_generation and d.persist
    rm = d.state.rank_map
    assert rm.generation == 2 and rm.abort_previous and rm.switch_at_step == 0
    assert rm.node_ids == ("n1", "n3") and rm.world_size == 4
    assert d.evicted == (("n2", 2),)
    assert [e.kind for e in d.events] == ["node_silent", "generation"]
    assert all(e.generation == 2 and e.term == 7 for e in d.events)


def test_losing_rank0_moves_the_store_to_the_next_surviving_node():
    d = decide(running(), [NodeLost("n1", "process_exited", "stream closed")], ctx(now=5))
    assert d.state.rank_map.placements[0].node_id == "n2"
    assert d.state.rank_map.store_address == "10.0.0.2:29502"


def test_failed_slot_aborts_and_the_node_keeps_its_other_local_rank():
    d = decide(running(), [SlotDown("n2", 0, "rank_exited", "exit code -9")], ctx(now=5))
    p = d.state.rank_map.placement("n2")
    assert p.slots == (1,) and p.rank_of(1) == 2 and d.state.rank_map.world_size == 5
    assert d.state.member("n2").down_slots == {0}


def test_slot_coming_back_is_a_planned_switch_ahead_of_the_fastest_rank():
    state = decide(running(), [SlotDown("n2", 0, "rank_exited", "exit code 1")], ctx(now=5)).state
    d = decide(state, [SlotsUp("n2", (0,))], ctx(now=6, max_step=100, step_time_s=0.1))
    rm = d.state.rank_map
    assert not rm.abort_previous and rm.switch_at_step == 100 + 6
    assert rm.placement("n2").slots == (0, 1)


def test_join_beyond_max_nodes_is_a_spare_and_makes_no_generation():
    state = running()
    d = decide(state, [join(4)], ctx(now=5))
    assert not d.new_generation and d.persist
    assert d.state.spares == ("n4",) and d.state.generation == state.generation


def test_spare_is_promoted_in_the_abort_generation():
    state = decide(running(), [join(4)], ctx(now=5)).state
    d = decide(state, [NodeLost("n1", "node_silent", "x")], ctx(now=6))
    assert d.state.rank_map.node_ids == ("n2", "n3", "n4") and d.state.spares == ()


def test_join_below_max_nodes_is_a_planned_switch():
    state = running(n=2)
    d = decide(state, [join(3)], ctx(now=5, max_step=10))
    assert d.new_generation and not d.state.rank_map.abort_previous
    assert d.state.rank_map.switch_at_step == 12 and d.joined[0].node_id == "n3"


def test_a_planned_switch_superseded_before_its_step_keeps_that_step():
    """Run G: generation 6 said "switch after step 4", and 0.15 s later 7 said "after step 7". The
    ranks that heard only 6 left their group after step 4; one that heard 7 stayed in it and hung.
    A map superseding a switch no rank has reached keeps its step; once reached, a new one is ahead."""
    state = decide(running(n=2, spec=JobSpec(2, 4, 1)), [join(3)], ctx(now=5, max_step=10)).state
    assert state.rank_map.switch_at_step == 12
    d = decide(state, [join(4)], ctx(now=5.2, max_step=11, step_time_s=0.1))
    assert d.new_generation and not d.state.rank_map.abort_previous and d.state.rank_map.switch_at_step == 12
    d = decide(d.state, [SlotDown("n4", 1, "rank_exited", "exit code 1")], ctx(now=5.3, max_step=12))
    assert d.state.rank_map.abort_previous  # (an abort leaves the planned switch behind)
    later = decide(state, [join(4)], ctx(now=6, max_step=12, step_time_s=0.1))  # 12 reached: the switch made
    assert later.state.rank_map.switch_at_step == 12 + 6  # (0.5 s of lead at 0.1 s a step, and one)


def test_graceful_leave_drains_the_node_at_the_switch_step():
    d = decide(running(), [Leave("n3", immediate=False, reason="SIGTERM")], ctx(now=5, max_step=10))
    assert d.drains == (("n3", 12),) and not d.state.rank_map.abort_previous
    assert d.state.member("n3") is None


def test_immediate_leave_aborts():
    d = decide(running(), [Leave("n3", immediate=True, reason="operator")], ctx(now=5))
    assert d.state.rank_map.abort_previous and d.drains == ()


def test_falling_below_min_nodes_waits_then_resumes_when_a_node_joins():
    state = running(n=2)
    d = decide(state, [NodeLost("n1", "node_silent", "x")], ctx(now=5))
    assert d.state.phase is Phase.WAITING and d.state.rank_map.world_size == 0 and d.new_generation
    d = decide(d.state, [join(9)], ctx(now=6))
    assert d.state.phase is Phase.RUNNING and d.state.rank_map.abort_previous
    assert d.state.rank_map.node_ids == ("n2", "n9")


def test_several_failures_in_one_tally_make_one_generation():
    d = decide(running(), [NodeLost("n2", "node_silent", "x"), SlotDown("n3", 1, "rank_stalled", "y")], ctx(now=5))
    assert d.state.generation == 2 and d.state.rank_map.world_size == 3


def test_duplicate_node_id_and_unknown_leave_are_rejected_and_change_nothing():
    state = running()
    d = decide(state, [join(1, ticket=1), Leave("nx", False, "", ticket=2), join(5, ticket=3)], ctx(now=5))
    assert list(d.rejected) == [1, 2], "refusals are keyed by the requests' tickets"
    dup, unknown = d.rejected[1], d.rejected[2]
    assert isinstance(dup, AlreadyExists) and "already a member" in str(dup)
    assert isinstance(unknown, NotFound) and "not a member" in str(unknown)
    assert [m.node_id for m in d.joined] == ["n5"] and d.state.member("n1") == state.member("n1")


def test_a_refusal_reaches_its_request_wherever_failures_stand_in_the_batch():
    """The leader decides the inbox's requests with what liveness found; a refusal is keyed by its
    request's ticket, so failures placed before the requests (which shifts every index) still leave
    each request its own answer."""
    async def tally():
        inbox = Inbox()
        answers = inbox.ask(join(5)), inbox.ask(join(1)), inbox.ask(Leave("nx", False, "gone"))
        batch = inbox.take()
        found = [NodeLost("n2", FailureKind.NODE_SILENT, "x"), SlotDown("n3", 1, FailureKind.RANK_STALLED, "y")]
        d = decide(running(), found + [event for event, _ in batch], ctx(now=5))
        settle(batch, d)
        return d, answers

    d, (joined, dup, unknown) = asyncio.run(tally())
    assert sorted(d.rejected) == [2, 3] and d.state.generation == 2 and d.state.member("n2") is None
    assert joined.result() == d.state.member("n5")
    assert isinstance(dup.exception(), AlreadyExists) and "already a member" in str(dup.exception())
    assert isinstance(unknown.exception(), NotFound) and "'nx'" in str(unknown.exception())


def test_repeated_loss_of_the_same_node_is_ignored():
    state = decide(running(), [NodeLost("n2", "node_silent", "x")], ctx(now=5)).state
    d = decide(state, [NodeLost("n2", "process_exited", "y")], ctx(now=6))
    assert not d.persist and not d.new_generation


def test_history_is_bounded():
    state = running()
    timing = Timing(history_limit=5)
    for i in range(10):
        c = Context(now=5 + i, wall_ms=0, term=1, timing=timing)
        state = decide(state, [Join(f"x{i}", "h", 1, 1)], c).state
    assert len(state.history) == 5 and state.history[-1].nodes == ("x9",)


def test_state_round_trips_through_its_encoding():
    state = decide(running(), [SlotDown("n2", 0, "rank_exited", "exit"), Join("p", "h", 1, 1, NodeKind.PROCESS)],
                   ctx(now=5)).state
    assert decode(encode(state)) == state


def test_a_placements_text_is_its_node_and_slots_and_a_renumbered_one_keeps_it():
    import json

    from muster.coordinator.core.state import Placement

    p = Placement('n"\u00e9\\1', 3, 24, (0, 2))
    assert p.json == json.dumps({"node_id": p.node_id, "slots": [0, 2]}, separators=(",", ":"), sort_keys=True)
    state = running(4, JobSpec(2, 4, 1))
    before = state.rank_map
    after = decide(state, [NodeLost("n3", "node_silent", "x")], ctx(now=5)).state.rank_map
    assert after.placements[:2] == before.placements[:2] and after.placements[0] is before.placements[0]
    moved, was = after.placements[2], before.placements[3]
    assert moved.node_id == "n4" and moved is not was and moved.json is was.json
    assert (moved.node_rank, moved.rank_offset) == (2, was.rank_offset - 2)


def test_a_schema_1_state_with_the_placements_numbers_written_is_read():
    import json

    state = decide(running(), [SlotDown("n2", 0, "rank_exited", "exit")], ctx(now=5)).state
    doc = json.loads(encode(state))
    assert doc["schema"] == 2 and set(doc["rank_map"]["placements"][1]) == {"node_id", "slots"}
    doc["schema"] = 1
    for p in state.rank_map.placements:  # what a build before schema 2 wrote
        doc["rank_map"]["placements"][p.node_rank].update(node_rank=p.node_rank, rank_offset=p.rank_offset)
    assert decode(json.dumps(doc).encode()) == state
    doc["schema"] = 3
    with pytest.raises(ValueError, match="unsupported job state schema 3 \\(this build reads 1, 2\\)"):
        decode(json.dumps(doc).encode())


def test_divergence_is_recorded_without_a_new_generation():
    state = running()
    d = decide(state, [Diverged(("n2",), "step 10: ranks [2] differ")], ctx(now=5))
    assert d.persist and not d.new_generation
    assert d.events[0].kind == "replicas_diverged" and d.events[0].nodes == ("n2",)


def test_a_finished_node_leaves_without_a_new_generation():
    d = decide(running(), [Leave("n3", immediate=False, reason="done", finished=True)], ctx(now=5))
    assert d.persist and not d.new_generation and d.state.member("n3") is None
    assert d.events[0].kind == "node_finished"


def test_generation_events_of_a_large_job_name_no_nodes_so_the_persisted_history_stays_small():
    small = running(3)
    assert decide(small, [NodeLost("n1", "node_silent", "x")], ctx()).events[-1].nodes == ("n2", "n3")
    big = running(40, JobSpec(2, 40, 1))
    event = decide(big, [NodeLost("n1", "node_silent", "x")], ctx()).events[-1]
    assert event.kind == "generation" and event.nodes == () and event.world_size == 78


def test_an_agent_joining_a_library_job_starts_its_ranks_first_and_enters_the_map_once_they_report():
    state = running(2, JobSpec(1, 3, 1))
    c = Context(now=5, wall_ms=0, term=7, timing=TIMING, max_step=50, step_time_s=0.1, prestart=True)
    d = decide(state, [join(3)], c)
    assert not d.new_generation and d.state.member("n3").down_slots == {0, 1}  # not in the map yet
    assert "starting its ranks first" in d.events[0].reason
    d = decide(d.state, [SlotsUp("n3", (0, 1))], ctx(now=9, max_step=90, step_time_s=0.1))
    rm = d.state.rank_map
    assert d.new_generation and not rm.abort_previous and rm.switch_at_step > 90
    assert rm.placement("n3").slots == (0, 1) and rm.world_size == 6


def test_without_the_library_a_joining_agent_enters_the_map_at_once():
    d = decide(running(2, JobSpec(1, 3, 1)), [join(3)], ctx(now=5, max_step=50, step_time_s=0.1))
    assert d.new_generation and d.state.rank_map.placement("n3").slots == (0, 1)


def test_a_large_state_is_stored_compressed_and_reads_back():
    big = running(2000, JobSpec(2, 2000, 1))
    data = encode(big)
    assert data[:1] != b"{" and len(data) < 256 * 1024
    assert decode(data) == big
    small = running()
    assert encode(small)[:1] == b"{" and decode(encode(small)) == small


def test_a_loss_only_abort_names_the_group_to_shrink_and_the_ranks_it_leaves_out():
    # ranks 0,1 on n1, 2,3 on n2, 4,5 on n3: n2 lost -> survivors 0,1,4,5 keep their order
    rm = decide(running(), [NodeLost("n2", "node_silent", "x")], ctx(now=5)).state.rank_map
    assert (rm.shrink_of, rm.excluded_ranks) == (1, (2, 3))
    rm = decide(running(), [SlotDown("n1", 0, "rank_exited", "exit code -9")], ctx(now=5)).state.rank_map
    assert (rm.shrink_of, rm.excluded_ranks) == (1, (0,))  # rank 0 too: the store moves, the survivors shrink
    state = decide(running(), [NodeLost("n1", "node_silent", "x")], ctx(now=5)).state
    assert decode(encode(state)).rank_map.excluded_ranks == (0, 1)


def test_an_abort_that_adds_a_rank_or_a_planned_switch_forms_a_new_group():
    state = decide(running(), [join(4)], ctx(now=5)).state  # a spare
    rm = decide(state, [NodeLost("n1", "node_silent", "x")], ctx(now=6)).state.rank_map
    assert rm.abort_previous and (rm.shrink_of, rm.excluded_ranks) == (0, ())  # n4 promoted: a full init
    rm = decide(running(), [Leave("n3", immediate=False, reason="SIGTERM")], ctx(now=5, max_step=10)).state.rank_map
    assert not rm.abort_previous and rm.shrink_of == 0  # planned: its ranks switch at a step, no abort
