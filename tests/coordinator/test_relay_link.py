"""The leader's end of a Relay stream, in-process on the in-memory store with a clock that stands
still: relayed node streams are attached by their first frame's secret like direct ones, a caller
can neither open one without it nor end one it did not open, and the loss of the relay is a stream
loss for its nodes, not the exit a direct process node's hang-up is."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from muster.testing import FakeClock, until

from muster.coordinator.core.policy import JobSpec, Timing
from muster.coordinator.core.state import JobState, NodeKind
from muster.coordinator.errors import InvalidArgument, ResourceExhausted
from muster.coordinator.coordination import LeaderKey
from muster.coordinator.job.leader import JobLeader
from muster.coordinator.job.leadership import Leadership
from muster.coordinator import wire
from muster.coordinator.replica.relay import PULSE_SLICE, Relay
from muster.coordinator.core.relay_fold import MAX_ITEMS, RelayedNode, placement_of, renumbered
from muster.coordinator.job.relay_link import PENDING_MESSAGES, RelayLink
from muster.coordinator.replica.ports import RelayCall
from muster.coordinator.job.streams import NodeStream, Pulses
from muster.coordinator.memory import MemoryJobStore
from muster.security import ClientSecurity
from muster.v1 import muster_pb2 as pb

pytestmark = pytest.mark.timeout(10)

TIMING = Timing(heartbeat_interval_s=0.05, heartbeat_timeout_s=1.0, grace_s=2.0, last_call_s=0.3)
SPEC = JobSpec(min_nodes=1, max_nodes=2)


async def led_job(clock: FakeClock | None = None) -> tuple[JobLeader, dict[str, pb.JoinResponse]]:
    """A job of two process nodes, formed; the clock moves only where a test moves it (`clock`), so
    nobody goes silent otherwise."""
    clock = clock or FakeClock()
    leadership = Leadership(LeaderKey("job", 1, "memory/job", "replica"), MemoryJobStore())
    leader = JobLeader(JobState("job", SPEC), leadership=leadership, address="replica", timing=TIMING, tick_s=0.01,
                       clock=clock)
    leader.start()
    joined = {}
    for node in ("p1", "p2"):
        joined[node] = await leader.join(pb.JoinRequest(job="job", node_id=node, host="10.0.0.1", store_port=29500,
                                                        slots=1, is_process=True), SPEC)
    clock.advance(TIMING.last_call_s + 0.1)
    await until(lambda: leader.state.rank_map is not None and leader.state.rank_map.world_size == 2, "formed")
    return leader, joined


async def tallies(leader: JobLeader, n: int = 5) -> None:
    """`n` more of the leader's tallies done: what did not change in them, nothing decided."""
    done = leader.tallies
    await until(lambda: leader.tallies >= done + n, f"{n} tallies")


def first(joined: pb.JoinResponse, secret: bytes | None = None) -> pb.NodeFrame:
    return pb.NodeFrame(job="job", node_id=joined.node_id, member_id=joined.member_id, term=joined.term,
                        session_secret=joined.session_secret if secret is None else secret, via_relay=True)


def both_relayed(leader: JobLeader, joined: dict[str, pb.JoinResponse], *, maps: bool = False) -> RelayLink:
    """A relay call carrying both nodes, p1 as stream 1 and p2 as stream 2 (`maps`: its first
    message says it builds loss-only maps)."""
    link = RelayLink(leader, "relay:1")
    link.receive(pb.RelayUp(job="job", relay="relay:1", maps=maps, frames=[
        pb.RelayedFrame(stream=1, frame=first(joined["p1"])), pb.RelayedFrame(stream=2, frame=first(joined["p2"]))]))
    return link


def relayed(stream: int, frame: pb.NodeFrame) -> pb.RelayUp:
    return pb.RelayUp(job="job", relay="relay:1", frames=[pb.RelayedFrame(stream=stream, frame=frame)])




