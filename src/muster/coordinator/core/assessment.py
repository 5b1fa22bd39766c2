"""What liveness finds at one tally (`Liveness.assess`), the one snapshot a leader's decision reads,
in the shape of torchft's `quorum_compute`: the failures and a divergence found, whether the
takeover grace is over, whether the map still re-forms, how a recovery under way stands, and the
figures a change is planned from (the map's highest step, the median step time, whether its ranks
run the library). Also the passes over the map's nodes those figures take. Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

from muster.coordinator.core.kinds import GROUP_KINDS
from muster.coordinator.core.live_records import (NO_PROGRESS, NOT_TRAINED, SCRIPT, UNMONITORED, Divergence, Failure,
                                                   NodeLive, Recovery)
from muster.coordinator.core.machine import Diverged, MembershipEvent, NodeLost, Regroup, SlotDown
from muster.coordinator.core.state import JobState, NodeKind


@dataclass(eq=False)  # not frozen: made every tick, and a frozen one costs 5x to make (0.8 µs)
class Assessment:
    """One tally's findings, read and never changed. The failures, divergence, grace, re-forming
    and recovery are found at once (`Liveness.assess`); the figures that cost a pass over the map's
    nodes or a sort are worked out when first read, which a tally does only when it has something
    to decide, from liveness's records as they stand in that tally (no frame is recorded between
    its assessment and its decision)."""

    state: JobState
    now: float
    recovered: tuple[bool, float | None] | None  # the recovery asked about: over, and what it took
    grace_over: bool  # the takeover grace is over (or there was none): only exits acted during it
    reforming: bool  # an abort generation not formed yet (asked only when slots came back)
    failures: list[Failure]  # found again at every tally until a decision removes them
    diverged: Divergence | None
    nodes: Mapping[str, NodeLive]  # liveness's records, read-only (the straggler watch reads them too)
    step_times: Iterable[float]
    cap_s: float  # how far a report is projected: the heartbeat timeout

    def events(self) -> list[MembershipEvent]:
        """The failures and the divergence, as events for the core."""
        if not self.failures and self.diverged is None:
            return []  # a quiet tick's
        events: list[MembershipEvent] = []
        for f in self.failures:
            member = self.state.member(f.node_id)
            events.append(_failure_event(f, member.kind if member else NodeKind.AGENT))
        if self.diverged is not None:
            events.append(Diverged(self.diverged.nodes, self.diverged.reason))
        return events

    @cached_property
    def median_step_time(self) -> float | None:
        return median(self.step_times)

    @cached_property
    def steps(self) -> tuple[int, int]:
        """The map's highest step projected to `now`, and as reported (`max_steps`)."""
        return max_steps(self.nodes, self.state, self.cap_s, self.now, self.median_step_time)

    @cached_property
    def prestart(self) -> bool:
        """Some rank of the map reports library progress (scripts without it are never judged stalled): a
        node joining the running job starts its ranks before it takes a place."""
        rm = self.state.rank_map
        for p in rm.placements if rm else ():
            node = self.nodes.get(p.node_id)
            if node is not None and any(r.state not in NO_PROGRESS for r in node.ranks.values()):
                return True
        return False

    @cached_property
    def unformed(self) -> frozenset[str]:
        """Nodes of the map none of whose ranks trained: each a library rank starting or forming its
        first group (step 0), or none reported yet (still importing). Placed by a switch after the
        step the job's ranks finished at, they never will. A node this leader has not heard yet is
        not judged: a leader that took over as the job finished knows nothing of its members' ranks
        (a fresh-clone run's successor ended a run at once as 'placed at generation 1 never trained',
        its two nodes' ranks done and one still hanging in teardown, before either node reattached)."""
        rm = self.state.rank_map
        found = []
        for p in rm.placements if rm else ():
            node = self.nodes.get(p.node_id)
            if node is not None and node.heard and all(r.state in NOT_TRAINED and r.step == 0
                                                       for r in node.ranks.values()):
                found.append(p.node_id)
        return frozenset(found)


def _failure_event(f: Failure, kind: NodeKind) -> MembershipEvent:
    if f.kind in GROUP_KINDS:
        return Regroup(f.kind, f.reason, (f.node_id,) if f.node_id else ())
    if f.local_rank is None or kind is NodeKind.PROCESS:
        return NodeLost(f.node_id, f.kind, f.reason)
    return SlotDown(f.node_id, f.local_rank, f.kind, f.reason)


