"""A job leader's straggler duty: every STRAGGLER_EVERY_S of a running job, ask the straggler watch
(`core.stragglers`, pure) about the map's ranks as the liveness holds them; log who is named and
cleared, record each named node in the history, and under `replace` take the node out at a planned
step, within the policy's window and never below min_nodes."""

from __future__ import annotations

from muster.coordinator.core.assessment import Assessment
from muster.coordinator.core.machine import Leave, MembershipEvent, Straggling
from muster.coordinator.core.state import JobState, Phase
from muster.coordinator.core.stragglers import Straggler, StragglerPolicy, StragglerWatch
from muster.coordinator.streams import Streams

# Looked for this often, and less often in large jobs: a look is O(ranks) (~0.5 µs a rank).
STRAGGLER_EVERY_S, STRAGGLER_RANKS_PER_S = 1.0, 20_000


class StragglerDuty:
    def __init__(self, policy: StragglerPolicy, now: float, log):
        self.watch = StragglerWatch(policy)
        self.log = log
        self._next_at = now
        self._replaced: list[float] = []  # when `replace` took nodes out, within its window

    @property
    def named(self) -> dict[tuple[str, int], float]:
        return self.watch.named

    def look(self, now: float, state: JobState, seen: Assessment, streams: Streams) -> list[MembershipEvent]:
        """The events of this look at the ranks as liveness holds them (`seen`, this tally's
        assessment): a Straggling per node named, and a Leave per node replaced."""
        policy = self.watch.policy
        if policy.action == "off" or now < self._next_at or state.phase is not Phase.RUNNING \
                or state.finishing or state.ended or state.rank_map is None:
            return []
        placements = state.rank_map.placements
        self._next_at = now + STRAGGLER_EVERY_S + sum(len(p.slots) for p in placements) / STRAGGLER_RANKS_PER_S
        found, cleared = self.watch.assess(placements, seen.nodes, seen.median_step_time or 0.0)
        for node_id in cleared:
            self.log.info("straggler_cleared", node=node_id)
        events: list[MembershipEvent] = []
        for s in found:
            self.log.warning("straggler_named", node=s.node_id, local_ranks=list(s.local_ranks), factor=s.factor,
                             loss=s.loss, whole_node=s.whole_node)
            events.append(Straggling(s.node_id, s.describe()))
            if policy.action == "replace":
                events.extend(self._replace(s, now, state, streams))
        return events

    def _replace(self, s: Straggler, now: float, state: JobState, streams: Streams) -> list[MembershipEvent]:
        policy = self.watch.policy
        self._replaced = [t for t in self._replaced if now - t < policy.replace_window_s]
        remaining = len(state.members) - 1
        if len(self._replaced) >= policy.replace_per_window or remaining < state.spec.min_nodes:
            why = "its window's replacements are spent" if remaining >= state.spec.min_nodes else \
                f"the job would fall below min_nodes {state.spec.min_nodes}"
            self.log.warning("straggler_kept", node=s.node_id, reason=why)
            return []
        self._replaced.append(now)
        streams.depart(s.node_id)  # as an operator's drain: its frames are no news any more
        return [Leave(s.node_id, False, f"straggler replaced: {s.describe()}")]
