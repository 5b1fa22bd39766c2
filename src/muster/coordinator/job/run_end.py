"""The end of a run, as its leader carries it out: once the members are gone (a stopped job's drain,
bounded by stop_grace_s), the run's record is written and the job removed, fenced on the term; then
whoever is left is told how it ended, and the leadership ends. The replica then forgets the job."""

from __future__ import annotations

from muster.coordinator.core.state import JobState, Outcome
from muster.coordinator.errors import PersistUnavailable
from muster.coordinator.job.leadership import Leadership
from muster.coordinator.metrics import Metrics
from muster.coordinator.job.streams import CLOSE, Streams
from muster.v1 import muster_pb2 as pb


class RunEnd:
    def __init__(self, leadership: Leadership, stop_grace_s: float, retain_s: float, kept: int, metrics: Metrics,
                 log):
        self.leadership = leadership
        self.stop_grace_s = stop_grace_s
        self.retain_s, self.kept = retain_s, kept  # the record is kept this long, the job's newest `kept` of them
        self.metrics = metrics
        self.log = log
        self._at: float | None = None  # when the record is written, whoever is left

    async def carried_out(self, state: JobState, now: float, streams: Streams) -> bool:
        """Whether the ended run's record is written (by this call, or not yet: a later tick tries again)."""
        if self._at is None:
            stopped = state.outcome is Outcome.STOPPED
            self._at = now + (self.stop_grace_s if stopped else 0.0)
        if state.members and now < self._at:
            return False
        try:
            await self.leadership.end_run(state, self.retain_s, self.kept)
        except PersistUnavailable as exc:
            self.log.warning("run_end_deferred", error=str(exc))
            return False
        streams.end_all(pb.Directive(term=self.leadership.term, generation=state.generation, end=pb.JobEnd(
            outcome=state.outcome.value, reason=state.outcome_reason, run=state.run)), CLOSE)
        self.metrics.runs_ended.labels(state.outcome.value).inc()
        self.log.info("run_ended", run=state.run, outcome=state.outcome.value, reason=state.outcome_reason,
                      generation=state.generation, left=[m.node_id for m in state.members])
        self.leadership.lose(f"run {state.run} ended: {state.outcome.value}")
        return True
