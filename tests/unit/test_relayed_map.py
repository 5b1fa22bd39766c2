"""A loss-only map sent once per relay (`streams.RelayedMaps`) and renumbered by the relay for each
of its nodes (`relay.renumbered`): every node ends with the directive the leader would have sent it."""

from muster.coordinator import wire
from muster.coordinator.core.kinds import FailureKind
from muster.coordinator.core.machine import Context, Join, NodeLost, SlotDown, Tick, decide
from muster.coordinator.core.policy import JobSpec, Timing
from muster.coordinator.core.rankmap import removed_node_ranks
from muster.coordinator.core.state import JobState
from muster.coordinator.core.relay_fold import placement_of, renumbered
from muster.v1 import muster_pb2 as pb

TIMING = Timing(heartbeat_timeout_s=2.0)


def ctx(now: float) -> Context:
    return Context(now=now, wall_ms=0, term=1, timing=TIMING)


def running(nodes: int, slots: int) -> JobState:
    joins = [Join(f"n{i:02d}", "h", 1, slots) for i in range(nodes)]
    state = decide(JobState("job", JobSpec(1, nodes, 1)), joins, ctx(0.0)).state
    return decide(state, [Tick()], ctx(TIMING.last_call_s + 1)).state


def relayed_map(before: JobState, after: JobState) -> pb.RelayedMap:
    shared = wire.Assignments(after, "why").active
    return pb.RelayedMap(directive=shared, removed_node_ranks=removed_node_ranks(before.rank_map, after.rank_map))


def test_every_node_a_relay_renumbers_gets_the_directive_the_leader_would_send():
    before = running(9, 4)
    after = decide(before, [NodeLost("n02", FailureKind.NODE_SILENT, "x"), NodeLost("n06", FailureKind.NODE_SILENT, "x"),
                            SlotDown("n04", 1, FailureKind.RANK_EXITED, "x")], ctx(10.0)).state
    rm = after.rank_map
    assert rm.shrink_of == before.generation and rm.excluded_ranks
    m = relayed_map(before, after)
    assert list(m.removed_node_ranks) == [2, 6]
    given = {n: placement_of(wire.Assignments(before, "").directive(n)) for n in before.rank_map.by_node}
    directive = wire.Assignments(after, "why").directive
    for node_id, placement in given.items():
        mine = renumbered(placement, m)
        if node_id in ("n02", "n06"):
            assert mine is None  # left out: none of its ranks is left
        elif node_id == "n04":  # a slot down: the leader sends it its own (its down ranks with it)
            assert list(mine.assignment.local_ranks) == [0, 2, 3] and not directive(node_id) == mine
        else:
            assert mine == directive(node_id), node_id
    assert renumbered(None, m) is None and renumbered((before.generation - 1, 0, 0, (0,)), m) is None
