"""Every RPC fuzzed against a real coordinator (hypothesis): random and adversarial field values,
and random interleavings of calls from several clients at once. Each call is answered with
success or a precise refusal (never UNKNOWN or INTERNAL, the marks of an unhandled error), the
leader keeps serving, and a job it runs meanwhile keeps its invariants."""

import random
import threading

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from muster.v1 import muster_pb2 as pb
from muster.v1 import muster_pb2_grpc as pb_grpc

REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS,
            grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED,
            grpc.StatusCode.UNAVAILABLE,  # a new job's election is not done yet
            grpc.StatusCode.PERMISSION_DENIED}  # a Leave or Session of a member without its session secret

names = st.one_of(st.sampled_from(["fz", "fz2", "control"]), st.text(max_size=80),
                  st.from_regex(r"[a-z0-9][a-z0-9._-]{0,62}", fullmatch=True))
nodes = st.one_of(st.sampled_from(["a", "b", "c"]), st.text(max_size=200))
u32 = st.one_of(st.integers(0, 8), st.integers(0, 2**32 - 1))
u64 = st.one_of(st.integers(0, 8), st.integers(0, 2**64 - 1))
specs = st.builds(pb.JobSpec, min_nodes=u32, max_nodes=u32, world_size_multiple=u32)
reports = st.builds(pb.RankReport, local_rank=u32, pid=u32, step=u64, step_time_us=u32,
                    state=st.integers(0, 7), heard_ms_ago=u32, phase=st.text(max_size=20),
                    digest_step=u64, digest=st.binary(max_size=80))
exits = st.builds(pb.RankExit, local_rank=u32, pid=u32, exit_code=st.integers(-2**31, 2**31 - 1))
requests = st.one_of(
    st.tuples(st.just("Join"), st.builds(pb.JoinRequest, job=names, node_id=nodes, slots=u32,
                                         host=st.one_of(st.just("127.0.0.1"), st.text(max_size=300)),
                                         store_port=u32, spec=specs, is_process=st.booleans(),
                                         agent_pid=u32, master_port=u32)),
    st.tuples(st.just("Leave"), st.builds(pb.LeaveRequest, job=names, node_id=nodes, member_id=u64,
                                          immediate=st.booleans(), finished=st.booleans(),
                                          reason=st.text(max_size=100))),
    st.tuples(st.just("Status"), st.builds(pb.StatusRequest, job=names, brief=st.booleans())),
    st.tuples(st.just("Events"), st.builds(pb.EventsRequest, job=names)),
    st.tuples(st.just("Session"), st.lists(st.builds(pb.NodeFrame, job=names, node_id=nodes, member_id=u64,
                                                     term=u64, generation=u64, ranks=st.lists(reports, max_size=3),
                                                     exits=st.lists(exits, max_size=2)),
                                           max_size=4)),
)


def call(stub, rpc: str, request) -> grpc.StatusCode:
    try:
        if rpc == "Session":
            for _ in stub.Session(iter(request), timeout=2):
                pass  # a frame set that a leader accepts is answered with directives until the deadline
        else:
            getattr(stub, rpc)(request, timeout=5)
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and rpc == "Session":
            return grpc.StatusCode.OK
        assert exc.code() in REFUSALS, f"{rpc}({request!r:.300}) -> {exc.code().name}: {exc.details()}"
        return exc.code()
    return grpc.StatusCode.OK


@pytest.fixture(scope="module")
def fuzz_target(tmp_path_factory):
    from muster.coordinator.etcd.server import EtcdServer
    from muster.local import CoordinatorProcess

    base = tmp_path_factory.mktemp("fuzz")
    etcd = EtcdServer(base / "etcd").start()
    coordinator = CoordinatorProcess([etcd.endpoint], base / "coordinator.log",
                                     ["--max-jobs", "50", "--max-nodes-per-job", "20"]).start()
    channel = grpc.insecure_channel(coordinator.address)
    try:
        yield coordinator, pb_grpc.CoordinatorStub(channel)
    finally:
        channel.close()
        coordinator.stop()
        etcd.stop()


@pytest.mark.timeout(240)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                     HealthCheck.too_slow])
@given(rpc_and_request=requests)
def test_every_rpc_answers_random_input_with_success_or_a_precise_refusal(fuzz_target, rpc_and_request):
    coordinator, stub = fuzz_target
    call(stub, *rpc_and_request)
    assert coordinator.proc.poll() is None


@pytest.mark.timeout(240)
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(plans=st.lists(st.lists(requests, min_size=5, max_size=15), min_size=3, max_size=3), seed=st.integers())
def test_interleaved_calls_from_several_clients_leave_the_leader_serving(fuzz_target, plans, seed):
    coordinator, stub = fuzz_target
    failures: list[BaseException] = []

    def client(plan):
        rng = random.Random(seed)
        with grpc.insecure_channel(coordinator.address) as channel:
            own = pb_grpc.CoordinatorStub(channel)
            for rpc, request in plan:
                try:
                    call(own, rpc, request)
                except AssertionError as exc:
                    failures.append(exc)
                if rng.random() < 0.3:
                    threading.Event().wait(rng.random() * 0.02)

    threads = [threading.Thread(target=client, args=(plan,)) for plan in plans]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not failures, failures[0]
    assert coordinator.proc.poll() is None
    # still serving, and a well-formed job still forms
    job = f"ctl-{abs(seed) % 10**6}"
    response = stub.Join(pb.JoinRequest(job=job, node_id="n", slots=1, host="127.0.0.1", store_port=1,
                                        spec=pb.JobSpec(min_nodes=1, max_nodes=1)), timeout=10)
    assert response.member_id and stub.Status(pb.StatusRequest(job=job), timeout=5).jobs[0].name == job
