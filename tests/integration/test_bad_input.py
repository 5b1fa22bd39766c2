"""Bad input gets a precise gRPC status and message; the leader keeps serving; nothing changes."""

import asyncio
import socket

import grpc
import pytest
from muster.local import SimulatedNode

from muster.net import split_host_port
from muster.v1 import muster_pb2 as pb
from muster.v1 import muster_pb2_grpc as pb_grpc


def join_request(**over):
    req = dict(job="bad", node_id="n9", slots=1, host="127.0.0.1", store_port=29500)
    req.update(over)
    return pb.JoinRequest(**req)


CASES = [
    ("Join", join_request(job="Bad Name!"), "INVALID_ARGUMENT", "job name"),
    ("Join", join_request(node_id=""), "INVALID_ARGUMENT", "node_id"),
    ("Join", join_request(slots=0), "INVALID_ARGUMENT", "slots must be in 1..1024"),
    ("Join", join_request(slots=5000), "INVALID_ARGUMENT", "slots must be in 1..1024"),
    ("Join", join_request(host=""), "INVALID_ARGUMENT", "host"),
    *[("Join", join_request(host=host), "INVALID_ARGUMENT", "host")
      for host in ["\x00", "[::1", "-oProxyCommand=x", "a b", "fe80::1%eth0", "a..b", "h" * 254]],
    ("Join", join_request(job="bad\n"), "INVALID_ARGUMENT", "job name"),
    ("Join", join_request(node_id="n9\n"), "INVALID_ARGUMENT", "node_id"),
    ("Join", join_request(job="x" * 10_000), "INVALID_ARGUMENT", "(10000 chars)"),
    ("Join", join_request(node_id="n" * 10_000), "INVALID_ARGUMENT", "(10000 chars)"),
    ("Join", join_request(host="h" * 10_000), "INVALID_ARGUMENT", "(10000 chars)"),
    ("Join", join_request(store_port=0), "INVALID_ARGUMENT", "store_port"),
    ("Join", join_request(job="fresh", spec=pb.JobSpec(min_nodes=3, max_nodes=2)), "INVALID_ARGUMENT", "max_nodes"),
    ("Join", join_request(node_id="a"), "ALREADY_EXISTS", "already a member"),
    ("Join", join_request(spec=pb.JobSpec(min_nodes=5)), "FAILED_PRECONDITION", "exists with min_nodes=1"),
    ("Leave", pb.LeaveRequest(job="nojob", node_id="a"), "NOT_FOUND", "unknown"),
    ("Leave", pb.LeaveRequest(job="bad", node_id="zz", member_id=1), "NOT_FOUND", "not a member"),
    ("Leave", pb.LeaveRequest(job="bad", node_id="a", member_id=999), "FAILED_PRECONDITION", "stale"),
    ("Leave", pb.LeaveRequest(job="bad", node_id="a\n", member_id=1), "INVALID_ARGUMENT", "node_id"),
    ("Leave", pb.LeaveRequest(job="bad", node_id="a", reason="r" * 257), "INVALID_ARGUMENT", "reason"),
    ("Leave", pb.LeaveRequest(job="bad", node_id="a", session_secret=b"s" * 65), "INVALID_ARGUMENT",
     "session_secret"),
    ("Status", pb.StatusRequest(job="bad\n"), "INVALID_ARGUMENT", "job name"),
    ("Status", pb.StatusRequest(job="x" * 10_000), "INVALID_ARGUMENT", "(10000 chars)"),
    ("Status", pb.StatusRequest(job="nojob"), "NOT_FOUND", "unknown"),
    ("Events", pb.EventsRequest(job="nojob"), "NOT_FOUND", "unknown"),
    ("Events", pb.EventsRequest(job="UPPER"), "INVALID_ARGUMENT", "job name"),
]
MAX_DETAILS = 300  # a refusal quotes client input bounded, whatever its size


def not_utf8(message, text: str) -> bytes:
    """`message` serialized with the string field holding `text` made invalid UTF-8 (protobuf's
    Python API cannot build such a message; other clients can send one)."""
    data = message.SerializeToString()
    assert data.count(text.encode()) == 1
    return data.replace(text.encode(), b"\xff" + text.encode()[1:])


async def session_error(session, frames):
    async def gen():
        for f in frames:
            yield f
        await asyncio.sleep(5)

    call = session(gen())
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for d in call:
            if len(frames) == 1 and d.HasField("assignment") and d.assignment.role == pb.ROLE_ACTIVE:
                continue
    return err.value


