"""A Join whose answer is lost is not a second node: under load a leader can admit a node after its
Join's deadline passed, and the node's next attempt then found its own membership and was refused
(ALREADY_EXISTS: "leave first"), ending the agent. Each attempt of one join carries the same join
key, so the retry is answered with the membership the lost attempt made, and streams with it.

Real etcd and coordinator; the node's channel loses the first Join's answer after the coordinator
gave it (a client interceptor), as a passed deadline does. And a Join given up before it joined the
job it made leaves no job forming for good."""

import asyncio
import time

import grpc
import pytest

from muster.client import Coordinators
from muster.local import SimulatedNode, wait_until
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


def test_a_job_whose_creating_join_never_reached_it_ends_failed_and_frees_its_name(coordinators):
    """The Join's deadline passes while its job is being made: the job exists, no node joined it,
    and its node is gone. After --form-timeout its run ends failed, saying so (it stayed forming for
    good before: a leader, an election and a place in --max-jobs per such Join), and the name's next
    Join starts run 2."""
    (replica,) = coordinators(1, extra=["--form-timeout", "3"])
    with Coordinators([replica.address]) as c:
        stub = c.stub(replica.address)
        for attempt in range(20):  # a deadline that passes after the job is made, before the node joins it
            job = f"ghost-{attempt}"
            req = pb.JoinRequest(job=job, node_id="n0", slots=1, host="127.0.0.1", store_port=1,
                                 spec=pb.JobSpec(min_nodes=1, max_nodes=1), join_key=bytes(32))
            try:
                stub.Join(req, timeout=0.002 * (attempt + 1))
                continue  # joined in time: not the case
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED, exc
            time.sleep(1.0)  # (the job's creation, if it began, is done by then)
            # (a Join its caller gave up on can still be taken: its node is then a member that never streams)
            if [(s.phase, list(s.nodes)) for s in job_status(stub, job)] == [("forming", [])]:
                break
        else:
            pytest.skip("no deadline fell between a job's creation and its Join on this host")
        ended = wait_until(lambda: [r for r in c.call("Jobs", pb.JobsRequest(job=job)).jobs if r.outcome != "running"],
                           30, "the empty run's end")
        assert [(r.run, r.outcome) for r in ended] == [(1, "failed")]
        assert ended[0].reason.startswith("no node joined within 3s of the job's creation"), ended[0].reason
        again = wait_until(lambda: joined(stub, req), 30, "a Join of the name starting run 2")
        assert again.run == 2


def job_status(stub, job: str) -> list[pb.JobStatus]:
    """The job's status, or none while it does not exist."""
    try:
        return list(stub.Status(pb.StatusRequest(job=job), timeout=5).jobs)
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.NOT_FOUND:
            return []
        raise


def joined(stub, req: pb.JoinRequest) -> pb.JoinResponse | None:
    try:
        return stub.Join(req, timeout=5)
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.UNAVAILABLE:  # the ended run's record is being settled
            return None
        raise
