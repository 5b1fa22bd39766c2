"""One job led by this replica: its state, its node streams and its tally loop.

A single asyncio task owns every change: it folds queued requests, exit reports and the
liveness failures of one tick into one decision, persists it (fenced on the term) and only
then adopts it and pushes each node its part of the new map. A frame updates liveness, and
what it says of the node (finishing, slots up or down, lost, a regroup) is queued for that task.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections.abc import Callable, Sequence

import structlog

from muster.coordinator.job import status_pages

from muster.coordinator import wire
from muster.coordinator.claims import MemberKeys, random_part, rejoin_of, secret_hash, taken_back
from muster.coordinator.core.kinds import FailureKind
from muster.coordinator.core.liveness import Liveness
from muster.coordinator.core.machine import (Context, Decision, Finishing, Join, Leave, MembershipEvent, NodeLost,
                                             SlotsUp, Stop, Tick, decide)
from muster.coordinator.core.policy import JobSpec, Limits, Timing
from muster.coordinator.core.state import JobState, NodeKind, Outcome, Phase, Placement
from muster.coordinator.core.stragglers import StragglerPolicy
from muster.coordinator.errors import FailedPrecondition, Fenced, NotFound, NotLeader, PersistUnavailable
from muster.coordinator.job.frames import FrameReader, admit, authenticate, check_first, check_joinable, member_of
from muster.coordinator.job.inbox import Inbox, Queued, settle
from muster.coordinator.job.leader_stats import LeaderStats, live_ranks, summarised
from muster.coordinator.job.leadership import Leadership
from muster.coordinator.metrics import Metrics
from muster.coordinator.errors import ResourceExhausted
from muster.coordinator.quotas import JobBudget, JobBudgets, refusals
from muster.coordinator.job.relay_link import RelayWord
from muster.coordinator.job.run_end import RunEnd
from muster.coordinator.job.straggler_duty import StragglerDuty
from muster.coordinator.job.streams import NodeStream, RelayedBy, Streams
from muster.v1 import muster_pb2 as pb

log = structlog.get_logger(__name__)

# A job of this many nodes is large: its leader keeps its event loop free while it changes the job
# (it decides in a worker thread, and sends the new map's directives in slices), and its million
# live objects (state, liveness, streams) out of the cyclic GC's full collections (70-170 ms at
# 12,500 nodes, set off by a change's directives): the GC's view is frozen once the takeover grace
# is over (every node heard) and after each new generation (refcounting still frees them).
LARGE_JOB_NODES = 1_000
_GC_PAUSES = [0]  # large decisions under way (in worker threads): the collector runs when none is
_GC_PAUSES_LOCK = threading.Lock()


def decide_large(state: JobState, events: list, ctx: Context) -> Decision:
    """`decide` with the cyclic GC paused: its new map's objects (85k renumbered placements on a
    loss in a 125k-node job) set off collections that were a tenth of the change's CPU. Nothing it
    makes is cyclic garbage; the next collection after it sees what others made meanwhile."""
    with _GC_PAUSES_LOCK:
        _GC_PAUSES[0] += 1
        gc.disable()
    try:
        return decide(state, events, ctx)
    finally:
        with _GC_PAUSES_LOCK:
            _GC_PAUSES[0] -= 1
            if not _GC_PAUSES[0]:
                gc.enable()


def liveness_for(state: JobState, timing: Timing, now: float) -> Liveness:
    """Liveness of a job as a new leader takes it over (or starts it)."""
    live = Liveness(timing, now)
    live.generation_published(state.generation, now)
    if state.members:  # taken over: agents get a grace period to reconnect
        live.start_grace([m.node_id for m in state.members], now)
    for m in state.members:  # the failed pids died with the previous leader: any process is new
        live.exits.awaiting(m.node_id, m.down_slots)
        live.exits.faults_before(m.node_id, m.faults_ms)
        live.exits.errors_before(m.node_id, m.last_errors)
    return live


class JobLeader:
    def __init__(
        self,
        state: JobState,
        *,
        leadership: Leadership,
        address: str,
        timing: Timing,
        tick_s: float,
        limits: Limits = Limits(),
        stragglers: StragglerPolicy = StragglerPolicy(),
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        metrics: Metrics | None = None,
        retain_s: float = 7 * 86400.0,
        member_keys: Callable[[], MemberKeys | None] = lambda: None,
        budgets: JobBudgets | None = None,
        stats: LeaderStats | None = None,
    ):
        """`stats`: the figures of this replica's last leadership of the job, where it left the same map."""
        self.job = state.job
        self.leadership = leadership
        self.term = leadership.term
        self.address = address
        self.timing = timing
        self.tick_s = tick_s
        self.limits = limits.for_job(state.job)
        # The job's rates are the replica's, by job name: a new term or run does not refill them.
        self.budgets = budgets or JobBudgets(limits, clock)
        self._written_at = -float("inf")  # the last state write: at most one a tick
        self.state = state
        self._clock = clock
        self._wall = wall
        self.member_keys = member_keys  # read at each use: a reloaded tokens file changes them
        now = clock()
        self.live = liveness_for(state, timing, now)
        self.streams = Streams(timing.heartbeat_timeout_s / 4, tick_s)
        self.relay_word = RelayWord(self.streams, self.live, clock)
        self._inbox = Inbox()
        self._task: asyncio.Task | None = None
        self.tallies = 0  # tallies done: a test waits for some before it asserts that nothing changed
        self.log = log.bind(job=self.job, term=self.term)
        self.metrics = metrics or Metrics()
        self.stats = stats or LeaderStats(self.job, self.metrics, now)
        self._frames = FrameReader(self.term, self.live, self.stats, clock, wall)
        self._graced = True  # the takeover grace has not ended yet
        self._run_end = RunEnd(leadership, timing.stop_grace_s, retain_s, self.limits.runs_kept, self.metrics,
                               self.log)
        self.ended = False  # the run ended and its record was written: the job is no more
        self.stragglers = StragglerDuty(stragglers.for_job(state.spec), now, self.log)

    def budget(self) -> JobBudget:
        return self.budgets.of(self.job, self.limits.members_of(self.state.spec))

    @property
    def lost_reason(self) -> str | None:
        return self.leadership.lost_reason

    # ---- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"leader:{self.job}")

    async def stop(self, reason: str, *, resigned: bool = False) -> None:
        """Give up the job: refuse queued requests and end every stream with a leader hint."""
        self._lose(reason, resigned)
        if self._task and self._task is not asyncio.current_task():
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        not_leader = NotLeader(self.job, "")
        self._inbox.refuse_all(not_leader)
        self.streams.end_all(not_leader)

    def _lose(self, reason: str, resigned: bool = False) -> None:
        if self.leadership.lose(reason):
            if resigned:
                self.log.info("leadership_resigned", reason=reason)
            else:
                self.log.warning("leadership_lost", reason=reason)

    async def _run(self) -> None:
        while self.lost_reason is None:
            waited_from = self._clock()
            await self._inbox.wait(self.tick_s)
            if (late_s := self._clock() - waited_from - self.tick_s) > self.timing.heartbeat_timeout_s / 2:
                # This task did not run when due: the nodes' frames of that time are unread, not missing
                self.live.after_a_pause(self._clock())
                self.log.warning("leader_resumed_after_a_pause", late_s=round(late_s, 3),
                                 judged_from_s=self.timing.heartbeat_timeout_s)
            # One state write a tick at most: what comes in meanwhile (a flood's Joins, its nodes'
            # changes) folds into the next decision, and its one write.
            pause = self._written_at + self.tick_s - self._clock()
            if pause > 0:
                await asyncio.sleep(pause)
            if not self.leadership.alive():
                self._lose("session lost: lease renewals failed past the renew deadline")
                return
            try:
                await self.tally_once()
            except Fenced as exc:
                self._lose(f"fenced write refused: {exc}")
                return
            except Exception as exc:  # a bug must not leave a leader that silently stops tallying
                self.log.exception("tally_failed")
                self._lose(f"tally failed: {exc!r}")
                return
            if self.ended:
                return
            self.streams.pulse(self._pulse_directive(), self._clock())

    def _pulse_directive(self) -> pb.Directive:
        return pb.Directive(term=self.term, generation=self.state.generation, finishing=self.state.finishing)

    # ---- the tally -------------------------------------------------------------------

    async def tally_once(self, *events: MembershipEvent) -> None:
        """One tally, of what came in and `events`: what the leader's task does each tick (a test or
        a benchmark drives a leader it did not start with it)."""
        self._inbox.add(events)
        await self._tally()
        self.tallies += 1

    async def _tally(self) -> None:
        """take -> assess -> decide -> persist -> adopt -> settle: liveness is asked once for what it
        found (`Liveness.assess`) and told once what was adopted (`Liveness.apply`, in `_adopt`)."""
        now = self._clock()
        batch = self._inbox.take()
        seen = self.live.assess(self.state, now, slots_back=any(isinstance(e, SlotsUp) for e, _ in batch),
                                recovering=self.stats.recovering)
        self.stats.measure(now, seen)
        if self._graced and seen.grace_over:
            self._graced = False
            self._freeze_gc()
        if seen.reforming:
            # A slot back while the abort generation still forms waits until it has formed: its
            # planned switch would reach a node that reconnects only as the current map, without
            # the abort before it, and an abort instead would cut the forming group again.
            self._inbox.defer([(e, f) for e, f in batch if isinstance(e, SlotsUp)])
            batch = [(e, f) for e, f in batch if not isinstance(e, SlotsUp)]
        if seen.diverged is not None:
            self.log.warning("replicas_diverged", step=seen.diverged.step, ranks=list(seen.diverged.ranks))
        events = [event for event, _ in batch] + seen.events()  # requests first, though refusals go by ticket
        events += self.stragglers.look(now, self.state, seen, self.streams)
        if self.state.phase is not Phase.RUNNING or self.state.ended or self.state.rebuilding or self.state.finishing:
            # forming, waiting, draining and rebuilding deadlines; a finishing job's end (a node that
            # joined as it finished says only later, with its ranks' first report, that it never trained)
            events.append(Tick())
        if not events:
            return
        reached, reported = seen.steps  # O(nodes): only when there is something to decide
        ctx = Context(now, int(self._wall() * 1000), self.term, self.timing, reached, seen.median_step_time,
                      prestart=seen.prestart, max_members=self.limits.members_of(self.state.spec),
                      step_lag_s=self.timing.relay_progress_s if self.streams.relayed else 0.0,
                      high_step=self.stats.high_step,
                      unformed=seen.unformed if self.state.finishing or any(isinstance(e, (Finishing, Leave))
                                                                             for e in events) else frozenset())
        if len(self.state.members) >= LARGE_JOB_NODES:
            # Pure, on an immutable state, and only this task adopts: frames go on meanwhile.
            decision = await asyncio.to_thread(decide_large, self.state, events, ctx)
        else:
            decision = decide(self.state, events, ctx)
        if decision.persist and not await self._persist(decision, batch):
            return
        await self._adopt(decision, now, reported)  # (recovery counts from steps reported)
        settle(batch, decision)
        if self.state.ended and await self._run_end.carried_out(self.state, now, self.streams):
            self.ended = True

    async def _persist(self, decision: Decision, batch: list[Queued]) -> bool:
        """Write the decision's state, fenced on the term; whether it was written. Nothing of the
        batch is adopted otherwise: it is decided again next tick (or by nobody, once fenced), as when
        the job has written its etcd budget: it waits until the budget is paid back."""
        budget = self.budget()
        try:
            budget.etcd.check()
        except ResourceExhausted as exc:
            self._inbox.defer(batch)
            refusals.refused("state_write_held", "RESOURCE_EXHAUSTED", str(exc), job=self.job)
            return False
        try:
            with self.metrics.etcd_write.time():
                written = await self.leadership.write_state(decision.state)
        except PersistUnavailable as exc:
            self._inbox.defer(batch)
            self.log.warning("state_write_deferred", error=str(exc))
            return False
        except Fenced:
            self._inbox.defer(batch)
            raise
        self._written_at = self._clock()
        budget.etcd.charge(written)
        return True

    def _freeze_gc(self) -> None:
        if len(self.state.members) >= LARGE_JOB_NODES:
            gc.freeze()

    def live_ranks(self, placements: Sequence[Placement] | None = None) -> int:
        """Ranks of the map (or of `placements`) on nodes heard from within the heartbeat timeout."""
        rm = self.state.rank_map
        if placements is None:
            placements = rm.placements if rm else ()
        return live_ranks(placements, self.live, self._clock(), self.timing.heartbeat_timeout_s)

    async def _adopt(self, d: Decision, now: float, step_before: int) -> None:
        started_finishing = d.state.finishing and not self.state.finishing
        previous, self.state = self.state.rank_map, d.state
        if started_finishing:
            self.streams.pulse_all(self._pulse_directive())
        for e in d.events:
            self.log.info("membership_changed", kind=e.kind, generation=e.generation, reason=e.reason,
                          nodes=list(e.nodes), world_size=e.world_size)
        self.stats.adopted(d, now, step_before)
        if d.new_generation:
            self.budget().generations.charge(1)
        self.live.apply(d, now)
        await self.streams.deliver(d, self.term, len(self.state.members) >= LARGE_JOB_NODES, previous)
        if d.new_generation:
            self._freeze_gc()

    # ---- requests --------------------------------------------------------------------

    async def join(self, req: pb.JoinRequest, requested: JobSpec) -> pb.JoinResponse:
        check_joinable(self.state, requested)
        budget = self.budget()
        if self.state.phase is Phase.RUNNING:  # a Join makes a new generation of a running job
            budget.generations.check()
        budget.etcd.check()
        budget.joins.spend()
        # The member's proof from now on: made here at the edge (the core stays deterministic),
        # kept by the state only as a hash, never logged. An attempt repeated with the same join key
        # hashes alike, and so is answered with the membership its first attempt made.
        secret = random_part(req)
        kind = wire.node_kind(req.is_process)
        member = await self._inbox.ask(Join(req.node_id, req.host, req.store_port, req.slots, kind, req.master_port,
                                            secret_hash(secret), requested))
        keys = self.member_keys()
        if keys is not None:  # what proves the member if etcd loses the job
            secret = keys.sign(secret, self.job, self.state.run, member.node_id, member.member_id,
                               self.state.started_ms)
        return pb.JoinResponse(job=self.job, node_id=member.node_id, member_id=member.member_id, term=self.term,
                               generation=self.state.generation, run=self.state.run, session_secret=secret,
                               heartbeat_interval_ms=int(self.timing.heartbeat_interval_s * 1000),
                               heartbeat_timeout_ms=int(self.timing.heartbeat_timeout_s * 1000))

    async def leave(self, req: pb.LeaveRequest) -> pb.LeaveResponse:
        authenticate(member_of(self.state, req.node_id, req.member_id), req.session_secret)
        self.streams.depart(req.node_id)
        generation, switch_at = await self._inbox.ask(Leave(req.node_id, req.immediate, req.reason or "requested",
                                                            req.finished))
        return pb.LeaveResponse(generation=generation, switch_at_step=switch_at)

    async def stop_job(self, reason: str) -> pb.StopResponse:
        """An operator's stop: the run ends `stopped` now, every node drains at one step. A stop
        repeated once the first took effect is answered as such (`already`), not refused."""
        try:
            after_step = await self._inbox.ask(Stop(reason))
        except FailedPrecondition:
            if self.state.outcome is Outcome.STOPPED:
                return pb.StopResponse(run=self.state.run, already=True)
            raise
        return pb.StopResponse(run=self.state.run, after_step=after_step)

    async def drain_node(self, node_id: str, reason: str) -> pb.DrainResponse:
        """An operator's drain of one node: it leaves at a step boundary, as on SIGTERM to its agent. A
        drain repeated once the node left (the first's answer lost to a deadline, or two at once) is
        answered as such (`already`), not refused."""
        wire.check_node(node_id)
        if self.state.member(node_id) is None:
            return self._left_already(node_id)
        placed = self.state.rank_map is not None and self.state.rank_map.placement(node_id) is not None
        stream = self.streams.depart(node_id)
        try:
            generation, switch_at = await self._inbox.ask(Leave(node_id, False, reason))
        except NotFound:  # another drain's Leave came first
            return self._left_already(node_id)
        if stream and not placed:  # a spare or a waiting node: the decision sent it no drain
            stream.send(pb.Directive(term=self.term, generation=generation, drain=pb.Drain(reason=reason)))
        return pb.DrainResponse(generation=generation, after_step=switch_at if placed else 0)

    def _left_already(self, node_id: str) -> pb.DrainResponse:
        if self.state.left(node_id) is None:
            raise NotFound(f"node {node_id!r} is not a member of job {self.job!r}")
        return pb.DrainResponse(generation=self.state.generation, already=True)

    # ---- node streams ----------------------------------------------------------------

    def attach(self, first: pb.NodeFrame, *, link: RelayedBy | None = None, stream_id: int = 0) -> NodeStream:
        """Bind a Session stream to its node; the node gets its current assignment at once. While
        a lost state is rebuilt, a node that is no member but says who it was is taken back.
        A relayed stream (`link`, `stream_id`) is authenticated the same way, by its first frame."""
        check_first(first, self.state)
        if taken_back(first, self.state, self.member_keys):
            return self._take_back(first, link, stream_id)
        member = admit(first, self.state, self.streams.get(first.node_id))
        stream = NodeStream(self.job, member.node_id, member.member_id, member.kind,
                            term_ahead=first.term if self.state.rebuilding else 0, link=link, stream_id=stream_id,
                            seq=first.stream_seq)
        self.on_frame(stream, first)
        self.streams.attach(stream, self.state, self.term, first.generation)
        self.log.info("node_attached", node=member.node_id, member=member.member_id, generation=first.generation)
        return stream

    def _take_back(self, first: pb.NodeFrame, link: RelayedBy | None, stream_id: int) -> NodeStream:
        """The core decides (Rejoin); until then the stream is bound to nothing and its frames wait."""
        rejoin = rejoin_of(first, self.state.run, self.member_keys(), int(self._wall() * 1000))
        stream = NodeStream(self.job, first.node_id, first.member_id, rejoin.kind, pending=True,
                            term_ahead=first.term, link=link, stream_id=stream_id, seq=first.stream_seq)
        fut = self._inbox.ask(rejoin)
        fut.add_done_callback(lambda decided: self._taken_back(stream, decided, first.generation))
        return stream

    def _taken_back(self, stream: NodeStream, decided: asyncio.Future, generation: int) -> None:
        if decided.exception() is not None:
            stream.send(decided.exception())
            return
        stream.pending = False
        if self.lost_reason is not None:
            stream.send(NotLeader(self.job, ""))
        elif not stream.closed:
            self.streams.attach(stream, self.state, self.term, generation)
            self.log.info("node_taken_back", node=stream.node_id, member=stream.member_id, generation=generation)

    def detach(self, stream: NodeStream, *, relay_lost: bool = False) -> None:
        """The node's stream ended. One whose relay's stream ended (`relay_lost`) is no sign that
        the node is gone, even for a process node: its silence past the heartbeat timeout from now
        (time to reconnect elsewhere) decides."""
        if not self.streams.detach(stream):
            return  # replaced or evicted already
        if stream.link is not None:  # no relay judges its silence now: here, from now on
            self.live.unvouched(stream.node_id, self._clock())
        if stream.kind is NodeKind.PROCESS and not stream.departed and self.lost_reason is None and not relay_lost:
            self._inbox.put(NodeLost(stream.node_id, FailureKind.PROCESS_EXITED, "its session closed without leaving"))

    def on_frame(self, stream: NodeStream, frame: pb.NodeFrame) -> None:
        """Validate one frame completely, then record it. Exit reports wake the tally at once."""
        if stream.departed or stream.pending or stream.closed:
            return
        for event in self._frames.read(stream, frame, self.state):
            if isinstance(event, Leave):  # a node held out: it drains now, its frames no news any more
                self.streams.depart(stream.node_id)
                stream.send(pb.Directive(term=self.term, generation=self.state.generation,
                                         drain=pb.Drain(reason=event.reason)))
            self._inbox.put(event)

    async def status(self, brief: bool = False, page: status_pages.Page = status_pages.Page()) -> pb.JobStatus:
        state = self.state  # one map for the summary and the page, whatever is adopted meanwhile
        if brief or not page.summarised:
            return status_pages.job_status(state, self.address, self.term, self.live, brief, page)  # O(1), O(page)
        counts, live = await summarised(state, self.live, self._clock, self.timing.heartbeat_timeout_s)
        js = status_pages.job_status(state, self.address, self.term, self.live, brief, page,
                                     status_pages.job_summary(state, self.live, counts))
        js.health.CopyFrom(self.stats.health(live))
        return js
