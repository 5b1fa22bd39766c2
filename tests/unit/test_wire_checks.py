"""The edge checks (wire.check_*, and a first frame's claims.check_rejoin): what they accept, what
they refuse, and that every refusal names the field and quotes client input bounded. The request
decoders of the gRPC edge refuse bytes that are no valid message instead of letting grpc.aio answer
UNKNOWN."""

import grpc
import pytest

from muster.coordinator import claims, wire
from muster.coordinator.edges import server
from muster.coordinator.core.policy import MAX_GENERATION, MAX_STEP
from muster.coordinator.core.state import Member
from muster.coordinator.errors import InvalidArgument
from muster.v1 import muster_pb2 as pb
from muster.v1 import muster_pb2_grpc as pb_grpc

MAX_MESSAGE = 300


def join_request(**over):
    return pb.JoinRequest(**{**dict(job="job", node_id="n0", slots=2, host="127.0.0.1", store_port=29500), **over})


def refusal(check, *args) -> str:
    with pytest.raises(InvalidArgument) as err:
        check(*args)
    assert len(str(err.value)) < MAX_MESSAGE, str(err.value)
    return str(err.value)


def test_shown_quotes_short_values_whole_and_long_ones_cut_with_their_length():
    assert wire.shown("a\nb") == repr("a\nb")
    long = wire.shown("x" * 10_000)
    assert long.startswith(repr("x" * 64)) and long.endswith("(10000 chars)") and len(long) < 100


@pytest.mark.parametrize("job", ["a", "job-1.x_y", "0" * 63])
def test_job_names_accepted(job):
    assert wire.check_job(job) == job


@pytest.mark.parametrize("job", ["", "job\n", "\njob", "Job", "-job", "a/b", "a" * 64, "a" * 10_000])
def test_job_names_refused_fully(job):
    assert "job name" in refusal(wire.check_job, job)


@pytest.mark.parametrize("node", ["n", "host-1:0@gpu.A", "N" * 128])
def test_node_ids_accepted(node):
    assert wire.check_node(node) == node


@pytest.mark.parametrize("node", ["", "n\n", "n 1", "-n", "n/1", "n" * 129, "n" * 10_000])
def test_node_ids_refused_fully(node):
    assert "node_id" in refusal(wire.check_node, node)


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "2001:db8::1", "localhost", "node-1.cluster.local",
                                  "A" * 63 + ".b", "web_1.compose_default", ".".join(["h" * 63] * 4)[:253]])
def test_hosts_accepted(host):
    wire.check_join(join_request(host=host))


@pytest.mark.parametrize("host", ["", "\x00", "[::1", "[::1]", "-oProxyCommand=x", "a b", "host\n", "a..b", ".a",
                                  "a-.b", "h" * 64, ".".join(["h" * 63] * 4), "fe80::1%eth0",
                                  "127.0.0.1:80", "h" * 10_000])
def test_hosts_refused(host):
    assert "host" in refusal(wire.check_join, join_request(host=host))


def test_a_join_key_is_none_or_16_to_64_bytes():
    for key in (b"", b"k" * 16, b"k" * 64):
        wire.check_join(join_request(join_key=key))
    for key in (b"k", b"k" * 15, b"k" * 65, b"k" * 10_000):
        assert f"join_key is {len(key)} bytes" in refusal(wire.check_join, join_request(join_key=key))


def test_leave_bounds_reason_and_secret():
    wire.check_leave(pb.LeaveRequest(job="job", node_id="n0", reason="r" * 256, session_secret=b"s" * 64))
    assert "reason" in refusal(wire.check_leave, pb.LeaveRequest(job="job", node_id="n0", reason="r" * 257))
    assert "session_secret" in refusal(wire.check_leave,
                                       pb.LeaveRequest(job="job", node_id="n0", session_secret=b"s" * 65))
    assert "node_id" in refusal(wire.check_leave, pb.LeaveRequest(job="job", node_id="n0\n"))


