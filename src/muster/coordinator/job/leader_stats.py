"""What a job's leader measures of it, for Status (`JobHealth`) and the metrics: frames per second,
evictions, detection (a failure's first signal to the generation that handled it) and recovery (that
generation to the step the job had reached before it, with the timeline of its phases), and the job
over time (a ring of samples). Counted as the leader works; never decides."""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from muster.coordinator.job import status_pages
from muster.coordinator.core.assessment import Assessment
from muster.coordinator.core.kinds import EVICTIONS
from muster.coordinator.core.liveness import Liveness, Recovery
from muster.coordinator.core.machine import STATE_LOST_EVENT, Decision
from muster.coordinator.core.state import JobState, Placement
from muster.coordinator.metrics import Metrics
from muster.v1 import muster_pb2 as pb

SUMMARY_SLICE = 500  # nodes counted for a Status summary between yields to the loop (~1 ms)
RECENT_RECOVERIES = 10  # kept for Status (the live page's list); the metric keeps the distribution
TIERS = ("", "replica", "snapshot", "checkpoint", "none")  # RecoveryRecord.tier, shallowest first
DECIDED_KEPT = 64  # generations whose job step at decision is kept: a rank's word that its state began from
                   # nothing in one of them is judged against it (a lone restarted rank's comes generations late)
HISTORY_SAMPLES = 240  # the job over time (JobHealth.history): full, every other goes and the spacing doubles,
FIRST_SAMPLE_S = 1.0   # so the whole life fits at any age


