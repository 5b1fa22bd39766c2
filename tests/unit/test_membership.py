"""An agent whose node the leader removed (unheard) joins again, against a fake NodeSession: with its
ranks held, as a new member; never into a later run of the job (it leaves at once), never while the
job finishes, and not endlessly when every rejoin is removed before a word of the leader."""

import asyncio
import sys

import grpc
import pytest

from muster.v1 import muster_pb2 as pb
from muster.worker.agent.agent import NodeAgent
from muster.worker.agent.agent_config import AgentConfig
from muster.worker.agent.membership import MAX_REJOINS
from muster.worker.agent.rank_hub import RankHub
from muster.worker.agent.slot import Slot
from muster.worker.node_session import Evicted
from muster.worker.outcome import EXIT_FAILED

pytestmark = pytest.mark.timeout(30)


class RefusedJoin(grpc.aio.AioRpcError):
    def __init__(self):
        super().__init__(grpc.StatusCode.ALREADY_EXISTS, grpc.aio.Metadata(), grpc.aio.Metadata(),
                         details="node 'n' is already a member of job 'j'")


class FakeSession:
    """Each run() raises the next eviction (or returns: the stream ended); join() gives the next run."""

    def __init__(self, evictions: int, *, heard: bool = False, runs: tuple[int, ...] = (), refuse: bool = False):
        self.evictions, self.heard, self.refuse = evictions, heard, refuse
        self.runs = list(runs)
        self.joined_run, self.member_id, self.heard_as_member = 1, 1, False
        self.finishing = False
        self.joins = 0
        self.left: list[dict] = []

    async def run(self) -> None:
        self.heard_as_member = self.heard
        if self.evictions:
            self.evictions -= 1
            raise Evicted("node 'n' is not a member of job 'j': join first")

    async def join(self, *, retry_for_s: float) -> pb.JoinResponse:
        if self.refuse:
            raise RefusedJoin()
        self.joins += 1
        self.member_id += 1
        self.joined_run = self.runs.pop(0) if self.runs else self.joined_run
        self.heard_as_member = False
        return pb.JoinResponse(member_id=self.member_id, run=self.joined_run)

    async def leave(self, **kwargs):
        self.left.append(kwargs)
        return pb.LeaveResponse()


def stream(session: FakeSession, *, finishing: bool = False) -> tuple[NodeAgent, int | None]:
    async def scenario():
        a = NodeAgent(AgentConfig(coordinators=("127.0.0.1:1",), job="j", node_id="n", slots=1,
                                  argv=(sys.executable, "train.py")))
        a.session = session
        a._done = asyncio.get_running_loop().create_future()
        a.slots[0].finished = finishing
        await a._stream()
        return a, a._done.result() if a._done.done() else None
    return asyncio.run(asyncio.wait_for(scenario(), 10))


def test_a_node_removed_unheard_joins_again_as_a_new_member():
    session = FakeSession(2, heard=True)
    _, code = stream(session)
    assert code is None and session.joins == 2 and session.member_id == 3 and not session.left


def test_rejoins_none_of_which_the_leader_answers_end_the_node():
    session = FakeSession(10)
    _, code = stream(session)
    assert code == EXIT_FAILED and session.joins == MAX_REJOINS


def test_a_node_whose_run_ended_meanwhile_leaves_the_next_run_at_once():
    session = FakeSession(1, runs=(2,))
    _, code = stream(session)
    assert code == EXIT_FAILED and session.joins == 1
    assert session.left and session.left[0]["immediate"] and "run 1 ended" in session.left[0]["reason"]


def test_a_finishing_job_is_not_joined_again():
    session = FakeSession(1)
    _, code = stream(session, finishing=True)
    assert code == EXIT_FAILED and session.joins == 0


def test_a_refused_rejoin_ends_the_node_with_the_refusal(capsys):
    session = FakeSession(1, refuse=True)
    _, code = stream(session)
    assert code == EXIT_FAILED
    assert "could not join again: ALREADY_EXISTS" in capsys.readouterr().err


class Running:
    """A live process, as a slot sees one."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None


def test_a_rank_kept_across_the_rejoin_is_told_to_leave_its_group_and_the_others_are_told_as_the_leader_said():
    kept, placed = Slot(0, proc=Running(101), kept_pid=101), Slot(1, proc=Running(102))
    hub = RankHub(node=None)
    to_kept, to_placed = asyncio.Queue(), asyncio.Queue()
    hub.queues = {to_kept: kept, to_placed: placed}
    switch = pb.Directive(term=3, generation=3, assignment=pb.Assignment(
        generation=3, role=pb.ROLE_ACTIVE, local_ranks=[0, 1], switch_at_step=11))
    hub.deliver(switch)
    # The leader removed its node, so the others aborted the group it is in: it leaves at once
    # rather than step on in it to the switch (a gloo wait there may never end).
    gone = to_kept.get_nowait()
    assert gone.assignment.abort_previous and gone.assignment.switch_at_step == 11
    assert to_placed.get_nowait() == switch and not switch.assignment.abort_previous
    hub.deliver(pb.Directive(term=3, drain=pb.Drain(after_step=20)))
    assert to_kept.get_nowait().HasField("drain")
