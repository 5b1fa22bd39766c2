"""A job leader's straggler duty: every STRAGGLER_EVERY_S of a running job, ask the straggler watch
(`core.stragglers`, pure) about the map's ranks as the liveness holds them; log who is named and
cleared, record each named node in the history, and under `replace` take the node out at a planned
step, within the policy's window and never below min_nodes.

A look is O(ranks) (~0.4 µs a rank: 40 ms at 100k), so it is taken in slices of at most
LOOK_SLICE_S, one run of slices a tally: the frames that arrive meanwhile wait for a slice, not
for the look (the leader's loop never holds one piece of it longer than that)."""

from __future__ import annotations

import time

from muster.coordinator.core.assessment import Assessment
from muster.coordinator.core.machine import Leave, MembershipEvent, Straggling
from muster.coordinator.core.state import JobState, Phase, RankMap
from muster.coordinator.core.stragglers import Look, Straggler, StragglerPolicy, StragglerWatch
from muster.coordinator.job.streams import Streams

# Looked for this often, and less often in large jobs: a look is O(ranks) (~0.5 µs a rank).
STRAGGLER_EVERY_S, STRAGGLER_RANKS_PER_S = 1.0, 20_000
# A tally runs slices of a look for this long at most (a slice: LOOK_SLICE_NODES placements read,
# or as many nodes' ranks judged; ~0.2 ms of 8-rank nodes).
LOOK_SLICE_S, LOOK_SLICE_NODES = 0.002, 64


class StragglerDuty:
    def __init__(self, policy: StragglerPolicy, now: float, log):
        self.watch = StragglerWatch(policy)
        self.log = log
        self._next_at = now
        self._replaced: list[float] = []  # when `replace` took nodes out, within its window
        self._look: tuple[Look, RankMap] | None = None  # the look under way, and the map it is of

    @property
    def named(self) -> dict[tuple[str, int], float]:
        return self.watch.named

    @property
    def looking(self) -> bool:
        """A look is under way (taken in slices over the next tallies)."""
        return self._look is not None

    def look(self, now: float, state: JobState, seen: Assessment, streams: Streams) -> list[MembershipEvent]:
        """The events of this look at the ranks as liveness holds them (`seen`, this tally's
        assessment): a Straggling per node named, and a Leave per node replaced."""
        policy = self.watch.policy
        if policy.action == "off" or state.phase is not Phase.RUNNING or state.finishing or state.ended \
                or state.rank_map is None:
            self._look = None
            return []
        result = self._slices(now, state, seen)
        if result is None:
            return []
        found, cleared = result
        for node_id in cleared:
            self.log.info("straggler_cleared", node=node_id)
        events: list[MembershipEvent] = []
        for s in found:
            self.log.warning("straggler_named", node=s.node_id, local_ranks=list(s.local_ranks), factor=s.factor,
                             loss=s.loss, whole_node=s.whole_node, median_ms=s.median_ms)
            events.append(Straggling(s.node_id, s.describe()))
            if policy.action == "replace":
                events.extend(self._replace(s, now, state, streams))
        return events

    def _slices(self, now: float, state: JobState, seen: Assessment) -> tuple[list[Straggler], list[str]] | None:
        """The look's next slices, for LOOK_SLICE_S at most (a new look when one is due); its result
        once it is over. A new map drops the look under way: its ranks are no longer the job's."""
        if self._look is not None and self._look[1] is not state.rank_map:
            self._look = None
        if self._look is None:
            if now < self._next_at:
                return None
            placements = state.rank_map.placements
            self._next_at = now + STRAGGLER_EVERY_S + state.rank_map.world_size / STRAGGLER_RANKS_PER_S
            self._look = (Look(self.watch, placements, seen.nodes), state.rank_map)
        look, ends = self._look[0], time.perf_counter() + LOOK_SLICE_S
        while (result := look.step(LOOK_SLICE_NODES, seen.median_step_time or 0.0)) is None:
            if time.perf_counter() >= ends:
                return None
        self._look = None
        return result

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
