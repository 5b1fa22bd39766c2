"""Stragglers: ranks whose compute is persistently above the job's.

A synchronous job runs at the speed of its slowest rank and nothing dies, so nothing else recovers
from a slow one. Each rank reports the median of its latest steps' compute times
(`RankReport.compute_us`: forward and backward, before the gradients' all-reduce; the healthy ranks
spend the difference waiting in it). A rank is named once its compute has stayed at least `factor`
times the job's median for `min_steps` of its steps, and cleared once it is back under half that
margin (hysteresis: a rank near the threshold does not flap). A node whose measured ranks are all
named is named as the node. Pure: the leader feeds it what its liveness holds and acts on the
result (an event, the metric, Status, and under `replace` a planned leave of the node).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from muster.coordinator.core.live_records import SCRIPT, NodeLive, RankLive
from muster.coordinator.core.policy import InvalidPolicy, JobSpec, check_stragglers
from muster.coordinator.core.state import Placement


# A library rank stepping; a script's rank under `muster run`, measured by its step probe (never
# judged for stalls, but its compute is evidence as a library rank's is).
MEASURED = frozenset({"running", SCRIPT})


@dataclass(frozen=True)
class StragglerPolicy:
    action: str = "report"  # off | report | replace (a planned leave of the straggling node)
    factor: float = 1.5  # compute over the job's median at which a rank straggles
    min_steps: int = 20  # steps it must straggle for before it is named
    replace_window_s: float = 600.0  # `replace` takes out at most `replace_per_window` nodes per window
    replace_per_window: int = 1

    def __post_init__(self):
        check_stragglers(self.action, self.factor, self.min_steps, unset_ok=False)
        if self.replace_per_window < 0 or not self.replace_window_s > 0:
            raise InvalidPolicy(f"the straggler replace window must be positive and its count at least 0, got "
                                f"{self.replace_per_window} per {self.replace_window_s} s")

    def for_job(self, spec: JobSpec) -> StragglerPolicy:
        """The deployment's policy with what the job's spec sets (validated there) in its place."""
        return replace(self, action=spec.straggler_action or self.action, factor=spec.straggler_factor or self.factor,
                       min_steps=spec.straggler_min_steps or self.min_steps)

    @property
    def clear_below(self) -> float:
        return 1.0 + (self.factor - 1.0) / 2


@dataclass(frozen=True)
class Straggler:
    node_id: str
    local_ranks: tuple[int, ...]  # its ranks named
    factor: float  # the highest compute among them over the job's median
    loss: float  # at most this share of the job's step time is lost to it: its excess compute over the step time
    whole_node: bool  # every measured rank of the node straggles

    def describe(self) -> str:
        who = f"node {self.node_id!r}" if self.whole_node else \
            f"node {self.node_id!r} local rank(s) {list(self.local_ranks)}"
        return f"{who} computes {self.factor:.2f}x the job's median; up to {self.loss:.0%} of the job's throughput lost"


@dataclass
class StragglerWatch:
    policy: StragglerPolicy
    # (node, local rank) -> the step it began to straggle at; and -> its factor, once named
    _since: dict[tuple[str, int], int] = field(default_factory=dict)
    named: dict[tuple[str, int], float] = field(default_factory=dict)

    def assess(self, placements: Iterable[Placement], nodes: Mapping[str, NodeLive],
               step_time_s: float) -> tuple[list[Straggler], list[str]]:
        """The map's running ranks as the liveness holds them: the stragglers named by this look (one
        per node) and the nodes cleared. Each rank's `straggler_factor` is set (0: not named).
        O(ranks) on the leader's loop (100k at scale): the measured ranks are kept in three lists, not
        as a tuple each (100k new tuples set the cyclic GC off over and over: 5x the look's own
        time), and a rank neither watched nor slow costs a comparison and its factor's reset."""
        node_ids: list[str] = []  # the measured ranks: node, local rank, liveness
        slots: list[int] = []
        lives: list[RankLive] = []
        per_node: dict[str, int] = {}  # measured ranks of each node
        slots_of: dict[str, tuple[int, ...]] = {}
        for p in placements:
            slots_of[p.node_id] = p.slots
            node = nodes.get(p.node_id)
            if node is None:
                continue
            ranks, before = node.ranks, len(lives)
            for slot in p.slots:
                live = ranks.get(slot)
                if live is not None and live.state in MEASURED and live.compute_s > 0:
                    node_ids.append(p.node_id)
                    slots.append(slot)
                    lives.append(live)
            if len(lives) > before:
                per_node[p.node_id] = len(lives) - before
        # A rank that left the map is cleared; one in it but not measured now (forming after a
        # reform, in a long phase) keeps what it was: a reform must not clear and name it again.
        cleared = {n for n, s in self.named if s not in slots_of.get(n, ())}
        self.named = {k: v for k, v in self.named.items() if k[1] in slots_of.get(k[0], ())}
        self._since = {k: v for k, v in self._since.items() if k[1] in slots_of.get(k[0], ())}
        if len(lives) < 2:
            return [], sorted(cleared - {n for n, _ in self.named})
        computes = sorted(live.compute_s for live in lives)
        median = computes[(len(computes) - 1) // 2]  # the lower median: of two ranks, the faster
        watched = {n for n, _ in self.named} | {n for n, _ in self._since}
        named_now: dict[str, list[tuple[int, float]]] = {}
        for node_id, slot, live in zip(node_ids, slots, lives):
            ratio = live.compute_s / median
            if ratio < self.policy.factor and node_id not in watched:
                live.straggler_factor = 0.0
                continue
            key = (node_id, slot)
            if key in self.named:
                if ratio < self.policy.clear_below:
                    del self.named[key]
                    self._since.pop(key, None)
                    cleared.add(node_id)
                else:
                    self.named[key] = ratio
            elif ratio >= self.policy.factor:
                since = self._since.setdefault(key, live.step)
                if live.step < since:  # a new process in the slot (a script's rank restarted) counts from 0
                    since = self._since[key] = live.step
                if live.step - since >= self.policy.min_steps:
                    self.named[key] = ratio
                    named_now.setdefault(node_id, []).append((slot, ratio))
            else:
                self._since.pop(key, None)
            live.straggler_factor = round(self.named.get(key, 0.0), 2)
        found = []
        for node_id, ranks in named_now.items():
            factor = max(r for _, r in ranks)
            every = [s for (n, s) in self.named if n == node_id]
            loss = min(1.0, max(0.0, (factor - 1.0) * median / step_time_s)) if step_time_s > 0 else 0.0
            found.append(Straggler(node_id, tuple(sorted(every)), round(factor, 2), round(loss, 3),
                                   whole_node=len(every) == per_node[node_id]))
        return found, sorted(cleared - {n for n, _ in self.named})