class LeaderStats:
    """One job's figures, kept by its leader's task (frames are counted as they come, reported per tally)."""

    def __init__(self, job: str, metrics: Metrics, now: float):
        self.job = job
        self.metrics = metrics
        metrics.started(job, EVICTIONS)
        self._frames = metrics.frames.labels(job)
        self._frame_count, self._rate_at, self.frames_per_s = 0, now, 0.0  # counted per frame, reported per tally
        self._frames_reported = 0
        self._signals: list[float] = []  # first signals of failures not decided yet
        self.recovering: Recovery | None = None  # the latest generation's, until its recovery is over
        self.evictions = 0
        self.last_detection_s = self.last_recovery_s = 0.0
        self._measuring: _Measured | None = None  # the recovery under way
        self._superseded: _Measured | None = None  # the one it superseded, whose ranks' phases may still come
        self.recoveries: deque[pb.RecoveryRecord] = deque(maxlen=RECENT_RECOVERIES)
        self.high_step = 0  # the highest step the job's ranks reported to this leader (steps lost count from it)
        self._high_at: dict[int, int] = {}  # generation -> the job's highest step when it was decided (DECIDED_KEPT)
        self._judged = 0  # the newest generation a rank said its state began from nothing in, judged (said once)
        self._begun_again = False  # the state was lost and the job allows a restart: the next generation's is "none"
        self._said_lost = False  # `reported` found it (its generation is marked "none" already) and the verdict is due
        self.restarts = 0  # rank processes that exited
        self.last_exit = ""  # the last one heard, in words: a state-lost verdict names what lost the state
        self.history: list[pb.HealthSample] = []
        self._sample_every, self._sampled_at = FIRST_SAMPLE_S, None

    def framed(self) -> None:
        self._frame_count += 1

    def stepped(self, step: int) -> None:
        """A node's frame said its ranks reached `step`. Kept from every frame, not only at decisions:
        a job that loses every rank between two decisions is reported at the next one by its
        restarted ranks at step 0, and the step it had reached (what a state lost then cost) would be
        unknown."""
        if step > self.high_step:
            self.high_step = step

    def signalled(self, at: float) -> None:
        """A failure's first sign (an exit reported, or the silence a failure was judged on)."""
        self._signals.append(at)

    def reported(self, node_id: str, frame: pb.NodeFrame, now: float) -> int:
        """A frame read in full (one that only advances steps carries nothing new here): its exits, for
        the recovery under way its node running the new map and its ranks' reform phases, and its
        ranks' word of the generation their state began from nothing in. Returns the step the job had
        reached where that word is the first that the ranks began again at step 0 with nothing
        restored after the job had trained (no tier held the state: every rank lost, and no
        checkpoint), else 0."""
        self.restarts += len(frame.exits)
        lost = 0
        for r in frame.ranks:
            if (begun := r.reform.begun_at) > self._judged:
                self._judged = begun
                if high := self._high_at.get(begun, 0):  # (unknown: decided by another leader, or long ago)
                    lost = max(lost, high)
                    self._said_lost = self._lost_in(begun, high)
        if lost:
            self.high_step = 0  # (the job trains on from step 0: a later reform there is no loss)
            self._judged = max(self._judged, *self._high_at)  # (every state begun from nothing by now is this loss's)
        m = self._measuring
        if m is None and self._superseded is None:
            return lost
        under_way = m is not None and self.recovering is not None and m.record.generation == self.recovering.generation
        if under_way and frame.generation >= m.record.generation and node_id in m.undelivered:
            m.undelivered.discard(node_id)
            if not m.undelivered:
                m.record.delivered_s = round(now - self.recovering.decided_at, 4)
        for x in (m, self._superseded):
            if x is not None and any([x.fold(node_id, r) for r in frame.ranks]) and x.record.slowest:
                # Over already: a rank's phases can come after the others' first steps ended the recovery
                # (a replacement's agent reports it with its next frame), or after the next map superseded it
                timeline(x.record, x.record.recovery_s, x.bytes_moved)
        return lost

    def _lost_in(self, generation: int, high: int) -> bool:
        """Marks the recovery of `generation` (whose ranks began from nothing after the job reached
        `high`) as tier none, every step lost; where it is no longer kept, the one under way. Whether
        one was marked (else the state-lost event marks the next generation's)."""
        kept = [x.record for x in (self._measuring, self._superseded) if x is not None]
        record = next((r for r in (*kept, *self.recoveries) if r.generation == generation), kept[0] if kept else None)
        if record is None:
            return False
        record.tier, record.step, record.steps_lost = "none", 0, high
        return True

    def measure(self, now: float, seen: Assessment) -> None:
        """Frames/s (smoothed, and the metric's count), the first signals of the failures found, the
        end of the recovery under way (`Assessment.recovered`, asked of liveness for `recovering`),
        and a sample of the job when one is due."""
        self._sample(now, seen)
        if self._frame_count > self._frames_reported:
            self._frames.inc(self._frame_count - self._frames_reported)
            self._frames_reported = self._frame_count
        if now - self._rate_at >= 1.0:
            rate = self._frame_count / (now - self._rate_at)
            self.frames_per_s = rate if not self.frames_per_s else 0.7 * self.frames_per_s + 0.3 * rate
            self._frame_count, self._frames_reported, self._rate_at = 0, 0, now
        if seen.failures:
            self._signals.extend(f.since for f in seen.failures if f.since is not None)
        if self.recovering is None or seen.recovered is None:
            return
        over, took = seen.recovered
        if took is not None:
            self.last_recovery_s = took
            self.metrics.recovery.labels(self.job).observe(took)
            if self._measuring is not None and self._measuring.record.generation == self.recovering.generation:
                self.recoveries.append(timeline(self._measuring.record, took, self._measuring.bytes_moved))
        if over:
            self.recovering = None

    def _sample(self, now: float, seen: Assessment) -> None:
        if self._sampled_at is not None and now - self._sampled_at < self._sample_every:
            return
        self._sampled_at = now
        rm = seen.state.rank_map
        world = rm.world_size if rm else 0
        step_time = seen.median_step_time if world else None  # (sorts 256 floats, once a sample)
        self.history.append(pb.HealthSample(unix_ms=int(time.time() * 1000), world_size=world, restarts=self.restarts,
                                            steps_per_second=round(1 / step_time, 2) if step_time else 0.0))
        if len(self.history) > HISTORY_SAMPLES:
            del self.history[1::2]  # (the newest kept)
            self._sample_every *= 2

    def adopted(self, d: Decision, now: float, step_before: int) -> None:
        """A decision the leader adopted: its evictions, and a new generation's detection time; the
        recovery it starts is measured from here."""
        self.high_step = max(self.high_step, step_before)
        # (a generation whose ranks this leader saw begin again from nothing is marked so already)
        lost = any(e.kind == STATE_LOST_EVENT for e in d.events)
        self._begun_again |= lost and not self._said_lost
        self._said_lost = self._said_lost and not lost
        for e in d.events:
            if e.kind in EVICTIONS:
                self.evictions += 1
                self.metrics.evictions.labels(self.job, e.kind).inc()
        if d.new_generation:
            self._supersede(d.state.generation, now)
            self._high_at[d.state.generation] = self.high_step
            if len(self._high_at) > DECIDED_KEPT:
                del self._high_at[next(iter(self._high_at))]
            self.metrics.generations.labels(self.job).inc()
            detection = now - min(self._signals) if self._signals else 0.0
            if self._signals:
                self.last_detection_s = detection
                self.metrics.detection.labels(self.job).observe(detection)
            if d.state.rank_map is not None and d.state.rank_map.world_size:
                self.recovering = Recovery(d.state.generation, now, step_before)
                record = pb.RecoveryRecord(generation=d.state.generation, detection_s=round(detection, 4),
                                           decided_unix_ms=int(time.time() * 1000), planned=not self._signals)
                self._measuring = _Measured(record, {p.node_id for p in d.state.rank_map.placements}, self.high_step)
                if self._begun_again:  # (the ranks, begun at step 0, report nothing restored)
                    self._begun_again = False
                    record.tier, record.steps_lost = "none", self.high_step
                    # (their word that it began from nothing here is this verdict's, not a second loss)
                    self.high_step = self._high_at[d.state.generation] = 0
        if d.persist:
            self._signals.clear()

    def _supersede(self, generation: int, now: float) -> None:
        """A new generation decided while the last one's recovery was under way: that one is kept as
        it stands, superseded (an operator sees each failure's recovery, even one a quick rejoin cut
        short), and its ranks' phases are still folded in as they come."""
        m, self._measuring, self._superseded = self._measuring, None, None
        if m is None or self.recovering is None or m.record.generation != self.recovering.generation:
            return
        m.record.superseded_by = generation
        self.recoveries.append(timeline(m.record, now - self.recovering.decided_at, m.bytes_moved))
        self._superseded, self.recovering = m, None

    def health(self, live_ranks: int) -> pb.JobHealth:
        return pb.JobHealth(frames_per_second=round(self.frames_per_s, 1), live_ranks=live_ranks,
                            evictions=self.evictions, last_detection_s=round(self.last_detection_s, 4),
                            last_recovery_s=round(self.last_recovery_s, 4), recent_recoveries=self.recoveries,
                            history=self.history)


