"""What a job's leader measures of it, for Status (`JobHealth`) and the metrics: frames per second,
evictions, detection (a failure's first signal to the generation that handled it) and recovery (that
generation to the step the job had reached before it). Counted as the leader works; never decides."""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence

from muster.coordinator import status_pages
from muster.coordinator.core.assessment import Assessment
from muster.coordinator.core.kinds import EVICTIONS
from muster.coordinator.core.liveness import Liveness, Recovery
from muster.coordinator.core.machine import Decision
from muster.coordinator.core.state import JobState, Placement
from muster.coordinator.metrics import Metrics
from muster.v1 import muster_pb2 as pb

SUMMARY_SLICE = 500  # nodes counted for a Status summary between yields to the loop (~1 ms)
RECENT_RECOVERIES = 10  # kept for Status (the live page's list); the metric keeps the distribution


class LeaderStats:
    """One job's figures, kept by its leader's task (frames are counted as they come, reported per tally)."""

    def __init__(self, job: str, metrics: Metrics, now: float):
        self.job = job
        self.metrics = metrics
        self._frames = metrics.frames.labels(job)
        self._frame_count, self._rate_at, self.frames_per_s = 0, now, 0.0  # counted per frame, reported per tally
        self._frames_reported = 0
        self._signals: list[float] = []  # first signals of failures not decided yet
        self.recovering: Recovery | None = None  # the latest generation's, until its recovery is over
        self.evictions = 0
        self.last_detection_s = self.last_recovery_s = 0.0
        self._measuring: pb.RecoveryRecord | None = None  # the recovery under way, as Status will show it
        self.recoveries: deque[pb.RecoveryRecord] = deque(maxlen=RECENT_RECOVERIES)

    def framed(self) -> None:
        self._frame_count += 1

    def signalled(self, at: float) -> None:
        """A failure's first sign (an exit reported, or the silence a failure was judged on)."""
        self._signals.append(at)

    def measure(self, now: float, seen: Assessment) -> None:
        """Frames/s (smoothed, and the metric's count), the first signals of the failures found, and
        the end of the recovery under way (`Assessment.recovered`, asked of liveness for `recovering`)."""
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
            if self._measuring is not None and self._measuring.generation == self.recovering.generation:
                self._measuring.recovery_s = round(took, 4)
                self.recoveries.append(self._measuring)
        if over:
            self.recovering = None

    def adopted(self, d: Decision, now: float, step_before: int) -> None:
        """A decision the leader adopted: its evictions, and a new generation's detection time; the
        recovery it starts is measured from here."""
        for e in d.events:
            if e.kind in EVICTIONS:
                self.evictions += 1
                self.metrics.evictions.labels(self.job, e.kind).inc()
        if d.new_generation:
            self.metrics.generations.labels(self.job).inc()
            detection = now - min(self._signals) if self._signals else 0.0
            if self._signals:
                self.last_detection_s = detection
                self.metrics.detection.labels(self.job).observe(detection)
            if d.state.rank_map is not None and d.state.rank_map.world_size:
                self.recovering = Recovery(d.state.generation, now, step_before)
                self._measuring = pb.RecoveryRecord(generation=d.state.generation, detection_s=round(detection, 4),
                                                    decided_unix_ms=int(time.time() * 1000), planned=not self._signals)
        if d.persist:
            self._signals.clear()

    def health(self, live_ranks: int) -> pb.JobHealth:
        return pb.JobHealth(frames_per_second=round(self.frames_per_s, 1), live_ranks=live_ranks,
                            evictions=self.evictions, last_detection_s=round(self.last_detection_s, 4),
                            last_recovery_s=round(self.last_recovery_s, 4), recent_recoveries=self.recoveries)


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