def test_relayed_streams_attach_by_secret_and_forged_facts_do_nothing():
    async def scenario():
        leader, joined = await led_job()
        link = RelayLink(leader, "relay:1")
        link.receive(relayed(1, first(joined["p1"])))
        assert leader.streams["p1"].link is link and leader.streams["p1"].stream_id == 1
        (item,) = link.take().items
        assert item.stream == 1 and item.directive.assignment.world_size == 2

        link.receive(pb.RelayUp(job="job", relay="relay:1", ended=[2, 7]))  # numbers it never attached
        link.receive(relayed(3, first(joined["p2"], secret=b"x" * 32)))  # no secret: refused, alone
        (item,) = link.take().items
        assert item.stream == 3 and item.end.code == grpc.StatusCode.PERMISSION_DENIED.value[0]
        link.receive(relayed(2, first(joined["p2"])))  # behind the last number: not a new stream
        assert not link.out and "p2" not in leader.streams
        await tallies(leader)  # nothing was decided in them
        assert leader.state.generation == 1 and leader.streams["p1"].stream_id == 1

        with pytest.raises(InvalidArgument, match="name its job"):
            link.receive(pb.RelayUp(job="other", relay="relay:1"))
        await leader.stop("test over", resigned=True)

    asyncio.run(scenario())


def test_a_lost_relay_is_a_stream_loss_but_a_relayed_hang_up_is_a_process_exit():
    async def scenario():
        leader, joined = await led_job()
        link = both_relayed(leader, joined)
        assert set(leader.streams) == {"p1", "p2"}
        link.close()  # the relay's stream ended: its nodes reconnect elsewhere
        assert not leader.streams
        await tallies(leader)
        assert leader.state.generation == 1 and len(leader.state.members) == 2

        again = RelayLink(leader, "relay:2")
        again.receive(relayed(1, first(joined["p1"])))
        again.receive(pb.RelayUp(job="job", relay="relay:2", ended=[1]))  # p1's own stream ended at the relay
        await until(lambda: leader.state.member("p1") is None, "p1 lost as its process exited")
        assert leader.state.history[-2].kind == "process_exited"
        await leader.stop("test over", resigned=True)

    asyncio.run(scenario())


def test_a_relay_gets_the_leaders_pulse_once_after_its_directives_and_a_direct_stream_its_own():
    async def scenario():
        clock = FakeClock()
        leader, joined = await led_job(clock)
        direct = leader.attach(pb.NodeFrame(job="job", node_id="p2", member_id=joined["p2"].member_id,
                                            term=joined["p2"].term, session_secret=joined["p2"].session_secret))
        link = RelayLink(leader, "relay:1")
        link.receive(relayed(1, first(joined["p1"])))
        assert not direct.queue.empty() and link.out  # each node's current assignment
        while not direct.queue.empty():
            direct.queue.get_nowait()

        clock.advance(TIMING.heartbeat_timeout_s / 4)  # the next pulse period: the direct stream is in it
        await until(lambda: not direct.queue.empty(), "the leader's next tick pulsed")
        assert direct.queue.get_nowait().generation == 1  # a direct node's own
        assert len(link.out) == 1  # nothing per relayed node: the pulse waits for the link's next message
        down = link.take()
        assert [i.stream for i in down.items] == [1] and down.items[0].directive.HasField("assignment")
        assert down.HasField("pulse") and down.pulse.generation == 1 and down.pulse.term == leader.term
        assert not link.pending and not link.ready.is_set()
        await leader.stop("test over", resigned=True)

    asyncio.run(scenario())


