"""What the agent's hub tells a library rank that connects: the current map, and first the map
formed at once that a pending planned switch leaves, where that places the rank's slot and the rank
never ran it (the hub's side of the leader's `Streams.attach`)."""

from muster.v1 import muster_pb2 as pb
from muster.worker.agent.rank_hub import told_on_connect
from muster.worker.agent.slot import Slot

# Generation 1 formed at once on slots 0 and 1; generation 2 a switch after step 2 adding another node
FORMED = pb.Assignment(generation=1, role=pb.ROLE_ACTIVE, local_ranks=[0, 1], world_size=2)
PLANNED = pb.Assignment(generation=2, role=pb.ROLE_ACTIVE, local_ranks=[0, 1], world_size=4, switch_at_step=2)
ABORT = pb.Assignment(generation=3, role=pb.ROLE_ACTIVE, local_ranks=[0], world_size=3, abort_previous=True)


class FakeProcess:
    pid, returncode = 4242, None


def told(latest, base, slot: Slot, ran: int) -> list[int]:
    return [a.generation for a in told_on_connect(latest, base, slot, ran)]


def test_a_rank_that_never_ran_the_group_a_planned_switch_leaves_is_told_that_group_first():
    """A rank connecting late (its zygote slow, an import) while its peers form generation 1 and
    generation 2 waits at step 2: told 2 alone, it formed 2 and its peers waited for it in 1."""
    assert told(PLANNED, FORMED, Slot(0), ran=0) == [1, 2]


def test_otherwise_the_current_map_alone():
    assert told(PLANNED, FORMED, Slot(0), ran=1) == [2]  # it ran generation 1 (its stream connects again)
    assert told(PLANNED, FORMED, Slot(2), ran=0) == [2]  # generation 1 gives its slot no place
    assert told(ABORT, ABORT, Slot(0), ran=0) == [3]  # formed at once: nothing before it is pending
    assert told(PLANNED, None, Slot(0), ran=0) == [2]  # no map formed at once heard
    kept = Slot(0, proc=FakeProcess(), kept_pid=FakeProcess.pid)
    assert told(PLANNED, FORMED, kept, ran=0) == [2]  # kept across a rejoin: its group is gone
    assert told(None, None, Slot(0), ran=0) == []
