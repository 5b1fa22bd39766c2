"""Deployment limits: past each one a request gets RESOURCE_EXHAUSTED naming the limit, and the
leader keeps serving everyone else. A real coordinator on a real etcd, raw gRPC clients."""

import asyncio

import grpc
import pytest

from muster.local import SimulatedNode
from muster.v1 import muster_pb2 as pb
from muster.v1 import muster_pb2_grpc as pb_grpc


def join(stub, job: str, node: str) -> pb.JoinResponse:
    return stub.Join(pb.JoinRequest(job=job, node_id=node, slots=1, host="127.0.0.1", store_port=1,
                                    spec=pb.JobSpec(min_nodes=1, max_nodes=8)), timeout=10)


@pytest.mark.timeout(60)
def test_jobs_nodes_and_frames_are_limited(coordinators):
    (leader,) = coordinators(1, extra=["--max-jobs", "2", "--max-nodes-per-job", "3", "--max-frames-per-second", "20"])
    with grpc.insecure_channel(leader.address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        join(stub, "one", "a")
        join(stub, "two", "a")
        with pytest.raises(grpc.RpcError) as err:
            join(stub, "three", "a")
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-jobs 2" in err.value.details()

        join(stub, "one", "b")
        join(stub, "one", "c")
        with pytest.raises(grpc.RpcError) as err:
            join(stub, "one", "d")
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "its members quota" in err.value.details() and "--max-nodes-per-job (3)" in err.value.details()

    async def flood_and_a_well_behaved_node():
        calm = SimulatedNode([leader.address], "two", "calm", slots=1, spec=pb.JobSpec(min_nodes=1, max_nodes=8))
        await calm.join()
        calm.start()
        await calm.wait_for(lambda x: x.assignment().role == pb.ROLE_ACTIVE, 10, "a place")
        async with grpc.aio.insecure_channel(leader.address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            response = await stub.Join(pb.JoinRequest(job="two", node_id="flood", slots=1, host="127.0.0.1",
                                                      store_port=1))

            async def frames():
                for _ in range(500):
                    yield pb.NodeFrame(job="two", node_id="flood", member_id=response.member_id,
                                       session_secret=response.session_secret)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.Session(frames()):
                    pass
            # gRPC aio may report the write it was still making when the server ended the call
            # (INTERNAL, "Failed execute_batch") instead of the server's status: that is in its log
            assert err.value.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL)
            status = await stub.Status(pb.StatusRequest(job="two"))  # still serving
        step, pulses = calm.step, calm.session.pulses
        await calm.wait_for(lambda x: x.step >= step + 10 and x.session.pulses >= pulses + 2, 10,
                            "ten more frames and two more of the leader's pulses")
        assert not calm.errors  # the well-behaved node streams on
        await calm.stop()
        return status

    status = asyncio.run(flood_and_a_well_behaved_node())
    assert [r for r in leader.find("session_refused", code="RESOURCE_EXHAUSTED") if "frames/s" in r["error"]]
    assert status.jobs[0].live
    assert leader.proc.poll() is None
