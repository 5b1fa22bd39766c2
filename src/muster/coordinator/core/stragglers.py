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

from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from muster.coordinator.core.live_records import SCRIPT, NodeLive, RankLive
from muster.coordinator.core.policy import InvalidPolicy, JobSpec, check_stragglers
from muster.coordinator.core.state import Placement


# A library rank stepping; a script's rank under `muster run`, measured by its step probe (never
# judged for stalls, but its compute is evidence as a library rank's is).
MEASURED = frozenset({"running", SCRIPT})
# A look's computes are sorted in runs this long (~0.5 ms each): the median's bisection costs a
# bisect per run a step, so 25 runs at 100k ranks, not one per slice.
SORTED_RUN = 4096


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
    median_ms: float = 0.0  # the job's median compute it was judged against (what "factor" is over)

    def describe(self) -> str:
        who = f"node {self.node_id!r}" if self.whole_node else \
            f"node {self.node_id!r} local rank(s) {list(self.local_ranks)}"
        return f"{who} computes {self.factor:.2f}x the job's median; up to {self.loss:.0%} of the job's throughput lost"


def lower_median(runs: list[list[float]]) -> float:
    """The lower median of the union of sorted `runs`, without sorting the union (100k floats: 5-14
    ms in one piece): bisection over the values, each step a bisect per run (~60 steps, ~0.5 ms)."""
    k = (sum(len(r) for r in runs) - 1) // 2  # its index in the union, sorted
    lo, hi = min(r[0] for r in runs if r), max(r[-1] for r in runs if r)
    if sum(bisect_right(r, lo) for r in runs) > k:
        return lo
    while True:  # invariant: at most k values <= lo, more than k <= hi: the median is in (lo, hi]
        mid = lo + (hi - lo) / 2
        if mid <= lo or mid >= hi:  # adjacent floats: hi is the smallest value with more than k at or below it
            return hi
        if sum(bisect_right(r, mid) for r in runs) > k:
            hi = mid
        else:
            lo = mid


@dataclass
class StragglerWatch:
    policy: StragglerPolicy
    # (node, local rank) -> the step it began to straggle at; and -> its factor, once named
    _since: dict[tuple[str, int], int] = field(default_factory=dict)
    named: dict[tuple[str, int], float] = field(default_factory=dict)

    def assess(self, placements: Sequence[Placement], nodes: Mapping[str, NodeLive],
               step_time_s: float) -> tuple[list[Straggler], list[str]]:
        """One look taken in one piece: `Look.step` without a bound."""
        look = Look(self, placements, nodes)
        while (result := look.step(len(placements) + 1, step_time_s)) is None:
            pass
        return result


