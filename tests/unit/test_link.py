"""The worker's link, in-process with a fake transport: what the mailbox keeps, and how the
transport's end reaches the owner (once, as a WorkerError; not at all after leaving). And the
Transport contract: NodeSession, RankLink and the fake keep it; a RankLink over a real gRPC stream
ends as the fake does."""

import asyncio

import grpc
import pytest

from muster.v1 import muster_pb2 as pb
from muster.v1 import muster_pb2_grpc as pb_grpc
from muster.worker.errors import CoordinatorLost, FencedOut, RunEnded
from muster.worker.link import Link, Transport
from muster.worker.node_session import Evicted, JobEnded, NodeIdentity, NodeSession
from muster.worker.rank_link import SLOT_SECRET_METADATA, RankLink


class FakeTransport:
    """Delivers what the test puts in, like NodeSession/RankLink: Evicted after an eviction."""

    def __init__(self, on_directive):
        self.on_directive = on_directive
        self.generation = self.joined_run = 0
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.left: dict = {}

    async def join(self, **_) -> None:
        pass

    def silent_s(self) -> float:
        return 0.0

    async def run(self) -> None:
        while (item := await self.inbox.get()) is not None:
            if isinstance(item, Exception):
                raise item
            self.on_directive(item)
            if item.HasField("assignment") and item.assignment.role == pb.ROLE_EVICTED:
                raise Evicted(item.assignment.reason)

    async def leave(self, **kwargs) -> None:
        self.left = kwargs

    async def stop(self) -> None:
        self.inbox.put_nowait(None)


def assignment(generation: int, *, role=pb.ROLE_ACTIVE, switch_at_step: int = 0, reason: str = "") -> pb.Directive:
    return pb.Directive(generation=generation, assignment=pb.Assignment(
        generation=generation, role=role, switch_at_step=switch_at_step, reason=reason))


@pytest.fixture
def link():
    seen, failures = [], []
    link = Link("test-link", on_directive=seen.append, on_failure=lambda e, cause: failures.append((e, cause)))
    link.open(FakeTransport)
    link.seen, link.failures = seen, failures
    yield link
    link.close()


def send(link: Link, item, *, news: bool = True) -> None:
    link.changed.clear()
    link.call(link.session.inbox.put(item))
    assert link.changed.wait(2 if news else 0.1) == news


def test_the_mailbox_keeps_the_newest_assignment_and_the_newest_formed_at_once(link):
    send(link, assignment(2))
    send(link, assignment(3, switch_at_step=10))  # a planned switch: not a base
    send(link, assignment(1))  # older: ignored by the mailbox, still told to the owner
    assert (link.latest.generation, link.base.generation) == (3, 2)
    assert [d.generation for d in link.seen] == [2, 3, 1]
    send(link, pb.Directive(drain=pb.Drain(after_step=7)))
    assert link.drain_after == 7


def test_an_eviction_fails_the_link_once_as_fenced_out(link):
    send(link, assignment(4, role=pb.ROLE_EVICTED, reason="hung"))
    (error, cause), = link.failures
    assert isinstance(error, FencedOut) and "hung" in str(error) and cause is None
    assert link.seen == []  # the failure tells the owner, not the directive


def test_a_lost_transport_is_coordinator_lost_with_its_cause(link):
    send(link, ConnectionError("refused"))
    (error, cause), = link.failures
    assert isinstance(error, CoordinatorLost) and isinstance(cause, ConnectionError)


def test_the_end_of_the_run_is_told_once_as_run_ended_and_kept_in_the_mailbox(link):
    send(link, JobEnded(pb.JobEnd(outcome="stopped", reason="operator", run=2)))
    (error, cause), = link.failures
    assert isinstance(error, RunEnded) and (error.outcome, error.reason) == ("stopped", "operator") and cause is None
    assert link.ended.outcome == "stopped"


def test_the_end_after_leaving_is_no_failure(link):
    link.leave(finished=True, reason="done")
    send(link, Evicted("not a member"), news=False)
    assert link.session.left == {"finished": True, "reason": "done"} and link.failures == []


def test_the_generation_run_reaches_the_transport_and_a_reopen_empties_the_mailbox(link):
    async def generation():
        return link.session.generation

    link.running(5)
    assert link.call(generation()) == 5
    send(link, assignment(6))
    old = link.session
    link.open(FakeTransport)
    assert link.session is not old and link.latest is None and link.base is None and link.ended is None


def test_every_transport_keeps_the_protocol():
    node = NodeSession(["127.0.0.1:1"], NodeIdentity("j", "n", 1, "127.0.0.1", 1), reports=list,
                       on_directive=print)
    rank = RankLink("/nonexistent.sock", 0, "secret", report=pb.RankReport, on_directive=print)
    for transport in (node, rank, FakeTransport(print)):
        assert isinstance(transport, Transport), type(transport).__name__


class _Agent(pb_grpc.NodeAgentServicer):
    """An agent's end of the rank stream that sends what it is given, after checking the slot's secret."""

    def __init__(self, directives: list[pb.Directive]):
        self.directives = directives

    async def RankSession(self, request_iterator, context):
        if dict(context.invocation_metadata()).get(SLOT_SECRET_METADATA) != "secret":
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "wrong secret")
        await anext(aiter(request_iterator))  # the rank's first report
        for d in self.directives:
            yield d


@pytest.mark.timeout(30)
@pytest.mark.parametrize("last, raised", [(assignment(3, role=pb.ROLE_EVICTED, reason="hung"), Evicted),
                                          (pb.Directive(end=pb.JobEnd(reason="done")), JobEnded)])
def test_a_rank_link_delivers_then_ends_as_the_contract_says(tmp_path, last, raised):
    async def scenario():
        server = grpc.aio.server()
        pb_grpc.add_NodeAgentServicer_to_server(_Agent([assignment(2), last]), server)
        server.add_insecure_port(f"unix:{tmp_path}/agent.sock")
        await server.start()
        seen = []
        try:
            link = RankLink(f"{tmp_path}/agent.sock", 0, "secret", report=pb.RankReport, on_directive=seen.append)
            await link.join()  # (the agent is the member: nothing to do)
            with pytest.raises(raised):
                await asyncio.wait_for(link.run(), 10)
        finally:
            await server.stop(None)
        return seen

    seen = asyncio.run(scenario())
    assert [d.WhichOneof("kind") for d in seen] == ["assignment", last.WhichOneof("kind")]