def test_pulses_are_spread_over_their_period_one_per_direct_stream():
    """1,000 direct streams: each is pulsed once a period, a slice per tick (never all at once: that
    burst held the leader's loop), and a closed stream is skipped."""
    streams = [NodeStream("job", f"n{i}", i, NodeKind.AGENT) for i in range(1000)]
    streams[7].closed = True
    pulses, pulse = Pulses(every_s=0.5, tick_s=0.05), pb.Directive(term=1, generation=1)
    per_tick = []
    for tick in range(20):  # two periods
        now = 100.0 + tick * 0.05
        before = sum(s.queue.qsize() for s in streams)
        if pulses.period_over(now):
            pulses.send_rest(pulse)
            pulses.start(streams, now)
        pulses.send_due(pulse, now)
        per_tick.append(sum(s.queue.qsize() for s in streams) - before)
    assert [s.queue.qsize() for s in streams] == [0 if i == 7 else 2 for i in range(1000)]
    assert max(per_tick) <= 101 and min(per_tick) >= 98  # 999 open streams in 10 ticks (a float rounding either way)


def test_a_frame_in_flight_on_a_superseded_stream_does_not_bring_back_the_leaders_silence_watch():
    """A node that moves from a direct stream to a relay, then waits (a long phase: its relay
    forwards nothing): a frame of its old stream arriving after the move must not make the leader
    judge its silence, which only the relay does now (the soak's etcd data loss with relays)."""
    async def scenario():
        clock = FakeClock()
        leader, joined = await led_job(clock)
        p1 = joined["p1"]
        frame = pb.NodeFrame(job="job", node_id="p1", member_id=p1.member_id, term=p1.term,
                             session_secret=p1.session_secret, generation=1)
        direct = leader.attach(frame)
        link = RelayLink(leader, "relay:1")
        link.receive(relayed(1, first(p1)))  # the node's newer session, through a relay
        assert leader.streams["p1"].link is link
        leader.on_frame(direct, frame)  # still in flight on the old stream
        await clock.elapse(3 * TIMING.heartbeat_timeout_s)  # p2 never streamed: it goes; p1's relay vouches for it
        await until(lambda: leader.state.member("p2") is None, "p2 found silent")
        await tallies(leader)  # p1's silence would have been judged in them as p2's was
        assert leader.state.member("p1") is not None
        assert not [e for e in leader.state.history if "p1" in e.nodes and e.kind == "node_silent"]
        await leader.stop("test over", resigned=True)

    asyncio.run(scenario())


def test_a_stale_first_frame_a_relay_still_held_does_not_displace_the_nodes_newer_stream():
    """The soak's etcd outage with relays: a relay held a node's first frame while no leader took
    its call; the node moved on to the leader itself (its stream 2). The relay's late frame (stream 1)
    is refused, and the newer stream stays; a newer one through a relay (stream 3) takes over."""
    async def scenario():
        leader, joined = await led_job()
        p1 = joined["p1"]

        def opening(seq: int, via_relay: bool) -> pb.NodeFrame:
            return pb.NodeFrame(job="job", node_id="p1", member_id=p1.member_id, term=p1.term, generation=1,
                                session_secret=p1.session_secret, via_relay=via_relay, stream_seq=seq)

        direct = leader.attach(opening(2, via_relay=False))
        link = RelayLink(leader, "relay:1")
        link.receive(pb.RelayUp(job="job", relay="relay:1", frames=[pb.RelayedFrame(stream=1, frame=opening(1, True))],
                                ended=[1]))
        (item,) = link.take().items
        assert item.stream == 1 and item.end.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
        assert "stale" in item.end.message
        assert leader.streams["p1"] is direct and not direct.closed
        link.receive(relayed(2, opening(3, True)))  # the node moved on again, through a relay
        assert leader.streams["p1"].link is link and direct.closed
        await leader.stop("test over", resigned=True)

    asyncio.run(scenario())


