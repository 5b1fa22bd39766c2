"""One job led by this replica: its state, its node streams and its tally loop.

A single asyncio task owns every change: it folds queued requests, exit reports and the
liveness failures of one tick into one decision, persists it (fenced on the term) and only
then adopts it and pushes each node its part of the new map. Frames only update liveness.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import math
import secrets
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from muster.coordinator import wire
from muster.coordinator.core.kinds import EVICTIONS, GROUP_KINDS, FailureKind
from muster.coordinator.core.liveness import Failure, Liveness, Recovery
from muster.coordinator.core.machine import (Context, Decision, Diverged, Finishing, Join, Leave, MembershipEvent,
                                             NodeLost, Regroup, Rejoin, SlotDown, SlotsUp, Stop, Tick, decide)
from muster.coordinator.core.policy import JobSpec, Limits, Timing
from muster.coordinator.core.state import JobState, Member, NodeKind, Outcome, Phase, Placement
from muster.coordinator.errors import (FailedPrecondition, Fenced, InvalidArgument, NotFound, NotLeader,
                                       PermissionDenied, PersistUnavailable)
from muster.coordinator.leadership import Leadership
from muster.coordinator.metrics import Metrics
from muster.v1 import muster_pb2 as pb

log = structlog.get_logger(__name__)

CLOSE = object()  # queued on a NodeStream to end it
# A job of this many nodes is large: its leader keeps its event loop free while it changes the job
# (it decides in a worker thread, and sends the new map's directives in slices), and its million
# live objects (state, liveness, streams) out of the cyclic GC's full collections (70-170 ms at
# 12,500 nodes, set off by a change's directives): the GC's view is frozen once the takeover grace
# is over (every node heard) and after each new generation (refcounting still frees them).
LARGE_JOB_NODES = 1_000
FAN_OUT_SLICE = 1_000  # directives sent between yields to the loop
SUMMARY_SLICE = 500  # nodes counted for a Status summary between yields to the loop (~1 ms)


class RelayedBy(Protocol):
    """What a node's stream needs of the relay carrying it (`relay.RelayLink`): its directives go
    into the relay's batch under the relay's number for the stream, and one pulse per relay."""

    def push(self, stream: int, item) -> None: ...

    def pulse(self, directive: pb.Directive) -> None: ...


@dataclass(eq=False)
class NodeStream:
    """The directive side of one node's Session stream."""

    job: str
    node_id: str
    member_id: int
    kind: NodeKind
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    departed: bool = False  # the node left: its frames are ignored until it hangs up
    pending: bool = False  # the node is being taken back (a rebuild): its frames wait for the decision
    closed: bool = False  # the node hung up, or opened a newer session: its frames in flight are ignored
    # A node taken back after etcd lost everything may have seen higher terms than this leader's
    # (etcd's revisions restarted): its frames up to that term are no sign of a newer leader.
    term_ahead: int = 0
    # A node relayed by another replica: its directives go into that relay's batch (`RelayLink`),
    # addressed by the relay's number for the stream, instead of into `queue`.
    link: RelayedBy | None = None
    stream_id: int = 0
    seq: int = 0  # NodeFrame.stream_seq of its first frame: the member's streams counted (0: not counted)
    local_ranks: tuple[int, ...] | None = None  # of its last frame read in full: what a steps_only frame reports

    def send(self, item) -> None:
        if self.link is not None:
            self.link.push(self.stream_id, item)
        else:
            self.queue.put_nowait(item)