def median(step_times: Iterable[float]) -> float | None:
    ordered = sorted(step_times)
    return ordered[len(ordered) // 2] if ordered else None


def reforming(nodes: Mapping[str, NodeLive], state: JobState) -> bool:
    """The current map is an abort generation that some library rank of it has not formed yet
    (it still forms or holds, or runs an older group): the leader holds back planned changes
    until it has (a node that reconnects to a leader that did not publish the abort gets only the
    current map, never the abort before a planned one: it would form the new group while the others
    form the abort's; `Streams.attach`). O(ranks)."""
    rm = state.rank_map
    if rm is None or not rm.abort_previous:
        return False
    for p in rm.placements:
        node = nodes.get(p.node_id)
        for slot in p.slots:
            r = node.ranks.get(slot) if node else None
            if r is None or r.state in NO_PROGRESS:
                continue
            if r.state in ("forming", "holding") or r.generation < rm.generation:
                return True
    return False


class RecoveryWatch:
    """Whether a recovery is over, looked at each tally; nodes found recovered stay so, and each
    look goes on from the first that was not."""

    def __init__(self):
        self._at: tuple[int, int] = (0, 0)  # (generation, placements found recovered so far)

    def look(self, nodes: Mapping[str, NodeLive], state: JobState, recovery: Recovery,
             now: float) -> tuple[bool, float | None]:
        """Whether `recovery` is over, and how long it took: until every node of its map reported
        the generation and a step past the one at the decision, or, for a script's ranks (restarted
        with each map, their probe's steps counting from their process's start), until each of
        them steps in a process of the generation, or runs one where no probe measures its steps
        (None: another map superseded it, or there is nothing to run)."""
        rm = state.rank_map
        if rm is None or rm.generation != recovery.generation:
            return True, None
        generation, start = self._at
        i = start if generation == recovery.generation else 0
        for p in rm.placements[i:]:
            node = nodes.get(p.node_id)
            if node is None or node.generation < recovery.generation or not recovered(node, p.slots, recovery):
                self._at = (recovery.generation, i)
                return False, None
            i += 1
        return True, now - recovery.decided_at


def recovered(node: NodeLive, slots: Sequence[int], recovery: Recovery) -> bool:
    ranks = [r for s, r in node.ranks.items() if s in slots]
    # A relayed node's steps past its first advance in the generation come as its relay's word
    # (a summarising relay forwards no frame that only advances steps)
    vouch = node.vouch
    if any((vouch.step_of(node, r) if vouch is not None else r.step) > recovery.step and r.state not in UNMONITORED
           for r in ranks):
        return True
    # (one whose steps no probe measures: once its process runs the generation, all that can be known)
    return bool(ranks) and all(r.state == SCRIPT and r.generation >= recovery.generation
                               and (r.step >= 1 or r.steps_unmeasured) for r in ranks)


def max_steps(nodes: Mapping[str, NodeLive], state: JobState, cap: float, now: float | None,
              step_time_s: float | None) -> tuple[int, int]:
    """The highest step of the map's nodes projected to `now` (a report's age over the step time,
    at most `cap`) and as reported: a decision wants both (one pass: 125k nodes are ~0.1 s a pass).
    A relay's summary counts as a newer report."""
    rm = state.rank_map
    # (a rebuild has no map yet: its nodes' ranks run on in the groups they had, at their steps)
    node_ids = rm.node_ids if rm is not None else [m.node_id for m in state.members] if state.rebuilding else ()
    # Each node's newest word (its frame, or its relay's summary if newer), then the maxima over the
    # distinct ones: a relay's nodes share its summary, so the projection runs per relay, not per node.
    found = filter(None, map(nodes.get, node_ids))
    words = {(v.high, v.at) if (v := n.vouch) is not None and v.high > n.top_step else (n.top_step, n.last_frame_at)
             for n in found}
    if not words:
        return 0, 0
    reported = max(top for top, _ in words)
    if now is None or not step_time_s:
        return reported, reported
    reached = max(top + int(min(max(0.0, now - at), cap) / step_time_s) for top, at in words)
    return reached, reported