def test_a_relay_gives_a_leader_elected_while_it_retries_the_whole_connect_time():
    """A dead leader's key outlives it by up to the session TTL, and etcd's lease check and the
    takeover add theirs: a relay that counted its patience from its start gave up just before the
    successor took over (fresh-clone run D), and put its nodes on the successor directly. Counted
    from the successor's election instead; a successor that never takes the call is left a connect
    time after its election (at most twice the connect time in all), its nodes told where it is."""
    async def scenario():
        loop = asyncio.get_running_loop()

        async def attempt(successor_takes_at: float):
            start = loop.time()
            calls = []

            async def elected(job: str) -> str:
                return "old:1" if loop.time() - start < 0.3 else "new:2"

            relay = Relay("job", "relay:3", "old:1", security=ClientSecurity(), find_leader=elected, window_s=0.01,
                          connect_s=1.0, heartbeat_timeout_s=0.8, progress_s=0.1)

            async def call(address: str) -> tuple[bool, str, str]:
                calls.append(address)
                if address == "new:2" and loop.time() - start >= successor_takes_at:
                    relay.nodes.clear()  # accepted; its nodes, once hung up, end the call
                    return True, "the leader ended it", ""
                return False, "UNAVAILABLE: not leading", ""

            relay._call = call
            node = RelayedNode(1, "n1")
            relay.nodes = {1: node}
            relay.start()
            await until(lambda: not relay.accepting, "the relay's attempts over", timeout_s=5)
            return loop.time() - start, calls, node

        took, calls, node = await attempt(successor_takes_at=1.1)  # after the relay's first connect_s
        assert calls[-1] == "new:2" and node.queue.empty(), (took, calls)  # taken: its nodes stay on it
        took, calls, node = await attempt(successor_takes_at=99)
        assert 1.25 <= took <= 1.8, took  # a connect time after its election (0.3 s)
        assert node.queue.get_nowait().leader == "new:2"

    asyncio.run(scenario())


def test_a_relay_spreads_the_leaders_pulse_over_its_nodes_and_forwards_frames_to_be_read_in_full():
    """The relay's end: one pulse from the leader reaches each of its 1,000 nodes once, a slice at a
    time (never all at once: that burst held the relay's loop); a node that hung up gets none."""
    async def scenario():
        async def nowhere(job: str) -> str:
            return "relay:1"

        # Its own address as the leader's: the call ends at once, and the relay's end stays to test.
        relay = Relay("job", "relay:1", "relay:1", security=ClientSecurity(), find_leader=nowhere, window_s=0.01,
                      connect_s=0.0, heartbeat_timeout_s=0.8, progress_s=0.1)
        relay.start()
        await until(lambda: not relay.accepting, "the relay's call over")
        relay.nodes = {i: RelayedNode(i, f"n{i}") for i in range(1, 1001)}
        nodes = list(relay.nodes.values())
        relay.fan_out(pb.RelayDown(pulse=pb.Directive(term=1, generation=1)))
        await asyncio.sleep(0)
        assert 0 < sum(n.queue.qsize() for n in nodes) <= PULSE_SLICE
        del relay.nodes[1000]  # hangs up before its slice
        # The last slice reached node 999 in the same pass that passed over node 1000:
        await until(lambda: nodes[998].queue.qsize(), "the last slice sent")
        assert [n.queue.qsize() for n in nodes] == [1] * 999 + [0]
        assert nodes[0].queue.get_nowait().term == 1
        # What a relay forwards is read in full: the leader does not see every frame of the node,
        # so a steps_only frame may not refer to the frame the leader saw last.
        forwarded = pb.NodeFrame(job="job", node_id="n1", steps_only=True)
        relay.frame(nodes[0], forwarded)  # the node's first: forwarded at once
        assert not forwarded.steps_only and relay.batch

    asyncio.run(scenario())