class Pulses:
    """The pulses of one period to the direct node streams, spread over it: a slice each tally
    tick, in the order the streams had when it began. Sent all at once, 1,000 streams' pulses held
    the loop for ~40 ms, and every node frame behind them waited (a frame's p99 was that burst).
    A stream is pulsed once a period (one that attached during it, in the next: its assignment
    came on attach)."""

    def __init__(self, every_s: float, tick_s: float):
        self.every_s, self.tick_s = every_s, tick_s
        self._began = -math.inf
        self._order: list[NodeStream] = []
        self._sent = 0

    def period_over(self, now: float) -> bool:
        return now >= self._began + self.every_s

    def start(self, streams: list[NodeStream], now: float) -> None:
        self._began, self._order, self._sent = now, streams, 0

    def send_due(self, pulse: pb.Directive, now: float) -> None:
        """The streams due by `now` (one tick ahead: the first slice goes as the period begins)."""
        share = min(1.0, (now - self._began + self.tick_s) / self.every_s)
        self._send(pulse, math.ceil(len(self._order) * share))

    def send_rest(self, pulse: pb.Directive) -> None:
        """What a period left (its ticks came late): before the next one begins."""
        self._send(pulse, len(self._order))

    def _send(self, pulse: pb.Directive, upto: int) -> None:
        for stream in self._order[self._sent:upto]:
            if not stream.closed:
                stream.send(pulse)
        self._sent = max(self._sent, upto)


def secret_hash(secret: bytes) -> str:
    """What the state keeps of a session secret: its SHA-256, never the secret."""
    return hashlib.sha256(secret).hexdigest()


