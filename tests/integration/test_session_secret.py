"""A member's Session and Leave need the secret its Join handed out: a stranger who guesses the
(small, counted) member_id gets PERMISSION_DENIED and changes nothing; the real node streams on."""

import asyncio

import grpc
import pytest
from muster.local import SimulatedNode, wait_until

from muster.v1 import muster_pb2 as pb
from muster.v1 import muster_pb2_grpc as pb_grpc

JOB = "sec"


async def live_step(stub, node_id: str) -> int:
    """The step the leader has last heard from `node_id`'s rank."""
    status = await stub.Status(pb.StatusRequest(job=JOB), timeout=5)
    return max(r.step for r in status.jobs[0].ranks if r.node == node_id)


async def forged_session(stub, frame: pb.NodeFrame) -> grpc.aio.AioRpcError:
    async def frames():
        yield frame
        await asyncio.sleep(5)  # held open: a refusal must come from the leader, not from a closed stream

    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in stub.Session(frames(), timeout=5):
            pass
    return err.value


@pytest.mark.timeout(60)
def test_a_forged_session_or_leave_is_refused_and_the_real_node_keeps_its_stream_and_place(coordinators):
    (leader,) = coordinators(1)

    async def scenario():
        spec = pb.JobSpec(min_nodes=2, max_nodes=2)
        real, other = (SimulatedNode([leader.address], JOB, node_id, slots=1, spec=spec) for node_id in ("g1", "g2"))
        for node in (real, other):
            await node.join()
            node.start()
        for node in (real, other):
            await node.wait_for(lambda x: x.assignment().role == pb.ROLE_ACTIVE, 10, "first map")
        assert len(real.session.secret) == 32 and real.session.secret != other.session.secret
        generation = real.generation
        async with grpc.aio.insecure_channel(leader.address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            claim = dict(job=JOB, node_id="g1", member_id=real.member_id, term=real.term, generation=generation)
            for secret in (b"", b"\0" * 32, other.session.secret):
                err = await forged_session(stub, pb.NodeFrame(**claim, session_secret=secret))
                assert err.code() == grpc.StatusCode.PERMISSION_DENIED, err.details()
                assert "session secret" in err.details()
                with pytest.raises(grpc.aio.AioRpcError) as left:
                    await stub.Leave(pb.LeaveRequest(job=JOB, node_id="g1", member_id=real.member_id,
                                                     immediate=True, session_secret=secret), timeout=5)
                assert left.value.code() == grpc.StatusCode.PERMISSION_DENIED, left.value.details()

            # the real node's stream is the one it opened, and the leader still hears its steps
            before = await live_step(stub, "g1")
            deadline = asyncio.get_running_loop().time() + 5
            while await live_step(stub, "g1") <= before + 3:
                assert asyncio.get_running_loop().time() < deadline, "the leader stopped hearing g1"
                await asyncio.sleep(0.05)
            status = (await stub.Status(pb.StatusRequest(job=JOB), timeout=5)).jobs[0]
            assert list(status.nodes) == ["g1", "g2"] and status.generation == generation
            assert not real.errors and real.assignment().role == pb.ROLE_ACTIVE
            assert len(leader.find("node_attached", node="g1")) == 1

            # the node itself leaves with its secret
            response = await other.session.leave(immediate=True, reason="done")
            assert response.generation > generation
        for node in (real, other):
            await node.stop()
        return real.session.secret, other.session.secret

    secrets = asyncio.run(scenario())
    def counted(event):  # refusals are counted lines (`quotas.RefusalLog`): one a second at most
        return sum(r["refused"] for r in leader.find(event, code="PERMISSION_DENIED"))

    wait_until(lambda: counted("session_refused") == 3 and counted("request_refused") == 3, 3, "3 and 3 refusals")
    text = leader.log_path.read_text()
    for secret in secrets:  # never logged, in any form
        assert secret.hex() not in text and repr(secret)[2:-1] not in text