@pytest.mark.timeout(90)
def test_bad_requests_get_precise_statuses_and_change_nothing(coordinators):
    # The node's frames come from this test's event loop, which the bad requests keep busy (a 2 MiB
    # Join, 10,000-char fields): at a load of 16 it missed the tests' 1 s heartbeat timeout and the
    # job lost its only node. Liveness is not what this test checks.
    (leader,) = coordinators(1, ["--heartbeat-timeout", "30"])

    async def scenario():
        agent = SimulatedNode([leader.address], "bad", "a", slots=2, spec=pb.JobSpec(min_nodes=1, max_nodes=1))
        await agent.join()
        agent.start()
        await agent.wait_for(lambda a: a.assignment().role == pb.ROLE_ACTIVE, 10, "map")
        async with grpc.aio.insecure_channel(leader.address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            before = (await stub.Status(pb.StatusRequest(job="bad"))).jobs[0]
            for rpc, request, code, text in CASES:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await getattr(stub, rpc)(request, timeout=5)
                assert err.value.code().name == code, (rpc, str(request)[:300], err.value.details())
                assert text in err.value.details(), (rpc, err.value.details())
                assert len(err.value.details()) < MAX_DETAILS, (rpc, err.value.details())

            for raw in [not_utf8(join_request(), "bad"), not_utf8(join_request(), "n9"),
                        not_utf8(join_request(), "127.0.0.1")]:
                join = channel.unary_unary("/muster.v1.Coordinator/Join", response_deserializer=pb.JoinResponse.FromString)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await join(raw, timeout=5)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
                assert "request is not valid muster.v1.JoinRequest" in err.value.details()

            good = dict(job="bad", node_id="a", member_id=agent.member_id, term=agent.term, generation=agent.generation,
                        session_secret=agent.session.secret)
            frame_cases = [
                ([pb.NodeFrame(job="nojob", node_id="a")], "NOT_FOUND", "unknown"),
                ([pb.NodeFrame(job="bad", node_id="ghost", member_id=1)], "NOT_FOUND", "not a member"),
                ([pb.NodeFrame(**{**good, "member_id": 12345})], "FAILED_PRECONDITION", "stale"),
                ([pb.NodeFrame(**{**good, "generation": 99})], "FAILED_PRECONDITION", "ahead of the job's generation"),
                ([pb.NodeFrame(**{**good, "term": 10**9})], "FAILED_PRECONDITION", "ahead of this leader's term"),
                ([pb.NodeFrame(**good, ranks=[pb.RankReport(local_rank=7, state=pb.RANK_STATE_RUNNING)])],
                 "INVALID_ARGUMENT", "out of range"),
                ([pb.NodeFrame(**good, ranks=[pb.RankReport(local_rank=0)])], "INVALID_ARGUMENT", "unspecified"),
                ([pb.NodeFrame(**good, ranks=[pb.RankReport(local_rank=0, state=pb.RANK_STATE_RUNNING,
                                                            digest=b"x" * 65)])], "INVALID_ARGUMENT", "digest"),
                ([pb.NodeFrame(**good), pb.NodeFrame(**{**good, "node_id": "b"})], "INVALID_ARGUMENT", "every frame"),
                ([pb.NodeFrame(job="x" * 10_000, node_id="a")], "INVALID_ARGUMENT", "(10000 chars)"),
                ([pb.NodeFrame(job="bad\n", node_id="a")], "INVALID_ARGUMENT", "job name"),
                ([pb.NodeFrame(**{**good, "node_id": "a\n"})], "INVALID_ARGUMENT", "node_id"),
                *[([pb.NodeFrame(**good), pb.NodeFrame(**good, ranks=[pb.RankReport(
                    local_rank=0, state=pb.RANK_STATE_RUNNING, **{field: 2**64 - 1})])], "INVALID_ARGUMENT", field)
                  for field in ("step", "digest_step", "generation")],
                ([pb.NodeFrame(**good, ranks=[pb.RankReport(local_rank=0, state=pb.RANK_STATE_LONG_PHASE,
                                                            phase="p" * 129)])], "INVALID_ARGUMENT", "phase"),
            ]
            for frames, code, text in frame_cases:
                err = await session_error(stub.Session, frames)
                assert err.code().name == code, (str(frames)[:300], err.details())
                assert text in err.details(), err.details()
                assert len(err.details()) < MAX_DETAILS, err.details()

            session = channel.stream_stream("/muster.v1.Coordinator/Session",
                                            response_deserializer=pb.Directive.FromString)
            first = pb.NodeFrame(**good)
            for raw_frames in [[not_utf8(first, "bad")], [first.SerializeToString(), not_utf8(first, "bad")]]:
                err = await session_error(session, raw_frames)
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
                assert "request is not valid muster.v1.NodeFrame" in err.details()

            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Join(join_request(host="h" * 200 + "." + "x" * (2 << 20)), timeout=5)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

            after = (await stub.Status(pb.StatusRequest(job="bad"))).jobs[0]
            assert (after.generation, list(after.nodes), after.term) == (before.generation, list(before.nodes), before.term)
            assert after.live
        await agent.stop()

    asyncio.run(scenario())
    # garbage on the port: the server drops the connection and keeps serving
    with socket.create_connection(split_host_port(leader.address), timeout=5) as s:
        s.sendall(b"GET / HTTP/1.1\r\n\r\n" + bytes(range(256)) * 4)
        s.settimeout(5)
        try:
            s.recv(1024)
        except OSError:
            pass
    with grpc.insecure_channel(leader.address) as channel:
        status = pb_grpc.CoordinatorStub(channel).Status(pb.StatusRequest(job="bad"), timeout=5)
    assert status.jobs[0].live