def _failure_event(f: Failure, kind: NodeKind) -> MembershipEvent:
    if f.kind in GROUP_KINDS:
        return Regroup(f.kind, f.reason, (f.node_id,) if f.node_id else ())
    if f.local_rank is None or kind is NodeKind.PROCESS:
        return NodeLost(f.node_id, f.kind, f.reason)
    return SlotDown(f.node_id, f.local_rank, f.kind, f.reason)


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
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        metrics: Metrics | None = None,
        retain_s: float = 7 * 86400.0,
    ):
        self.job = state.job
        self.leadership = leadership
        self.term = leadership.term
        self.address = address
        self.timing = timing
        self.tick_s = tick_s
        self.limits = limits
        self.state = state
        self._clock = clock
        self._wall = wall
        now = clock()
        self.live = Liveness(timing, now)
        self.live.generation_published(state.generation, now)
        if state.members:  # taken over: agents get a grace period to reconnect
            self.live.start_grace([m.node_id for m in state.members], now)
        for m in state.members:  # the failed pids died with the previous leader: any process is new
            self.live.awaiting(m.node_id, m.down_slots)
        self.streams: dict[str, NodeStream] = {}
        self._inbox: list[tuple[MembershipEvent, asyncio.Future | None]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.tallies = 0  # tallies done: a test waits for some before it asserts that nothing changed
        self.log = log.bind(job=self.job, term=self.term)
        self.metrics = metrics or Metrics()
        self._frames = self.metrics.frames.labels(self.job)
        self._frame_count, self._rate_at, self.frames_per_s = 0, now, 0.0  # counted per frame, reported per tally
        self._frames_reported = 0
        self._signals: list[float] = []  # first signals of failures not decided yet
        self._graced = True  # the takeover grace has not ended yet
        self._recovering: Recovery | None = None
        self._pulses = Pulses(timing.heartbeat_timeout_s / 4, tick_s)
        self.evictions = 0
        self.last_detection_s = self.last_recovery_s = 0.0
        self.retain_s = retain_s  # a finished run's record is kept this long
        self.ended = False  # the run ended and its record was written: the job is no more
        self._end_at: float | None = None  # when an ended run's record is written, whoever is left
        self._finishing_asked = False

    @property
    def lost_reason(self) -> str | None:
        return self.leadership.lost_reason

    # ---- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"leader:{self.job}")

    async def stop(self, reason: str, *, resigned: bool = False) -> None:
        """Give up the job: refuse queued requests and end every stream with a leader hint."""
        if self.leadership.lose(reason):
            if resigned:
                self.log.info("leadership_resigned", reason=reason)
            else:
                self.log.warning("leadership_lost", reason=reason)
        if self._task and self._task is not asyncio.current_task():
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        not_leader = NotLeader(self.job, "")
        for _, fut in self._inbox:
            if fut and not fut.done():
                fut.set_exception(not_leader)
        self._inbox.clear()
        for stream in self.streams.values():
            stream.send(not_leader)
        self.streams.clear()

    def _lose(self, reason: str) -> None:
        if self.leadership.lose(reason):
            self.log.warning("leadership_lost", reason=reason)

    async def _run(self) -> None:
        while self.lost_reason is None:
            try:
                await asyncio.wait_for(self._wake.wait(), self.tick_s)
            except TimeoutError:
                pass
            self._wake.clear()
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
            self._pulse(self._clock())

    def _pulse_directive(self) -> pb.Directive:
        return pb.Directive(term=self.term, generation=self.state.generation, finishing=self.state.finishing)

    def _pulse_all(self) -> None:
        """Every stream at once (the job started finishing: no rank may be restarted from now on)."""
        pulse, links = self._pulse_directive(), set()
        for stream in self.streams.values():
            if stream.link is None:
                stream.send(pulse)
            else:
                links.add(stream.link)
        for link in links:
            link.pulse(pulse)

    def _pulse(self, now: float) -> None:
        """An empty directive: a node that hears nothing for heartbeat_timeout looks for the leader.
        Relayed nodes get it from their relay, which the leader pulses once (not once per node)."""
        pulse = self._pulse_directive()
        if self._pulses.period_over(now):
            self._pulses.send_rest(pulse)
            links = set()
            direct = []
            for stream in self.streams.values():
                if stream.link is None:
                    direct.append(stream)
                else:
                    links.add(stream.link)
            for link in links:
                link.pulse(pulse)
            self._pulses.start(direct, now)
        self._pulses.send_due(pulse, now)

    # ---- the tally -------------------------------------------------------------------

    def _enqueue(self, event: MembershipEvent, want_result: bool = False) -> asyncio.Future | None:
        fut = asyncio.get_running_loop().create_future() if want_result else None
        self._inbox.append((event, fut))
        self._wake.set()
        return fut

    async def tally_once(self, *events: MembershipEvent) -> None:
        """One tally, of what came in and `events`: what the leader's task does each tick (a test or
        a benchmark drives a leader it did not start with it)."""
        self._inbox.extend((event, None) for event in events)
        await self._tally()
        self.tallies += 1

    async def _tally(self) -> None:
        now = self._clock()
        self._measure(now)
        if self._graced and not self.live.in_grace(now):
            self._graced = False
            self._freeze_gc()
        batch, self._inbox = self._inbox, []
        if any(isinstance(e, SlotsUp) for e, _ in batch) and self.live.reforming(self.state):  # O(ranks): only then
            # A slot back while the abort generation still forms waits until it has formed: its
            # planned switch would reach a node that reconnects only as the current map, without
            # the abort before it, and an abort instead would cut the forming group again.
            self._inbox = [(e, f) for e, f in batch if isinstance(e, SlotsUp)]
            batch = [(e, f) for e, f in batch if not isinstance(e, SlotsUp)]
        events = [event for event, _ in batch]
        for failure in self.live.failures(self.state, now):
            member = self.state.member(failure.node_id)
            events.append(_failure_event(failure, member.kind if member else NodeKind.AGENT))
            if failure.since is not None:
                self._signals.append(failure.since)
        diverged = self.live.divergence(self.state)
        if diverged is not None:
            self.log.warning("replicas_diverged", step=diverged.step, ranks=list(diverged.ranks))
            events.append(Diverged(diverged.nodes, diverged.reason))
        if self.state.phase is not Phase.RUNNING or self.state.ended:
            events.append(Tick())  # forming, waiting and draining deadlines
        if not events:
            return
        ctx = Context(now, int(self._wall() * 1000), self.term, self.timing, self.live.max_step(self.state),
                      self.live.median_step_time(), prestart=self.live.runs_library(self.state),
                      max_members=self.limits.max_members,
                      step_lag_s=self.timing.relay_progress_s if any(s.link for s in self.streams.values()) else 0.0)
        if len(self.state.members) >= LARGE_JOB_NODES:
            # Pure, on an immutable state, and only this task adopts: frames go on meanwhile.
            decision = await asyncio.to_thread(decide, self.state, events, ctx)
        else:
            decision = decide(self.state, events, ctx)
        if decision.persist:
            try:
                with self.metrics.etcd_write.time():
                    await self.leadership.write_state(decision.state)
            except PersistUnavailable as exc:
                self._inbox[:0] = batch  # nothing adopted: decide again next tick
                self.log.warning("state_write_deferred", error=str(exc))
                return
            except Fenced:
                self._inbox[:0] = batch
                raise
        await self._adopt(decision, now, ctx.max_step)
        self._settle(batch, decision)
        if self.state.ended:
            await self._end(now)

    async def _end(self, now: float) -> None:
        """The run ended: once its members are gone (a stopped job's drain, bounded by stop_grace_s),
        record it and remove the job (fenced), tell whoever is left, and stop leading. The replica
        then forgets the job: nothing of it is kept but the record, for its retention."""
        if self._end_at is None:
            stopped = self.state.outcome is Outcome.STOPPED
            self._end_at = now + (self.timing.stop_grace_s if stopped else 0.0)
        if self.state.members and now < self._end_at:
            return
        try:
            await self.leadership.end_run(self.state, self.retain_s)
        except PersistUnavailable as exc:
            self.log.warning("run_end_deferred", error=str(exc))
            return
        s = self.state
        self.ended = True
        end = pb.Directive(term=self.term, generation=s.generation,
                           end=pb.JobEnd(outcome=s.outcome.value, reason=s.outcome_reason, run=s.run))
        for stream in self.streams.values():
            stream.send(end)
            stream.send(CLOSE)
        self.streams.clear()
        self.metrics.runs_ended.labels(s.outcome.value).inc()
        self.log.info("run_ended", run=s.run, outcome=s.outcome.value, reason=s.outcome_reason,
                      generation=s.generation, left=[m.node_id for m in s.members])
        self.leadership.lose(f"run {s.run} ended: {s.outcome.value}")

    def _freeze_gc(self) -> None:
        if len(self.state.members) >= LARGE_JOB_NODES:
            gc.freeze()

    def _measure(self, now: float) -> None:
        """Frames/s (smoothed, and the metric's count), and the end of a recovery (`Liveness.recovered`)."""
        if self._frame_count > self._frames_reported:
            self._frames.inc(self._frame_count - self._frames_reported)
            self._frames_reported = self._frame_count
        if now - self._rate_at >= 1.0:
            rate = self._frame_count / (now - self._rate_at)
            self.frames_per_s = rate if not self.frames_per_s else 0.7 * self.frames_per_s + 0.3 * rate
            self._frame_count, self._frames_reported, self._rate_at = 0, 0, now
        if self._recovering is None:
            return
        over, took = self.live.recovered(self.state, self._recovering, now)
        if took is not None:
            self.last_recovery_s = took
            self.metrics.recovery.labels(self.job).observe(took)
        if over:
            self._recovering = None

    def live_ranks(self, placements: Sequence[Placement] | None = None) -> int:
        """Ranks of the map (or of `placements`) on nodes heard from within the heartbeat timeout."""
        rm, now = self.state.rank_map, self._clock()
        if placements is None:
            placements = rm.placements if rm else ()
        return sum(len(p.slots) for p in placements if (node := self.live.nodes.get(p.node_id))
                   and now - node.last_frame_at <= self.timing.heartbeat_timeout_s)

    async def _adopt(self, d: Decision, now: float, step_before: int) -> None:
        started_finishing = d.state.finishing and not self.state.finishing
        self.state = d.state
        if started_finishing:
            self._pulse_all()
        for e in d.events:
            self.log.info("membership_changed", kind=e.kind, generation=e.generation, reason=e.reason,
                          nodes=list(e.nodes), world_size=e.world_size)
            if e.kind in EVICTIONS:
                self.evictions += 1
                self.metrics.evictions.labels(self.job, e.kind).inc()
        if d.new_generation:
            self.metrics.generations.labels(self.job).inc()
            if self._signals:
                self.last_detection_s = now - min(self._signals)
                self.metrics.detection.labels(self.job).observe(self.last_detection_s)
            if self.state.rank_map is not None and self.state.rank_map.world_size:
                self._recovering = Recovery(self.state.generation, now, step_before)
        if d.persist:
            self._signals.clear()
        for member in d.joined:
            self.live.track(member.node_id, now)
            self.live.awaiting(member.node_id, member.down_slots)
        for node_id, member_id in d.evicted:
            self.live.forget(node_id)
            stream = self.streams.get(node_id)
            if stream and stream.member_id == member_id:
                del self.streams[node_id]
                stream.send(wire.evicted_directive(self.state, "evicted: " + self._reason_for(node_id)))
                stream.send(CLOSE)
        if d.new_generation:
            self.live.generation_published(self.state.generation, now)
            assignments = wire.Assignments(self.state, d.events[-1].reason if d.events else "")
            large = len(self.state.members) >= LARGE_JOB_NODES
            # A stream that attaches during a yield has the new map already (`_bind`): a second copy is harmless.
            for i, (node_id, stream) in enumerate(list(self.streams.items())):
                if not stream.departed:
                    stream.send(assignments.directive(node_id))
                if large and i % FAN_OUT_SLICE == FAN_OUT_SLICE - 1:
                    await asyncio.sleep(0)
            self._freeze_gc()
        stopped = d.ended and self.state.outcome is Outcome.STOPPED
        for node_id, after_step in d.drains:
            stream = self.streams.get(node_id)
            if stream:
                stream.send(pb.Directive(term=self.term, generation=self.state.generation, drain=pb.Drain(
                    after_step=after_step, reason=self.state.outcome_reason if stopped else "graceful leave",
                    stop=stopped)))

    def _reason_for(self, node_id: str) -> str:
        for e in reversed(self.state.history):
            if node_id in e.nodes and e.kind != "generation":
                return f"{e.kind}: {e.reason}"
        return "no longer a member"

    def _settle(self, batch, d: Decision) -> None:
        rejected = dict(d.rejected)
        for index, (event, fut) in enumerate(batch):
            if fut is None or fut.done():
                continue
            if index in rejected:
                fut.set_exception(rejected[index])
            elif isinstance(event, (Join, Rejoin)):
                fut.set_result(self.state.member(event.node_id))
            elif isinstance(event, Leave):
                rm = self.state.rank_map
                fut.set_result((self.state.generation, rm.switch_at_step if rm and not event.immediate else 0))
            elif isinstance(event, Stop):
                fut.set_result(max((step for node, step in d.drains), default=0))

    # ---- requests --------------------------------------------------------------------

    async def join(self, req: pb.JoinRequest, requested: JobSpec) -> pb.JoinResponse:
        spec = self.state.spec
        for name in ("min_nodes", "max_nodes", "world_size_multiple"):
            want = getattr(requested, name)
            if want and want != getattr(spec, name) and not self.state.spec_lost:
                raise FailedPrecondition(
                    f"job {self.job!r} exists with {name}={getattr(spec, name)}; this node asks for {want}"
                )
        # The member's proof from now on: made here at the edge (the core stays deterministic),
        # kept by the state only as a hash, never logged.
        secret = secrets.token_bytes(32)
        kind = wire.node_kind(req.is_process)
        fut = self._enqueue(Join(req.node_id, req.host, req.store_port, req.slots, kind, req.master_port,
                                 secret_hash(secret), requested), want_result=True)
        member = await fut
        return pb.JoinResponse(
            job=self.job,
            node_id=member.node_id,
            member_id=member.member_id,
            term=self.term,
            generation=self.state.generation,
            heartbeat_interval_ms=int(self.timing.heartbeat_interval_s * 1000),
            heartbeat_timeout_ms=int(self.timing.heartbeat_timeout_s * 1000),
            session_secret=secret,
            run=self.state.run,
        )

    async def leave(self, req: pb.LeaveRequest) -> pb.LeaveResponse:
        self._authenticate(self._member(req.node_id, req.member_id), req.session_secret)
        stream = self.streams.get(req.node_id)
        if stream:  # from now on its frames are ignored: it is no member once the leave is applied
            stream.departed = True
        fut = self._enqueue(Leave(req.node_id, req.immediate, req.reason or "requested", req.finished),
                            want_result=True)
        generation, switch_at = await fut
        return pb.LeaveResponse(generation=generation, switch_at_step=switch_at)

    async def stop_job(self, reason: str) -> pb.StopResponse:
        """An operator's stop: the run ends `stopped` now, every node drains at one step."""
        after_step = await self._enqueue(Stop(reason), want_result=True)
        return pb.StopResponse(run=self.state.run, after_step=after_step)

    async def drain_node(self, node_id: str, reason: str) -> pb.DrainResponse:
        """An operator's drain of one node: it leaves at a step boundary, as on SIGTERM to its agent."""
        wire.check_node(node_id)
        if self.state.member(node_id) is None:
            raise NotFound(f"node {node_id!r} is not a member of job {self.job!r}")
        placed = self.state.rank_map is not None and self.state.rank_map.placement(node_id) is not None
        stream = self.streams.get(node_id)
        if stream:
            stream.departed = True
        generation, switch_at = await self._enqueue(Leave(node_id, False, reason), want_result=True)
        if stream and not placed:  # a spare or a waiting node: the decision sent it no drain
            stream.send(pb.Directive(term=self.term, generation=generation, drain=pb.Drain(reason=reason)))
        return pb.DrainResponse(generation=generation, after_step=switch_at if placed else 0)

    def _member(self, node_id: str, member_id: int):
        member = self.state.member(node_id)
        if member is None:
            raise NotFound(f"node {node_id!r} is not a member of job {self.job!r}: join first")
        if member.member_id != member_id:
            raise FailedPrecondition(
                f"member {member_id} of node {node_id!r} is stale (current member {member.member_id}); "
                "it was evicted or replaced: rejoin"
            )
        return member

    # ---- node streams ----------------------------------------------------------------

    def _authenticate(self, member: Member, secret: bytes) -> None:
        """Only the node that joined as this member holds its secret: a stranger who guessed the
        member_id may not replace its stream or make it leave."""
        if not member.admits(secret_hash(secret)):
            raise PermissionDenied(f"node {member.node_id!r} did not present the session secret of member "
                                   f"{member.member_id}; only the node that joined as it may use it")

    def attach(self, first: pb.NodeFrame, *, link=None, stream_id: int = 0) -> NodeStream:
        """Bind a Session stream to its node; the node gets its current assignment at once. While
        a lost state is rebuilt, a node that is no member but says who it was is taken back.
        A relayed stream (`link`, `stream_id`) is authenticated the same way, by its first frame."""
        wire.check_node(first.node_id)
        wire.check_rejoin(first)
        if first.run and first.run != self.state.run:
            raise FailedPrecondition(f"run {first.run} of job {self.job!r} has ended; the job's name runs run "
                                     f"{self.state.run} now")
        if self.state.rebuilding and first.HasField("rejoin") and self.state.member(first.node_id) is None:
            return self._take_back(first, link, stream_id)
        member = self._member(first.node_id, first.member_id)
        self._authenticate(member, first.session_secret)
        current = self.streams.get(member.node_id)
        if (current is not None and current.member_id == member.member_id and first.stream_seq
                and current.seq > first.stream_seq):
            # A first frame a relay still held from before the node moved on: the newer stream stays.
            raise FailedPrecondition(f"stream {first.stream_seq} of node {member.node_id!r} is stale: "
                                     f"its stream {current.seq} is newer")
        stream = NodeStream(self.job, member.node_id, member.member_id, member.kind,
                            term_ahead=first.term if self.state.rebuilding else 0, link=link, stream_id=stream_id,
                            seq=first.stream_seq)
        self.on_frame(stream, first)
        self._bind(stream)
        self.log.info("node_attached", node=member.node_id, member=member.member_id, generation=first.generation)
        return stream

    def _take_back(self, first: pb.NodeFrame, link, stream_id: int) -> NodeStream:
        """The core decides (Rejoin); until then the stream is bound to nothing and its frames wait."""
        r = first.rejoin
        stream = NodeStream(self.job, first.node_id, first.member_id, wire.node_kind(r.is_process), pending=True,
                            term_ahead=first.term, link=link, stream_id=stream_id, seq=first.stream_seq)
        fut = self._enqueue(Rejoin(first.node_id, first.member_id, first.generation, secret_hash(first.session_secret),
                                   r.host, r.store_port, r.slots, stream.kind, r.master_port, wire.spec_of(r.spec)),
                            want_result=True)
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
            self._bind(stream)
            self.log.info("node_taken_back", node=stream.node_id, member=stream.member_id, generation=generation)

    def _bind(self, stream: NodeStream) -> None:
        previous = self.streams.get(stream.node_id)
        if previous is not None:
            # Its frames still in flight are no news: one would put a node its relay vouches for
            # back under this leader's silence watch, where no frame of a waiting node comes.
            previous.closed = True
            previous.send(FailedPrecondition(f"node {stream.node_id!r} opened a newer session"))
        self.streams[stream.node_id] = stream
        if self.state.rebuilt_members:
            # The nodes run on in their old groups until the rebuild ends: no assignment (a
            # generation nobody published), only this leader's term.
            stream.send(pb.Directive(term=self.term, generation=self.state.generation))
        else:
            stream.send(wire.assignment_for(self.state, stream.node_id, "current assignment"))

    def silent_at_relay(self, stream: NodeStream, silent_ms: int) -> None:
        """The relay carrying `stream` has heard nothing from its node for `silent_ms`."""
        if self.streams.get(stream.node_id) is stream:
            self.live.silent_since(stream.node_id, self._clock() - silent_ms / 1000)

    def detach(self, stream: NodeStream, *, relay_lost: bool = False) -> None:
        """The node's stream ended. One whose relay's stream ended (`relay_lost`) is no sign that
        the node is gone, even for a process node: its silence past the heartbeat timeout from now
        (time to reconnect elsewhere) decides."""
        stream.closed = True
        if self.streams.get(stream.node_id) is not stream:
            return  # replaced or evicted already
        del self.streams[stream.node_id]
        if stream.link is not None:  # no relay judges its silence now: here, from now on
            self.live.unvouched(stream.node_id, self._clock())
        if stream.kind is NodeKind.PROCESS and not stream.departed and self.lost_reason is None and not relay_lost:
            self._enqueue(NodeLost(stream.node_id, FailureKind.PROCESS_EXITED, "its session closed without leaving"))

    def on_frame(self, stream: NodeStream, frame: pb.NodeFrame) -> None:
        """Validate one frame completely, then record it. Exit reports wake the tally at once."""
        if stream.departed or stream.pending or stream.closed:
            return
        if frame.job != stream.job or frame.node_id != stream.node_id or frame.member_id != stream.member_id:
            raise InvalidArgument("every frame of a session must carry the job, node_id and member_id of its first")
        member = self._member(frame.node_id, frame.member_id)
        # The hot path: a frame that only advances steps is read for three fields a rank.
        fast = (frame.steps_only and not frame.exits and stream.local_ranks is not None
                and len(frame.ranks) == len(stream.local_ranks))
        steps = wire.frame_steps(frame) if fast else None
        reports = None if fast else wire.check_frame_ranks(frame, member)
        if frame.term > max(self.term, stream.term_ahead):
            # Not trusted blindly (a bad client could depose the leader): were this leader stale,
            # its session and fenced writes would tell it.
            raise FailedPrecondition(f"frame term {frame.term} is ahead of this leader's term {self.term}")
        if frame.generation > self.state.generation:
            raise FailedPrecondition(
                f"frame generation {frame.generation} is ahead of the job's generation {self.state.generation}"
            )
        now = self._clock()
        self._frame_count += 1
        vouched = stream.link is not None
        if fast:
            if self.live.advance(member.node_id, frame.generation, stream.local_ranks, steps, now, vouched=vouched):
                return
            reports = wire.check_frame_ranks(frame, member)  # not the ranks it had: read it all
        if frame.exits:
            self._signals.append(now)
        if not self._finishing_asked and not self.state.frozen:
            done = next((r for r in reports if r.state == "finished"), None)
            if done is not None:
                self._finishing_asked = True
                self._enqueue(Finishing(member.node_id, f"local rank {done.local_rank} (pid {done.pid}) of node "
                                                        f"{member.node_id!r} completed its script: the job is ending"))
        recovered = self.live.observe(member.node_id, frame.generation, reports, now, vouched=vouched)
        stream.local_ranks = tuple(r.local_rank for r in reports)
        if frame.exits:
            self._exits(member, frame)
        if recovered:
            self._enqueue(SlotsUp(member.node_id, tuple(recovered)))

    def _exits(self, member: Member, frame: pb.NodeFrame) -> None:
        rm = self.state.rank_map
        placement = rm.placement(member.node_id) if rm else None
        for e in frame.exits:
            how = f"killed by signal {-e.exit_code}" if e.exit_code < 0 else f"exit code {e.exit_code}"
            if member.kind is NodeKind.PROCESS:
                self._enqueue(NodeLost(member.node_id, FailureKind.PROCESS_EXITED, f"pid {e.pid} {how}"))
            elif e.restarting and placement is not None and e.local_rank in placement.slots:
                # Restart semantics (a script without the library): the job re-forms once, with the
                # replacement in the same place. A node still on an older generation is restarted by
                # the newer map already: its rank's exit is no new fault.
                if frame.generation == self.state.generation:
                    self._enqueue(Regroup(FailureKind.RANK_RESTARTED, f"local rank {e.local_rank}: pid {e.pid} {how}; "
                                          "its agent restarts it in place", (member.node_id,)))
            else:
                self.live.mark_failed(member.node_id, e.local_rank, e.pid)
                self._enqueue(SlotDown(member.node_id, e.local_rank, FailureKind.RANK_EXITED, f"pid {e.pid} {how}"))

    async def status(self, brief: bool = False, page: wire.Page = wire.Page()) -> pb.JobStatus:
        state = self.state  # one map for the summary and the page, whatever is adopted meanwhile
        if brief or not page.summarised:
            return wire.job_status(state, self.address, self.term, self.live, brief, page)  # O(1), O(page)
        rm, counts, live_ranks = state.rank_map, Counter(), 0
        placements = rm.placements if rm else ()
        for start in range(0, len(placements), SUMMARY_SLICE):
            # A 100k-rank count is ~15-25 ms: the tally and the frames go between slices.
            await asyncio.sleep(0)
            part = placements[start:start + SUMMARY_SLICE]
            counts.update(wire.rank_states(part, self.live))
            live_ranks += self.live_ranks(part)
        await asyncio.sleep(0)
        js = wire.job_status(state, self.address, self.term, self.live, brief, page,
                             wire.job_summary(state, self.live, counts))
        js.health.CopyFrom(pb.JobHealth(frames_per_second=round(self.frames_per_s, 1), live_ranks=live_ranks,
                                        evictions=self.evictions, last_detection_s=round(self.last_detection_s, 4),
                                        last_recovery_s=round(self.last_recovery_s, 4)))
        return js