def test_a_steps_only_frame_is_read_for_its_steps_and_only_on_a_stream_that_had_a_full_frame():
    async def scenario():
        leader, joined = await led_job()
        p2 = joined["p2"]

        def frame(step: int, state=pb.RANK_STATE_RUNNING, steps_only=True, ranks=1) -> pb.NodeFrame:
            return pb.NodeFrame(job="job", node_id="p2", member_id=p2.member_id, term=p2.term, generation=1,
                                steps_only=steps_only, ranks=[pb.RankReport(local_rank=0, pid=7, step=step, state=state,
                                                                            step_time_us=1000)] * ranks)

        # A first frame that claims steps_only is read in full: the stream has no frame to refer to.
        stream = leader.attach(pb.NodeFrame(**{f.name: v for f, v in frame(1).ListFields()},
                                            session_secret=p2.session_secret))
        rank = leader.live.nodes["p2"].ranks[0]
        assert (rank.step, rank.pid, rank.state) == (1, 7, "running")
        leader.on_frame(stream, frame(2))
        assert rank.step == 2 and leader.live.step_times[-1] == 0.001
        # A steps_only frame that changes more than steps (a node that lies) moves only its steps.
        leader.on_frame(stream, frame(3, state=pb.RANK_STATE_LONG_PHASE))
        assert (rank.step, rank.state) == (3, "running")
        leader.on_frame(stream, frame(4, state=pb.RANK_STATE_LONG_PHASE, steps_only=False))
        assert (rank.step, rank.state) == (4, "long_phase")
        # Not the ranks of the stream's last full frame: read in full (and refused, for one slot).
        with pytest.raises(InvalidArgument):
            leader.on_frame(stream, frame(5, ranks=2))
        # A bad step is refused on the hot path too.
        with pytest.raises(InvalidArgument):
            leader.on_frame(stream, frame(2**62))
        await leader.stop("test over", resigned=True)

    asyncio.run(scenario())


def fresh_numbers(start: int, count: int, node_id: str = "p1") -> pb.RelayUp:
    """A flood message: frames on fresh stream numbers naming a real node, without its secret."""
    return pb.RelayUp(job="job", relay="flood", frames=[
        pb.RelayedFrame(stream=n, frame=pb.NodeFrame(job="job", node_id=node_id, member_id=1))
        for n in range(start, start + count)])


def test_a_flood_of_fresh_stream_numbers_is_budgeted_and_cut_off_after_a_message_of_attaches():
    """Security review 3, F1: every relayed frame counts, first ones included, and a relay attaching
    nothing gets one message's worth ahead of its streams."""
    async def scenario():
        leader, _ = await led_job()
        call = RelayCall(leader, pb.RelayUp(job="job", relay="flood"), TIMING_RATE, timeout_s=2.0)
        link = call.link
        attaches = []
        attach = leader.attach
        leader.attach = lambda *a, **k: attaches.append(1) or attach(*a, **k)

        async def flood():
            for i in range(3):
                yield fresh_numbers(1 + i * MAX_ITEMS, MAX_ITEMS)

        refusal = await call._read(flood())
        assert isinstance(refusal, ResourceExhausted) and "frames/s" in str(refusal)
        assert len(attaches) == MAX_ITEMS and len(link.out) == MAX_ITEMS  # the first message alone
        assert not link.streams and leader.state.generation == 1
        await leader.stop("test over", resigned=True)

    asyncio.run(scenario())


TIMING_RATE = 50.0  # --max-frames-per-second's default


def test_a_relay_message_of_more_than_max_items_is_refused_before_any_is_looked_at():
    async def scenario():
        leader, _ = await led_job()
        call = RelayCall(leader, pb.RelayUp(job="job", relay="flood"), TIMING_RATE, timeout_s=2.0)
        link = call.link
        for up in (fresh_numbers(1, MAX_ITEMS + 1), pb.RelayUp(job="job", ended=range(1, MAX_ITEMS + 2)),
                   pb.RelayUp(job="job", silent=[pb.SilentStream(stream=n) for n in range(1, MAX_ITEMS + 2)])):
            with pytest.raises(ResourceExhausted, match=f"at most {MAX_ITEMS} frames"):
                call._receive(up)
        assert not link.out and link.last_stream == 0
        await leader.stop("test over", resigned=True)

    asyncio.run(scenario())


