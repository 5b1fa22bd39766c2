"""JobLeader in-process, on the in-memory store and a clock the test advances: a decision is adopted
only once the store took it; a fenced write (a hook, or a term a newer leader's write superseded) ends
the leadership with nothing adopted, as does a session past its renew deadline; a store that is
unavailable defers the decision to a later tick, for its own job only."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import pytest
from muster.testing import FakeClock, until

from muster.coordinator.core.liveness import TAKEOVER_UNHEARD_TIMEOUTS
from muster.coordinator.core.machine import Context, Join, NodeLost, Tick, decide
from muster.coordinator.core.policy import JobSpec, Timing
from muster.coordinator.core.state import JobState, Outcome, decode
from muster.coordinator.errors import AlreadyExists, FailedPrecondition, NotFound, NotLeader
from muster.coordinator.coordination import LeaderKey
from muster.coordinator.job.leader import LARGE_JOB_NODES, JobLeader
from muster.coordinator.job.leadership import Leadership
from muster.coordinator.job.streams import NodeStream
from muster.coordinator.memory import MemoryJobStore
from muster.v1 import muster_pb2 as pb

pytestmark = pytest.mark.timeout(5)

TIMING = Timing(heartbeat_interval_s=0.05, heartbeat_timeout_s=1.0, grace_s=2.0, last_call_s=0.3)
SPEC = JobSpec(min_nodes=1, max_nodes=1)  # one join forms the job at once


class Led:
    """One job led on a store: its leader, and why its leadership was lost (None while held)."""

    def __init__(self, store: MemoryJobStore, clock: FakeClock, job: str = "job", term: int = 1,
                 session_alive=lambda: True) -> None:
        data = store.load_state(job)
        state = decode(data) if data else JobState(job, SPEC)
        self.leadership = Leadership(LeaderKey(job, term, f"memory/{job}", "replica"), store,
                                     session_alive=session_alive)
        self.leader = JobLeader(state, leadership=self.leadership, address="replica", timing=TIMING, tick_s=0.01,
                                clock=clock)
        self.leader.start()

    @property
    def lost(self) -> str | None:
        return self.leadership.lost_reason

    def join(self, node_id: str, join_key: bytes = b"") -> asyncio.Task:
        request = pb.JoinRequest(job=self.leader.job, node_id=node_id, host="10.0.0.1", store_port=29500, slots=1,
                                 join_key=join_key)
        return asyncio.ensure_future(self.leader.join(request, SPEC))




def stored(store: MemoryJobStore, job: str = "job") -> JobState | None:
    data = store.load_state(job)
    return decode(data) if data else None


def test_a_decision_is_adopted_once_the_store_took_it():
    async def scenario():
        store = MemoryJobStore()
        led = Led(store, FakeClock())
        member = await asyncio.wait_for(led.join("n1"), 2)
        assert member.node_id == "n1" and led.leader.state.generation == 1
        assert stored(store) == led.leader.state and stored(store).term == 1
        await led.leader.stop("test over", resigned=True)

    asyncio.run(scenario())


def test_a_join_repeated_with_its_key_gets_the_membership_it_made_and_another_key_is_refused():
    """An agent whose Join deadline passed while the leader admitted it tries again with the same
    join key: it is answered with that member and its secret (nothing changes, no generation); an
    attempt without the key, or with another, is a second node of the id: refused."""
    async def scenario():
        store = MemoryJobStore()
        led = Led(store, FakeClock())
        first = await asyncio.wait_for(led.join("n1", b"k" * 32), 2)
        generation, stored_before = led.leader.state.generation, stored(store)
        again = await asyncio.wait_for(led.join("n1", b"k" * 32), 2)
        assert (again.member_id, again.session_secret, again.run) == (first.member_id, first.session_secret, first.run)
        assert led.leader.state.generation == generation == 1 and stored(store) == stored_before
        for other in (b"", b"o" * 32):
            with pytest.raises(AlreadyExists, match="already a member"):
                await asyncio.wait_for(led.join("n1", other), 2)
        # keys are per node: n2 with n1's key is a new member with its own secret
        n2 = await asyncio.wait_for(led.join("n2", b"k" * 32), 2)
        assert n2.member_id != first.member_id and n2.session_secret != first.session_secret
        await led.leader.stop("test over", resigned=True)

    asyncio.run(scenario())


def test_a_fenced_write_ends_the_leadership_and_nothing_is_adopted():
    async def scenario():
        store = MemoryJobStore()
        led = Led(store, FakeClock())
        store.fence_next_write("job")
        joining = led.join("n1")
        await until(lambda: led.lost, "the leadership lost")
        assert led.lost.startswith("fenced write refused")
        assert led.leader.state.member("n1") is None and stored(store) is None
        await led.leader.stop(led.lost)  # as the replica does once `lost` is set
        with pytest.raises(NotLeader):
            await joining

    asyncio.run(scenario())


def test_the_old_leader_is_fenced_once_the_new_one_wrote():
    async def scenario():
        store = MemoryJobStore()
        old_clock, new_clock = FakeClock(), FakeClock()
        old = Led(store, old_clock)
        await asyncio.wait_for(old.join("n1"), 2)
        new = Led(store, new_clock, term=2)  # takes over from the stored state, with a grace period
        assert new.leader.state == stored(store)
        # n1 never reaches the new leader: the grace runs on (bounded) while no node has, then n1,
        # the job's only node, is evicted, which ends the run (failed), recorded by the new leader
        await new_clock.elapse(TIMING.grace_s + (TAKEOVER_UNHEARD_TIMEOUTS + 1) * TIMING.heartbeat_timeout_s, 0.25)
        await until(lambda: new.leader.ended, "the new leader's eviction of silent n1 stored")
        assert stored(store) is None and json.loads(store.runs("job")[0][2])["outcome"] == "failed"
        # the old leader, as if resumed (its ticks on time: not its own pause), decides the same
        await old_clock.elapse(TIMING.heartbeat_timeout_s + 0.1)
        await until(lambda: old.lost, "the old leader fenced")
        assert old.lost.startswith("fenced write refused")
        assert old.leader.state.member("n1") is not None and stored(store) is None
        for led in (old, new):
            await led.leader.stop("test over")

    asyncio.run(scenario())


def test_a_session_past_its_renew_deadline_sets_the_leadership_lost():
    async def scenario():
        store = MemoryJobStore()
        session = {"alive": True}
        led = Led(store, FakeClock(), session_alive=lambda: session["alive"])
        await asyncio.wait_for(led.join("n1"), 2)
        session["alive"] = False
        await asyncio.wait_for(led.leadership.lost.wait(), 2)
        assert led.lost.startswith("session lost") and stored(store) == led.leader.state
        await led.leader.stop(led.lost)

    asyncio.run(scenario())


def test_an_unavailable_store_defers_the_decision_to_a_later_tick_of_that_job_only():
    async def scenario():
        store = MemoryJobStore()
        clock = FakeClock()
        a, b = Led(store, clock, "a"), Led(store, clock, "b")
        store.make_unavailable("a")
        joining_a, joining_b = a.join("n1"), b.join("n1")
        await asyncio.wait_for(joining_b, 2)
        # Ten of a's tallies, each of which decided the join again and had its write deferred:
        refused = store.refused
        await until(lambda: store.refused >= refused + 10, "ten writes of a's join refused")
        assert not joining_a.done() and a.leader.state.member("n1") is None and not a.lost
        store.make_available()
        member = await asyncio.wait_for(joining_a, 2)
        assert member.node_id == "n1" and stored(store, "a") == a.leader.state
        assert stored(store, "b") == b.leader.state and not b.lost
        for led in (a, b):
            await led.leader.stop("test over")

    asyncio.run(scenario())


def test_a_large_job_changes_off_the_loop_and_every_node_gets_its_part_once():
    """1,200 nodes (a large job: decided in a worker thread, directives sent in slices): a node
    lost makes one generation, each other node gets exactly one assignment of it, and frames are
    taken while the change is under way."""
    nodes = LARGE_JOB_NODES + 200
    ctx = Context(now=0, wall_ms=0, term=1, timing=TIMING)
    state = decide(JobState("big", JobSpec(1, nodes, 1)),
                   [Join(f"n{i}", "10.0.0.1", 29500, 1) for i in range(nodes)], ctx).state
    state = decide(state, [Tick()], Context(now=1, wall_ms=0, term=1, timing=TIMING)).state

    async def scenario():
        clock = FakeClock()
        leader = JobLeader(state, leadership=Leadership(LeaderKey("big", 1, "memory/big", "replica"),
                                                        MemoryJobStore()),
                           address="replica", timing=TIMING, tick_s=0.01, clock=clock)
        for m in state.members:
            leader.streams[m.node_id] = NodeStream("big", m.node_id, m.member_id, m.kind)
        frame = pb.NodeFrame(job="big", node_id="n7", member_id=state.member("n7").member_id, term=1,
                             generation=state.generation,
                             ranks=[pb.RankReport(local_rank=0, pid=7, step=3, state=pb.RANK_STATE_RUNNING)])
        tally = asyncio.ensure_future(leader.tally_once(NodeLost("n0", "node_silent", "test")))
        await asyncio.sleep(0)  # the tally is deciding in its thread: a frame is taken meanwhile
        leader.on_frame(leader.streams["n7"], frame)
        await tally
        assert leader.state.generation == state.generation + 1 and leader.state.member("n0") is None
        for node_id, stream in leader.streams.items():
            got = [stream.queue.get_nowait() for _ in range(stream.queue.qsize())]
            assert [d.generation for d in got] == [leader.state.generation], node_id
        assert leader.live.nodes["n7"].ranks[0].step == 3

    asyncio.run(scenario())


def test_a_node_whose_session_opens_after_a_planned_switch_forms_the_group_it_leaves_first():
    """Stop 74's CI: node c was placed in generation 1, and before its Session opened node d joined and
    generation 2 came as a switch after step 2. c heard only generation 2, formed it at once and waited
    there, while a and b waited in generation 1 for c: fenced out 60 s later. A node that never ran the
    group a pending planned switch leaves now gets that group's assignment first; a node that ran it, or
    one new in the switch, gets the current assignment alone; once a map forms at once, so does it."""
    spec = JobSpec(min_nodes=3, max_nodes=4)

    async def scenario():
        clock = FakeClock()
        leader = JobLeader(JobState("job", spec), leadership=Leadership(LeaderKey("job", 1, "memory/job", "replica"),
                                                                        MemoryJobStore()),
                           address="replica", timing=TIMING, tick_s=0.01, clock=clock)
        leader.start()

        async def join(node: str) -> pb.JoinResponse:
            return await leader.join(pb.JoinRequest(job="job", node_id=node, host="10.0.0.1", store_port=29500,
                                                    slots=1, is_process=True), spec)

        def opened(joined: pb.JoinResponse, ran: int) -> list[tuple[int, str]]:
            stream = leader.attach(pb.NodeFrame(job="job", node_id=joined.node_id, member_id=joined.member_id,
                                                term=joined.term, session_secret=joined.session_secret,
                                                generation=ran))
            got = [stream.queue.get_nowait() for _ in range(stream.queue.qsize())]
            return [(d.generation, d.assignment.reason) for d in got]

        joined = {node: await join(node) for node in "abc"}
        clock.advance(TIMING.last_call_s + 0.1)
        await until(lambda: leader.state.generation == 1, "generation 1 formed")
        joined["d"] = await join("d")
        await until(lambda: leader.state.generation == 2, "d's generation")
        assert leader.state.rank_map.planned
        assert opened(joined["c"], 0) == [(1, "current assignment, before the planned switch"),
                                          (2, "current assignment")]
        assert opened(joined["a"], 1) == [(2, "current assignment")]
        assert opened(joined["d"], 0) == [(2, "current assignment")]
        await leader.tally_once(NodeLost("d", "node_silent", "test"))
        assert leader.state.generation == 3 and not leader.state.rank_map.planned
        assert opened(joined["b"], 0) == [(3, "current assignment")]
        await leader.stop("test over", resigned=True)

    asyncio.run(scenario())


def test_a_stop_repeated_is_answered_as_such_and_one_after_another_end_refused():
    """The second `muster stop` (its first's answer lost to a deadline) gets `already`, not
    FAILED_PRECONDITION; a stop of a run that ended another way is still refused."""
    async def scenario():
        leader = await _led(_formed_abc(), 1, MemoryJobStore())
        first = await leader.stop_job("by the book")
        again = await leader.stop_job("by the book")
        assert (first.run, first.already, again.run, again.already) == (1, False, 1, True)
        await leader.stop("test over", resigned=True)
        failed = await _led(replace(_formed_abc(), outcome=Outcome.FAILED, outcome_reason="x", ended_ms=1), 1,
                            MemoryJobStore())
        with pytest.raises(FailedPrecondition, match=r"has ended already \(failed\)"):
            await failed.stop_job("too late")
        await failed.stop("test over", resigned=True)

    asyncio.run(scenario())


def test_a_drain_repeated_is_answered_as_such_and_one_of_a_node_lost_refused():
    """`muster drain` repeated (its first's answer lost to a deadline), or two at once: the node
    leaves once, the other drain gets `already`. A node that left is answered so until it joins
    again; one lost, or never a member, is still NOT_FOUND."""
    async def scenario():
        leader = await _led(_formed_abc(), 1, MemoryJobStore())
        first, second = await asyncio.gather(leader.drain_node("c", "maintenance"),
                                             leader.drain_node("c", "maintenance"))
        assert sorted([first.already, second.already]) == [False, True], (first, second)
        assert leader.state.member("c") is None
        (left,) = [e for e in leader.state.history if e.kind == "node_left"]  # once
        again = await leader.drain_node("c", "maintenance")
        assert again.already and again.generation == leader.state.generation
        await leader.tally_once(NodeLost("b", "node_silent", "no frame for 1 s"))
        assert leader.state.member("b") is None
        for gone in ("b", "z"):
            with pytest.raises(NotFound, match=rf"node '{gone}' is not a member"):
                await leader.drain_node(gone, "too late")
        await leader.stop("test over", resigned=True)

    asyncio.run(scenario())


def _formed_abc() -> JobState:
    """Nodes a, b and c (min 2), formed: the state a leader of the tests below takes over."""
    spec = JobSpec(min_nodes=2, max_nodes=3)
    formed = decide(JobState("job", spec), [Join(n, "10.0.0.1", 29500, 1) for n in "abc"],
                    Context(now=0, wall_ms=0, term=1, timing=TIMING)).state
    return decide(formed, [Tick()], Context(now=1, wall_ms=0, term=1, timing=TIMING)).state


def _c_failed(leader: JobLeader, pid: int, step: int) -> None:
    """Node c reports that its rank (process `pid`) died of an error in `step`."""
    c = leader.state.member("c")
    leader.on_frame(leader.streams["c"], pb.NodeFrame(
        job="job", node_id="c", member_id=c.member_id, term=leader.term, generation=leader.state.generation,
        exits=[pb.RankExit(local_rank=0, pid=pid, exit_code=1, step=step,
                           error=f"RuntimeError: CUDA error: an illegal memory access (step {step})")]))


async def _led(state: JobState, term: int, store: MemoryJobStore, clock: FakeClock | None = None) -> JobLeader:
    """A leader of `state` in `term`, every member's stream open."""
    leadership = Leadership(LeaderKey("job", term, "memory/job", "replica"), store)
    leader = JobLeader(state, leadership=leadership, address="replica", timing=TIMING, tick_s=0.01,
                       clock=clock or FakeClock())
    for m in state.members:
        leader.streams[m.node_id] = NodeStream("job", m.node_id, m.member_id, m.kind)
    leader.start()
    return leader


def test_a_nodes_fault_count_toward_holding_it_out_outlives_its_leader():
    """Node c's rank fails of its own fault twice under one leader and once under the next (it lost
    its etcd session in between: fresh-clone run E): the third failure within the window holds c
    out, as it would have under one leader. Before, the count began again at each term."""
    store = MemoryJobStore()

    async def scenario():
        first = await _led(_formed_abc(), 1, store)
        for pid, step in ((101, 2), (102, 22)):
            _c_failed(first, pid, step)
            await until(lambda: (s := stored(store)) and len(s.member("c").faults_ms) == step // 20 + 1,
                        "the fault kept with c's membership")
        await first.stop("its session lost", resigned=True)
        second = await _led(stored(store), 2, store)
        _c_failed(second, 103, 40)
        await until(lambda: second.state.member("c") is None, "c held out")
        (left,) = [e for e in second.state.history if e.kind == "node_left"]
        assert "held out: its ranks failed 3 times" in left.reason, left
        await second.stop("test over", resigned=True)

    asyncio.run(scenario())


def test_a_slots_failure_repeated_under_the_next_leader_is_a_repeat():
    """Node c's rank dies of an error in step 6 under one leader; its restart dies of the same error in
    the same step under the next (the first lost its etcd session between: a 3-worker run). The run
    ends failed at once with the repeat's verdict, as under one leader. Before, the new leader did not
    know the first failure and restarted every slot once more."""
    store = MemoryJobStore()

    async def scenario():
        first = await _led(_formed_abc(), 1, store)
        _c_failed(first, 101, 6)
        await until(lambda: (s := stored(store)) and s.member("c").last_errors, "c's failure kept with c")
        await first.stop("its session lost", resigned=True)
        second = await _led(stored(store), 2, store)
        _c_failed(second, 102, 6)
        await until(lambda: second.state.ended, "the run ended")
        assert second.state.outcome is Outcome.FAILED and "failed again in step 6 with the same error" \
            in second.state.outcome_reason, second.state.outcome_reason
        await second.stop("test over", resigned=True)

    asyncio.run(scenario())


def _finished(leader: JobLeader, node_id: str) -> None:
    """Node `node_id` reports that its rank completed its script (still in teardown)."""
    member = leader.state.member(node_id)
    leader.on_frame(leader.streams[node_id], pb.NodeFrame(
        job="job", node_id=node_id, member_id=member.member_id, term=leader.term, generation=leader.state.generation,
        ranks=[pb.RankReport(local_rank=0, pid=100, state=pb.RANK_STATE_FINISHED, step=20,
                             generation=leader.state.generation)]))


def test_a_leader_taking_over_a_finishing_job_waits_for_its_members_ranks():
    """A leader lost its session as the job finished (a's rank completed its script; b's and c's ranks
    were still in teardown). Its successor knows nothing yet of its members' ranks: it waits for them,
    and ends the run once they have left. Before, it ended the run at its first tick, 'placed at
    generation 1 never trained' (a fresh-clone run), while a rank still hung in teardown."""
    store = MemoryJobStore()

    async def scenario():
        first = await _led(_formed_abc(), 1, store)
        _finished(first, "a")
        await until(lambda: (s := stored(store)) and s.finishing, "the job finishing")
        await first.stop("its session lost", resigned=True)
        second = await _led(stored(store), 2, store)
        await asyncio.sleep(0.2)  # 20 ticks, none of them hearing a member
        assert not second.state.ended, second.state.outcome_reason
        for node_id in "abc":
            _finished(second, node_id)
            member = second.state.member(node_id)
            await second.leave(pb.LeaveRequest(job="job", node_id=node_id, member_id=member.member_id,
                                               finished=True,
                                               reason="its ranks finished"))
        await until(lambda: second.state.ended, "the run ended")
        assert second.state.outcome is Outcome.SUCCEEDED, second.state.outcome_reason
        assert "never trained" not in second.state.outcome_reason, second.state.outcome_reason
        await second.stop("test over", resigned=True)

    asyncio.run(scenario())


def _stepped(leader: JobLeader, node_id: str, step: int) -> None:
    """Node `node_id`'s frame: its rank at `step`."""
    member = leader.state.member(node_id)
    leader.on_frame(leader.streams[node_id], pb.NodeFrame(
        job="job", node_id=node_id, member_id=member.member_id, term=leader.term, generation=leader.state.generation,
        ranks=[pb.RankReport(local_rank=0, pid=100, state=pb.RANK_STATE_RUNNING, step=step,
                             generation=leader.state.generation)]))


def test_a_leader_that_did_not_run_for_a_while_judges_no_node_silent_for_its_own_pause():
    """The leader's task ran 3 heartbeat timeouts late (its host starved it: a fresh-clone run's
    coordinator woke after 11.6 s and ended a healthy run 'every node was lost'). The nodes' frames of
    that time were unread, not missing: nobody is judged for a heartbeat timeout after it resumed. Then
    a node that stays silent is, and the nodes whose frames came are not."""
    clock = FakeClock()

    async def scenario():
        leader = await _led(_formed_abc(), 1, MemoryJobStore(), clock)
        for step in (1, 2):
            for node_id in "abc":
                _stepped(leader, node_id, step)
            clock.advance(0.2)
            await asyncio.sleep(0.03)
        clock.advance(3 * TIMING.heartbeat_timeout_s)  # while the leader's task waits for its next tick
        await asyncio.sleep(0.1)  # ~10 ticks
        assert [m.node_id for m in leader.state.members] == ["a", "b", "c"], leader.state.history[-1]
        for step in range(3, 12):  # a and b's frames come; c's never do
            for node_id in "ab":
                _stepped(leader, node_id, step)
            clock.advance(0.2)
            await asyncio.sleep(0.03)
        await until(lambda: leader.state.member("c") is None, "c found silent")
        assert [m.node_id for m in leader.state.members] == ["a", "b"]
        (silent,) = [e for e in leader.state.history if e.kind == "node_silent"]
        assert silent.nodes == ("c",), silent
        await leader.stop("test over", resigned=True)

    asyncio.run(scenario())