def test_rejoin_is_checked_by_joins_rules_and_names_its_frame():
    frame = dict(job="job", node_id="n0", member_id=1)
    claims.check_rejoin(pb.NodeFrame(**frame))
    claims.check_rejoin(pb.NodeFrame(**frame, session_secret=b"s" * 64, rejoin=join_request()))
    assert "session_secret" in refusal(claims.check_rejoin, pb.NodeFrame(**frame, session_secret=b"s" * 65))
    frame["session_secret"] = b"s"
    assert refusal(claims.check_rejoin,
                   pb.NodeFrame(**frame, rejoin=join_request(host="a b"))).startswith("rejoin: host")
    assert "slots" in refusal(claims.check_rejoin, pb.NodeFrame(**frame, rejoin=join_request(slots=0)))
    assert "job and node_id" in refusal(claims.check_rejoin, pb.NodeFrame(**frame, rejoin=join_request(node_id="n1")))
    # a claim of membership without the secret: a lost state would keep the hash of nothing as its member's
    del frame["session_secret"]
    assert "session_secret" in refusal(claims.check_rejoin, pb.NodeFrame(**frame, rejoin=join_request()))


def ranks(**report):
    member = Member("n0", 1, "127.0.0.1", 29500, 2, 0)
    frame = pb.NodeFrame(job="job", node_id="n0", member_id=1,
                         ranks=[pb.RankReport(**{**dict(local_rank=0, state=pb.RANK_STATE_RUNNING), **report})])
    return lambda: wire.check_frame_ranks(frame, member)


def test_rank_reports_within_bounds_are_accepted():
    (r,) = ranks(step=MAX_STEP, digest_step=MAX_STEP, generation=MAX_GENERATION, phase="p" * 128)()
    assert (r.step, r.digest_step, r.generation) == (MAX_STEP, MAX_STEP, MAX_GENERATION)


@pytest.mark.parametrize("field", ["step", "digest_step", "generation"])
def test_rank_report_counters_near_2_64_are_refused(field):
    assert refusal(ranks(**{field: 2**64 - 1})).startswith(f"{field} of local_rank 0")


def test_rank_report_phase_is_bounded():
    assert "phase" in refusal(ranks(phase="p" * 129))


TERMINAL_TRICKS = ["\x1b]0;owned\x07", "\x1b[2J", "a\nb", "tab\there", "\x9b31m", "\u202etxt.exe", "\u2066x", "\u200f"]


@pytest.mark.parametrize("text", TERMINAL_TRICKS)
def test_control_characters_are_refused_in_reasons_and_phases_naming_the_field(text):
    # shown in operators' terminals (events, status): a title, a cleared screen, reordered text
    said = refusal(wire.check_leave, pb.LeaveRequest(job="job", node_id="n0", reason=text))
    assert said.startswith("reason") and "control character" in said and "\x1b" not in said
    assert refusal(wire.check_reason, f"drained: {text}").startswith("reason")
    said = refusal(ranks(phase=text))
    assert said.startswith("phase of local_rank 0") and "control character" in said


def test_reasons_and_phases_in_any_script_pass():
    assert wire.check_reason("maintenance: réseau 日本 — node 3") == "maintenance: réseau 日本 — node 3"
    (r,) = ranks(phase="checkpoint → s3 (ß)")()
    assert r.phase == "checkpoint → s3 (ß)"


def test_undecodable_requests_become_refusals():
    data = join_request(job="bad").SerializeToString().replace(b"bad", b"\xffad")
    decoded = server._decoder(pb.JoinRequest)(data)
    assert isinstance(decoded, InvalidArgument)
    assert str(decoded).startswith("request is not valid muster.v1.JoinRequest: ")
    assert server._decoder(pb.JoinRequest)(join_request().SerializeToString()) == join_request()


class Recorder:
    """Stands in for a grpc server: keeps the handlers it is given."""

    def __init__(self):
        self.registered = {}

    def add_generic_rpc_handlers(self, handlers):
        pass

    def add_registered_method_handlers(self, service, handlers):
        self.registered[service] = handlers


def test_handlers_serve_the_methods_of_the_generated_registration():
    generated = Recorder()
    from types import SimpleNamespace

    from muster.coordinator.core.policy import Limits

    servicer = server.CoordinatorServicer(replica=SimpleNamespace(config=SimpleNamespace(limits=Limits())))
    pb_grpc.add_CoordinatorServicer_to_server(servicer, generated)
    (expected,) = generated.registered.values()
    ours = server._handlers(servicer)
    assert ours.keys() == expected.keys()
    for name, handler in ours.items():
        want: grpc.RpcMethodHandler = expected[name]
        assert (handler.request_streaming, handler.response_streaming) == \
            (want.request_streaming, want.response_streaming), name
        assert handler.response_serializer == want.response_serializer, name
