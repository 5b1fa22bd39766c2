"""NodeSession's frame timing: each node keeps its own phase in the heartbeat interval."""

import asyncio
import statistics
import time

import grpc

from muster.testing import FakeClock, until
from muster.v1 import muster_pb2 as pb
from muster.v1 import muster_pb2_grpc as pb_grpc
from muster.worker.node_session import NodeIdentity, NodeSession


def session(node_id: str, interval_s: float = 0.1) -> NodeSession:
    s = NodeSession("127.0.0.1:1", NodeIdentity("job", node_id, 1, "127.0.0.1", 1), reports=list,
                    on_directive=lambda d: None)
    s.heartbeat_interval_s = interval_s
    return s


def test_nodes_report_at_their_own_phase_spread_over_the_interval():
    now = time.time()
    # When each node's next frame falls, as a fraction of the interval: spread, not a burst.
    phases = sorted(((now + session(f"node-{i:05d}")._until_next_frame()) % 0.1) / 0.1 for i in range(1000))
    assert max(b - a for a, b in zip(phases, phases[1:])) < 0.02
    assert 0.4 < statistics.median(phases) < 0.6


def test_the_wait_is_never_shorter_than_half_an_interval_nor_longer_than_one_and_a_half():
    for i in range(200):
        wait = session(f"n{i}", 2.0)._until_next_frame()
        assert 1.0 <= wait < 3.0


def test_a_node_keeps_its_phase_across_sessions(monkeypatch):
    # One clock for the test and the session: read twice, the scheduling between the readings (8 ms
    # in a loaded CI run) looked like a phase shift.
    clock = {"now": 1_795_000_000.123}
    monkeypatch.setattr(time, "time", lambda: clock["now"])
    first = clock["now"] + session("node-a")._until_next_frame()
    clock["now"] += 0.537  # a new stream later, e.g. after a leader change
    again = clock["now"] + session("node-a")._until_next_frame()
    apart = (first - again) % 0.1
    assert min(apart, 0.1 - apart) < 1e-6


def test_a_frame_that_only_advances_steps_says_so_and_the_first_of_a_stream_never_does():
    """NodeFrame.steps_only: the leader's hot path reads such a frame for three fields a rank."""
    state = {"step": 0, "state": pb.RANK_STATE_RUNNING, "heard": 0}

    def reports():
        state["step"] += 1
        return [pb.RankReport(local_rank=s, pid=10 + s, step=state["step"], step_time_us=1000 + state["step"],
                              heard_ms_ago=state["heard"], state=state["state"]) for s in range(2)]

    s = NodeSession("127.0.0.1:1", NodeIdentity("job", "n", 2, "127.0.0.1", 1), reports=reports,
                    on_directive=lambda d: None)
    s.heartbeat_interval_s = 0.001

    async def flags():
        frames, seen = s._frames(relayed=False), []
        for change in (None, None, "state", None, "heard", "exit", None):
            if change == "state":
                state["state"] = pb.RANK_STATE_LONG_PHASE
            elif change == "heard":
                state["heard"] = 700  # how long the agent has not heard a rank: a step-like field
            elif change == "exit":
                s.exits.append(pb.RankExit(local_rank=1, pid=11, exit_code=1))
            seen.append((await anext(frames)).steps_only)
        again = await anext(s._frames(relayed=False))  # a new stream: its first frame is read in full
        return seen, again.steps_only

    seen, again = asyncio.run(flags())
    assert seen == [False, True, False, True, True, False, True] and not again


class Unavailable(pb_grpc.CoordinatorServicer):
    """A replica that can do nothing for anyone (etcd out): every Session refused at once; when each
    attempt came, on the node's (fake) clock."""

    def __init__(self, clock: FakeClock):
        self.clock = clock
        self.attempts: list[float] = []

    async def Session(self, request_iterator, context):
        self.attempts.append(self.clock())
        await context.abort(grpc.StatusCode.UNAVAILABLE, "no leader: etcd unreachable")
        yield  # an async generator, as the real handler