@dataclass
class _Measured:
    """A generation's recovery as measured so far: its record, and what folding its ranks' words in needs."""

    record: pb.RecoveryRecord
    undelivered: set[str]  # nodes of its map that have not reported running it
    high_at_decision: int  # the job's highest step when it was decided (steps lost count from it)
    received: dict[tuple[str, int], int] = field(default_factory=dict)  # state bytes per rank (frames repeat them)
    ranks_lost: int = 0  # the most steps one of its ranks said it lost

    @property
    def bytes_moved(self) -> int:
        return sum(self.received.values())

    def fold(self, node_id: str, r: pb.RankReport) -> bool:
        """A rank's reform phases, if they are of this generation: the slowest rank's make the timeline."""
        m, p = self.record, r.reform
        if p.generation != m.generation:
            return False
        m.abort_s, m.form_s = max(m.abort_s, round(p.abort_s, 4)), max(m.form_s, round(p.form_s, 4))
        m.sync_s, m.transfer_s = max(m.sync_s, round(p.sync_s, 4)), max(m.transfer_s, round(p.transfer_s, 4))
        self.received[(node_id, r.local_rank)] = p.bytes_received
        self._restored(p)
        return True

    def _restored(self, p: pb.ReformPhases) -> None:
        """A rank's word on where the state came from: the deepest tier any rank's came from, the step
        training goes on from (the same on every rank that trains), and the steps lost: the most any
        rank lost, or the job's highest step before the decision past that step (every rank lost: the
        new ones lost none of their own)."""
        m = self.record
        if m.tier == "none":  # (begun from nothing: LeaderStats._lost_in; the job trains on from step 0)
            return
        tier = p.tier if p.tier in TIERS else ""  # (a newer rank's word this leader does not know: not shown)
        if not tier:
            return
        if TIERS.index(tier) > TIERS.index(m.tier):
            m.tier = tier
        m.step = max(m.step, p.step)
        self.ranks_lost = max(self.ranks_lost, p.steps_lost)
        m.steps_lost = max(self.ranks_lost, self.high_at_decision - m.step if self.high_at_decision > m.step else 0)


def timeline(m: pb.RecoveryRecord, took: float, received: int) -> pb.RecoveryRecord:
    """`m` over after `took`: the first step is what the phases before it leave (the ranks' phases are
    durations on their own clocks, one after another from the map's arrival), and the slowest named.
    A superseded one ended at the next decision, before any first step: none is counted."""
    m.recovery_s, m.bytes_moved = round(took, 4), received
    rest = took - m.delivered_s - m.abort_s - m.form_s - m.sync_s
    m.first_step_s = 0.0 if m.superseded_by else round(max(0.0, rest), 4)
    phases = {"detected": m.detection_s, "delivered": m.delivered_s, "aborted": m.abort_s, "formed": m.form_s,
              "moved": m.sync_s, "first_step": m.first_step_s}
    m.slowest = max(phases, key=phases.get)
    return m


def live_ranks(placements: Sequence[Placement], live: Liveness, now: float, timeout_s: float) -> int:
    """Ranks of `placements` on nodes heard from within `timeout_s`."""
    return sum(len(p.slots) for p in placements if (node := live.nodes.get(p.node_id))
               and now - node.last_frame_at <= timeout_s)


async def summarised(state: JobState, live: Liveness, clock: Callable[[], float],
                     timeout_s: float) -> tuple[Counter[str], int]:
    """The map's ranks by state, and how many are live, counted in slices: a 100k-rank count is
    ~15-25 ms, and the tally and the frames go between slices."""
    rm, counts, live_count = state.rank_map, Counter(), 0
    placements = rm.placements if rm else ()
    for start in range(0, len(placements), SUMMARY_SLICE):
        await asyncio.sleep(0)
        part = placements[start:start + SUMMARY_SLICE]
        counts.update(status_pages.rank_states(part, live))
        live_count += live_ranks(part, live, clock(), timeout_s)
    await asyncio.sleep(0)
    return counts, live_count
