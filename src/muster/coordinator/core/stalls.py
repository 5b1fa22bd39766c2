"""The stall judge: when a node's ranks may next fail (a deadline heap), the progress timeout
calibrated from observed step times, and the judgement of one node's ranks at a deadline.

A frame only updates a rank's fields; its deadline is found again when the node is judged, so a
tally looks only at the nodes due, not at every rank.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Iterator

from muster.coordinator.core.kinds import FailureKind
from muster.coordinator.core.live_records import NO_PROGRESS, Failure, NodeLive
from muster.coordinator.core.policy import Timing
from muster.coordinator.core.state import Member, NodeKind, RankMap

MIN_CALIBRATION_SAMPLES = 8
POPPED_PER_TALLY = 1024  # heap entries one tally takes at most, superseded ones included


class Deadlines:
    """When each node's ranks may next fail: a heap with one live entry a node (`_armed`); an
    entry superseded by a sooner one is skipped when it comes up."""

    def __init__(self) -> None:
        self._due: list[tuple[float, str]] = []  # (when a node's ranks may next fail, node)
        self._armed: dict[str, float] = {}  # node -> its one live entry in _due

    def arm(self, node_id: str, at: float) -> None:
        """Judge the ranks of `node_id` at `at`, unless they are due sooner already."""
        if at < self._armed.get(node_id, math.inf):
            self._armed[node_id] = at
            heapq.heappush(self._due, (at, node_id))

    def disarm(self, node_id: str) -> None:
        self._armed.pop(node_id, None)

    def due(self, now: float) -> Iterator[str]:
        """The nodes due by `now`, soonest first, each disarmed as it is taken (its judge arms it
        again); POPPED_PER_TALLY entries looked at, at most. Taken lazily: a caller that stops
        takes no more."""
        due, armed = self._due, self._armed
        for _ in range(POPPED_PER_TALLY):
            if not due or due[0][0] > now:
                return
            at, node_id = heapq.heappop(due)
            if armed.get(node_id) != at:
                continue  # superseded by a sooner entry
            del armed[node_id]
            yield node_id


def calibrated_timeout(t: Timing, step_times: Iterable[float]) -> float:
    """The progress timeout: as configured, else the progress factor times the p99 step time (a
    floor under it; the start-up timeout until MIN_CALIBRATION_SAMPLES steps were seen)."""
    if t.progress_timeout_s is not None:
        return t.progress_timeout_s
    ordered = sorted(step_times)
    if len(ordered) < MIN_CALIBRATION_SAMPLES:
        return max(t.progress_floor_s, t.startup_progress_timeout_s)
    p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
    return max(t.progress_floor_s, t.progress_factor * p99)


def judge_ranks(t: Timing, member: Member, node: NodeLive, rm: RankMap | None, published_at: float,
                stall_after: float, now: float) -> tuple[list[Failure], float]:
    """One node's failing ranks now, and when to judge them next (inf: not before a report
    changes their state). A generation published at `published_at` counts as progress. Deadlines
    are set at the progress timeout's floor (calibration may shorten the timeout meanwhile, never
    below it), less the node's own `early` share: nodes that progressed together are judged
    spread out, not in one tally."""
    placement = rm.placement(member.node_id) if rm else None
    if placement is None:
        return [], now + t.heartbeat_timeout_s  # a spare: looked at again in case a map places it
    shortest = t.progress_timeout_s if t.progress_timeout_s is not None else t.progress_floor_s
    silent_ms = t.heartbeat_timeout_s * 1000 if member.kind is NodeKind.AGENT else math.inf
    ranks = node.ranks
    found, next_at = [], math.inf
    for slot in placement.slots:
        live = ranks.get(slot)
        if live is None:
            continue
        state = live.state
        if state in NO_PROGRESS or state == "forming" or state == "holding":
            continue  # exited: found by the exits; a script's: its exit is the signal; forming: the group watch
        progress_at = live.progress_at if live.progress_at > published_at else published_at
        if live.heard_ms_ago > silent_ms:
            found.append(Failure(FailureKind.RANK_SILENT, member.node_id, slot,
                                 f"agent has not heard from it for {live.heard_ms_ago}ms",
                                 node.last_frame_at - live.heard_ms_ago / 1000))
        elif state == "running":
            if now - progress_at > stall_after:
                found.append(Failure(FailureKind.RANK_STALLED, member.node_id, slot,
                                     f"step {live.step} has not advanced for {now - progress_at:.2f}s "
                                     f"(progress timeout {stall_after:.2f}s)", progress_at))
            elif progress_at + shortest < next_at:
                next_at = progress_at + shortest
        elif state == "starting":
            if now - progress_at > max(stall_after, t.startup_progress_timeout_s):
                found.append(Failure(FailureKind.RANK_STALLED, member.node_id, slot,
                                     f"no step completed for {now - progress_at:.2f}s since it started",
                                     progress_at))
            next_at = min(next_at, progress_at + max(shortest, t.startup_progress_timeout_s))
        elif state == "long_phase" and live.phase_since is not None:
            if now - live.phase_since > t.long_phase_timeout_s:
                found.append(Failure(FailureKind.RANK_STALLED, member.node_id, slot,
                                     f"long phase {live.phase!r} exceeded {t.long_phase_timeout_s:.0f}s",
                                     live.phase_since))
            next_at = min(next_at, live.phase_since + t.long_phase_timeout_s)
    return found, max(next_at - node.early * shortest, now + 1e-6)
