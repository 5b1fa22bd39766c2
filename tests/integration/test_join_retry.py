"""A Join whose answer is lost is not a second node: under load a leader can admit a node after its
Join's deadline passed, and the node's next attempt then found its own membership and was refused
(ALREADY_EXISTS: "leave first"), ending the agent. Each attempt of one join carries the same join
key, so the retry is answered with the membership the lost attempt made, and streams with it.

Real etcd and coordinator; the node's channel loses the first Join's answer after the coordinator
gave it (a client interceptor), as a passed deadline does."""

import asyncio

import grpc
import pytest

from muster.client import Coordinators
from muster.local import SimulatedNode
from muster.security import ClientSecurity
from muster.v1 import muster_pb2 as pb

pytestmark = pytest.mark.timeout(90)


class _LoseFirstAnswer(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, lost: list):
        self.lost, self.joins = lost, 0

    async def intercept_unary_unary(self, continuation, details, request):
        call = await continuation(details, request)
        if details.method.endswith(b"/Join"):
            self.joins += 1
            if not self.lost:
                self.lost.append(await call)  # the coordinator answered; the node never hears it
                raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(),
                                           grpc.aio.Metadata(), "Deadline Exceeded (the answer lost)")
        return call


class AnswerLost(ClientSecurity):
    """The node's security (plaintext here), its channels losing the first Join's answer."""

    def __init__(self):
        super().__init__()
        self.lost: list[pb.JoinResponse] = []
        self.interceptor = _LoseFirstAnswer(self.lost)

    def aio_channel(self, address: str) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(address, interceptors=[self.interceptor])


def test_a_join_whose_answer_was_lost_gets_that_membership_on_its_retry_and_streams_with_it(coordinators):
    (replica,) = coordinators(1)
    security = AnswerLost()

    async def scenario():
        node = SimulatedNode([replica.address], "job", "n0", slots=1, spec=pb.JobSpec(min_nodes=1, max_nodes=2),
                             security=security, interval_s=0.1)
        joined = await node.join()
        node.start()
        await node.wait_for(lambda n: n.assignment().role == pb.ROLE_ACTIVE and n.step >= 3, 30,
                            "the node stepping in the job it joined")
        await node.session.stop()
        return joined

    joined = asyncio.run(scenario())
    (lost,) = security.lost
    assert security.interceptor.joins == 2  # the lost attempt and the retry
    assert (joined.member_id, joined.session_secret, joined.run) == (lost.member_id, lost.session_secret, lost.run)
    with Coordinators([replica.address]) as c:
        status = c.call("Status", pb.StatusRequest(job="job")).jobs[0]
    assert [r.node for r in status.ranks] == ["n0"] and status.generation == 1
    assert len(replica.find("membership_changed", kind="node_joined")) == 1
    assert not replica.find("join_refused") and not replica.find("request_refused")