class Look:
    """One look of the watch at the map's running ranks as the liveness holds them, taken a slice at a
    time (`step`): the leader's loop goes on between slices, so a 100k-rank look (~40 ms) never holds
    it in one piece. First the ranks are read (`_gather`), then each measured rank is judged against
    the median (`_judge`); the result is the stragglers named (one per node) and the nodes cleared.
    Each rank's `straggler_factor` is set (0: not named). The measured ranks are kept in three lists,
    not as a tuple each (100k new tuples set the cyclic GC off over and over: 5x the look's own
    time), and a rank neither watched nor slow costs a comparison and its factor's reset. A rank is
    read at the slice that reaches it: what liveness says of it then."""

    def __init__(self, watch: StragglerWatch, placements: Sequence[Placement], nodes: Mapping[str, NodeLive]):
        self.watch, self.placements, self.nodes = watch, placements, nodes
        self._at = 0  # the next placement to read, then the next measured rank to judge
        self._gathered = False
        self._node_ids: list[str] = []  # the measured ranks: node, local rank, liveness
        self._slots: list[int] = []
        self._lives: list[RankLive] = []
        self._computes: list[list[float]] = []  # the computes read, in sorted runs of SORTED_RUN or so
        self._pending: list[float] = []  # those not in a run yet
        self._per_node: dict[str, int] = {}  # measured ranks of each node
        self._slots_of: dict[str, tuple[int, ...]] = {}
        self._cleared: set[str] = set()
        self._median = 0.0
        self._watched: set[str] = set()
        self._named_now: dict[str, list[tuple[int, float]]] = {}

    def step(self, nodes: int, step_time_s: float) -> tuple[list[Straggler], list[str]] | None:
        """One slice: the next `nodes` placements read, or the next `nodes` x (the map's mean ranks a
        node) measured ranks judged; the look's result once it is over, else None."""
        if not self._gathered:
            return self._gather(nodes)
        return self._judge(max(1, nodes * self._mean_slots()), step_time_s)

    def _mean_slots(self) -> int:
        return max(1, len(self._lives) // max(1, len(self._per_node)))

    def _gather(self, count: int) -> tuple[list[Straggler], list[str]] | None:
        nodes, node_ids, slots, lives = self.nodes, self._node_ids, self._slots, self._lives
        first = len(lives)
        for p in self.placements[self._at:self._at + count]:
            self._slots_of[p.node_id] = p.slots
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
                self._per_node[p.node_id] = len(lives) - before
        self._pending.extend(live.compute_s for live in lives[first:])
        self._at += count
        done = self._at >= len(self.placements)
        if len(self._pending) >= SORTED_RUN or (done and self._pending):
            self._computes.append(sorted(self._pending))
            self._pending = []
        if not done:
            return None
        self._gathered, self._at = True, 0
        # A rank that left the map is cleared; one in it but not measured now (forming after a
        # reform, in a long phase) keeps what it was: a reform must not clear and name it again.
        watch, slots_of = self.watch, self._slots_of
        self._cleared = {n for n, s in watch.named if s not in slots_of.get(n, ())}
        watch.named = {k: v for k, v in watch.named.items() if k[1] in slots_of.get(k[0], ())}
        watch._since = {k: v for k, v in watch._since.items() if k[1] in slots_of.get(k[0], ())}
        if len(lives) < 2:
            return [], sorted(self._cleared - {n for n, _ in watch.named})
        self._median = lower_median(self._computes)  # of two ranks, the faster
        self._watched = {n for n, _ in watch.named} | {n for n, _ in watch._since}
        return None

    def _judge(self, count: int, step_time_s: float) -> tuple[list[Straggler], list[str]] | None:
        watch, policy, median, watched = self.watch, self.watch.policy, self._median, self._watched
        named, since_of, named_now = watch.named, watch._since, self._named_now
        end = min(len(self._lives), self._at + count)
        for i in range(self._at, end):
            node_id, live = self._node_ids[i], self._lives[i]
            ratio = live.compute_s / median
            if ratio < policy.factor and node_id not in watched:
                live.straggler_factor = 0.0
                continue
            key = (node_id, self._slots[i])
            if key in named:
                if ratio < policy.clear_below:
                    del named[key]
                    since_of.pop(key, None)
                    self._cleared.add(node_id)
                else:
                    named[key] = ratio
            elif ratio >= policy.factor:
                since = since_of.setdefault(key, live.step)
                if live.step < since:  # a new process in the slot (a script's rank restarted) counts from 0
                    since = since_of[key] = live.step
                if live.step - since >= policy.min_steps:
                    named[key] = ratio
                    named_now.setdefault(node_id, []).append((key[1], ratio))
            else:
                since_of.pop(key, None)
            live.straggler_factor = round(named.get(key, 0.0), 2)
        self._at = end
        if end < len(self._lives):
            return None
        found = []
        for node_id, ranks in named_now.items():
            factor = max(r for _, r in ranks)
            every = [s for (n, s) in named if n == node_id]
            loss = min(1.0, max(0.0, (factor - 1.0) * median / step_time_s)) if step_time_s > 0 else 0.0
            found.append(Straggler(node_id, tuple(sorted(every)), round(factor, 2), round(loss, 3),
                                   whole_node=len(every) == self._per_node[node_id],
                                   median_ms=round(median * 1e3, 2)))
        return found, sorted(self._cleared - {n for n, _ in named})