def test_replies_a_relay_leaves_unread_are_bounded_and_end_its_call():
    async def scenario():
        leader, joined = await led_job()
        link = RelayLink(leader, "slow")
        link.receive(relayed(1, first(joined["p1"])))
        for start in range(2, 2 + (PENDING_MESSAGES + 1) * MAX_ITEMS, MAX_ITEMS):
            link.receive(fresh_numbers(start, MAX_ITEMS))  # refusals, never taken
        assert link.overflowed and len(link.out) == PENDING_MESSAGES * MAX_ITEMS + 2
        assert link.ready.is_set()
        await leader.stop("test over", resigned=True)

    asyncio.run(scenario())


def test_a_relay_message_quotes_what_it_was_sent_in_a_bounded_message():
    """Security review 3, F6: a job name of a million characters was echoed whole."""
    async def scenario():
        leader, _ = await led_job()
        link = RelayLink(leader, "r" * 10**6)
        with pytest.raises(InvalidArgument) as refused:
            link.receive(pb.RelayUp(job="x" * 10**6))
        assert len(str(refused.value)) < 200 and "1000000 chars" in str(refused.value)
        link.receive(relayed(1, pb.NodeFrame(job="y" * 10**6)))  # ends that stream alone
        (item,) = link.take().items
        assert item.end.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and len(item.end.message) < 200
        assert len(link.relay) == 256
        await leader.stop("test over", resigned=True)

    asyncio.run(scenario())


def test_a_relays_summary_is_its_word_for_its_nodes_and_names_only_the_lagging():
    async def scenario():
        clock = FakeClock()
        leader, joined = await led_job(clock)
        link = both_relayed(leader, joined)
        clock.advance(0.5)
        link.receive(pb.RelayUp(job="job", relay="relay:1", summary=pb.RelaySummary(
            low_step=7, high_step=9, nodes=2, lagging=[pb.LaggingStream(stream=2, since_ms=300, step=7),
                                                       pb.LaggingStream(stream=5, since_ms=1, step=1)])))
        assert (link.vouch.at, link.vouch.high) == (clock(), 9)
        nodes = leader.live.nodes
        assert nodes["p1"].vouch is link.vouch and not nodes["p1"].lagging and nodes["p2"].lagging
        assert leader.live.max_step(leader.state) == 9
        link.receive(pb.RelayUp(job="job", relay="relay:1", summary=pb.RelaySummary(high_step=10, resumed=[2])))
        assert not nodes["p2"].lagging
        with pytest.raises(InvalidArgument, match="low <= high"):
            link.receive(pb.RelayUp(job="job", relay="relay:1", summary=pb.RelaySummary(high_step=2**60)))
        await leader.stop("test over", resigned=True)

    asyncio.run(scenario())


def test_a_loss_only_map_goes_to_a_relay_once_for_the_nodes_it_can_renumber():
    async def scenario():
        leader, joined = await led_job()
        link = both_relayed(leader, joined, maps=True)
        given = {}
        while link.pending:
            given.update((item.stream, placement_of(item.directive)) for item in link.take().items)
        link.receive(pb.RelayUp(job="job", relay="relay:1", ended=[2]))  # p2's process exited: p1 goes on alone
        await until(lambda: leader.state.member("p2") is None, "p2 lost")
        down = link.take()
        assert not down.items and down.HasField("map") and list(down.map.own) == []
        mine = renumbered(given[1], down.map)
        assert mine == wire.assignment_for(leader.state, "p1", mine.assignment.reason)
        assert leader.streams["p1"].assigned == leader.state.generation
        await leader.stop("test over", resigned=True)

    asyncio.run(scenario())


def test_a_relay_before_maps_gets_a_loss_only_map_as_a_directive_per_node():
    async def scenario():
        leader, joined = await led_job()
        link = both_relayed(leader, joined)  # its first message did not say `maps`
        while link.pending:
            link.take()
        link.receive(pb.RelayUp(job="job", relay="relay:1", ended=[2]))
        await until(lambda: leader.state.member("p2") is None, "p2 lost")
        down = link.take()
        assert not down.HasField("map") and [item.stream for item in down.items] == [1]
        assert down.items[0].directive.generation == leader.state.generation
        await leader.stop("test over", resigned=True)

    asyncio.run(scenario())