def test_a_node_refused_again_and_again_backs_off_but_comes_back_at_once_first():
    """During an etcd outage every node of a large job retried at once ~25 times a second. The
    waits between attempts are taken on a fake clock: 3 s of them in a fraction of a second."""

    async def scenario() -> list[float]:
        clock = FakeClock(0.0)
        server = grpc.aio.server()
        refusing = Unavailable(clock)
        pb_grpc.add_CoordinatorServicer_to_server(refusing, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            s = NodeSession(f"127.0.0.1:{port}", NodeIdentity("job", "node-a", 1, "127.0.0.1", 1), reports=list,
                            on_directive=lambda d: None)
            s.heartbeat_timeout_s = 2.0  # waits of at most 0.25-0.5 s
            s.retry_sleep = clock.sleep
            running = asyncio.create_task(s.run())
            await until(lambda: clock.now >= 3.0, "3 s of retries on the fake clock")
            await s.stop()
            await asyncio.wait_for(running, 5)
            return refusing.attempts
        finally:
            await server.stop(None)

    attempts = asyncio.run(scenario())
    assert len([t for t in attempts if t < 0.15]) >= 2  # the first retries are tens of ms apart: taken up at once
    assert 6 <= len([t for t in attempts if t < 3.0]) <= 16  # 0.02, 0.04, ... doubling to 0.25 (jittered to twice): not ~100
    waits = [b - a for a, b in zip(attempts, attempts[1:])]
    for i, wait in enumerate(waits):  # each wait exactly its doubling step's, jittered up to twice it
        step = min(0.02 * 2 ** i, 0.25)
        assert step - 1e-9 <= wait < 2 * step + 1e-9, (i, wait)


def test_a_node_does_not_go_back_to_a_relay_it_just_found_silent():
    """A soak froze the leader that was also a node's relay: the node found it silent, then streamed
    through the same frozen replica as its relay for another 1.5 s, and the new leader judged it
    silent meanwhile."""
    s = session("node-a")
    s.addresses = ["frozen:1", "new:1", "standby:1"]
    s.relay, s.leader = "frozen:1", "new:1"
    assert s._route(now=100.0) == ("frozen:1", True)  # a healthy relay carries the node
    s._suspect["frozen:1"] = 104.0  # found silent at 100 (suspected two heartbeat timeouts)
    assert s._route(now=100.0) == ("new:1", False)
    assert s._route(now=104.5) == ("frozen:1", True)  # once the suspicion ends, the relay is tried again
    s._relay_avoided_until = 110.0
    assert s._route(now=105.0) == ("new:1", False)


class Frozen(pb_grpc.CoordinatorServicer):
    """A leader that pulses each stream once and then freezes: streams stay open, nothing answers."""

    def __init__(self) -> None:
        self.sessions: list[float] = []  # when each stream came

    async def Session(self, request_iterator, context):
        self.sessions.append(time.monotonic())
        yield pb.Directive(term=1)  # a pulse
        await asyncio.sleep(60)  # ended by the node's cancel or the server's stop

    async def Status(self, request, context):
        await asyncio.sleep(60)
        return pb.StatusResponse()


def test_a_node_leaves_a_frozen_leader_within_one_and_a_half_heartbeat_timeouts():
    """A new leader's grace ends a heartbeat timeout after the first frame reaches it, which comes
    2/3 of the lease TTL after a freeze at the earliest: a node on the frozen leader must have left
    it by then. Its probe waited a whole timeout (2.25 timeouts after the last pulse in all: with the
    defaults, up to 2.5 s after the successor led); now a quarter of one."""
    timeout_s = 2.0

    async def scenario() -> list[float]:
        server = grpc.aio.server()
        frozen = Frozen()
        pb_grpc.add_CoordinatorServicer_to_server(frozen, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            s = NodeSession(f"127.0.0.1:{port}", NodeIdentity("job", "node-a", 1, "127.0.0.1", 1), reports=list,
                            on_directive=lambda d: None)
            s.heartbeat_timeout_s = timeout_s
            running = asyncio.create_task(s.run())
            await until(lambda: len(frozen.sessions) >= 2, "the node to leave the frozen leader", timeout_s=8.0)
            await s.stop()
            await asyncio.wait_for(running, 5)
            return frozen.sessions
        finally:
            await server.stop(None)

    first, second = asyncio.run(scenario())[:2]
    assert second - first <= 1.5 * timeout_s + 0.5, second - first  # the old probe: 4-4.5 s


def test_a_leave_waits_for_the_frame_with_the_last_exit_reports():
    """The leader takes a frame's exits at its next tally but a Leave at once: the node's last exit
    goes in a frame EXITS_BEFORE_LEAVE_S ahead of its Leave."""
    import asyncio
    import time

    from muster.v1 import muster_pb2 as pb
    from muster.worker.node_session import EXITS_BEFORE_LEAVE_S, NodeIdentity, NodeSession

    session = NodeSession(["127.0.0.1:1"], NodeIdentity("j", "n", 1, "127.0.0.1", 1), reports=lambda: [],
                          on_directive=lambda d: None)
    session.exits.append(pb.RankExit(local_rank=0, pid=9, exit_code=7))

    async def stream_then_leave():
        frames = session._frames(False)
        async def take():  # the stream takes the queued exit when woken
            await asyncio.sleep(0.05)
            return await frames.__anext__()
        taker = asyncio.ensure_future(take())
        began = time.monotonic()
        await session._exits_out()
        return (await taker), time.monotonic() - began

    frame, waited = asyncio.run(stream_then_leave())
    assert [e.pid for e in frame.exits] == [9] and not session.exits
    assert waited >= 0.05 + EXITS_BEFORE_LEAVE_S - 0.01
