"""What liveness keeps and finds: a rank's report as a frame carries it (`RankReport`), what the
leader keeps of each node and rank (`NodeLive`, `RankLive`), and what it finds (`Failure`,
`Divergence`, `Recovery`). Plain records, shared by `liveness` and the parts it delegates to.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

from muster.coordinator.core.kinds import FailureKind
from muster.coordinator.core.state import Placement, RankMap


@dataclass(slots=True)  # one per rank of the job: no per-object dict
class RankLive:
    pid: int = 0
    step: int = 0
    step_time_s: float = 0.0
    state: str = "starting"  # starting | running | long_phase | forming | holding | exited | script | restarting
    phase: str = ""
    heard_ms_ago: int = 0
    progress_at: float = 0.0  # when the step last advanced (a published generation counts too: `Liveness.published`)
    phase_since: float | None = None
    digest_step: int = 0
    digest: bytes = b""
    generation: int = 0  # of the group it is in, or forming
    compute_s: float = 0.0  # median compute part of its latest steps (RankReport.compute_us; 0: not measured)
    straggler_factor: float = 0.0  # named a straggler: its compute over the job's median (0: not named)
    restarts: int = 0  # its slot's restarts by its agent, as last reported
    snapshot_every: int = 0  # its peer snapshots' period in steps, as last reported (0: none)
    snapshot_bytes: int = 0  # the host memory they take on it
    steps_unmeasured: bool = False  # a script's rank whose steps no probe measures (RankReport.steps_unmeasured)


@dataclass(slots=True, eq=False)
class Vouch:
    """A relay's word for every node it carries (`RelaySummary`): as of `at`, each of them not
    lagging had advanced within the relay's interval, the highest of them to `high`. One per relay
    call, shared by its nodes: a summary updates it once, not once a node. `at` is -inf until the
    first summary (and stays so for a relay that sends none)."""

    at: float = float("-inf")
    low: int = 0
    high: int = 0

    def step_of(self, node: NodeLive, rank: RankLive) -> int:
        """The step `rank` of `node` is known to be at: its last frame's, or the summary's floor."""
        if node.lagging or rank.state != "running":
            return rank.step
        return max(rank.step, self.low)


@dataclass(slots=True)
class NodeLive:
    last_frame_at: float
    generation: int = 0
    ranks: dict[int, RankLive] = field(default_factory=dict)
    top_step: int = 0  # the highest step of its ranks in its last frame
    heard_slot: int = -1  # the `SilenceWheel` slot that holds it (by its last frame); -1: none
    early: float = 0.0  # in [0, 0.5): how much of the progress timeout's floor its judgements come early
    vouch: Vouch | None = None  # relayed by a relay that summarises: its progress is the relay's word
    lagging: bool = False  # its relay named it lagging: its progress is its own ranks' again
    heard: bool = False  # a frame of it reached this leader (a member only tracked, on its way, is not judged)


@dataclass(frozen=True)
class Failure:
    kind: FailureKind
    node_id: str  # "" for the group kinds
    local_rank: int | None
    reason: str
    since: float | None = None  # when its first signal came: the last frame, report or progress


SCRIPT = "script"  # a rank of a script without the library, running (RANK_STATE_UNMONITORED)
UNMONITORED = frozenset({SCRIPT, "restarting"})  # scripts without the library: no steps to judge
NO_PROGRESS = UNMONITORED | {"exited", "finished"}  # reports that say nothing of a library rank's progress
REPORTED = frozenset({"exited", "restarting"})  # acted on as reported, not at a deadline
WAITING = frozenset({"long_phase", "forming", "holding"})  # phases timed from when they began
NOT_TRAINED = frozenset({"starting", "forming", "holding"})  # a library rank's states before its first step (at step 0)


class RankReport(NamedTuple):  # a tuple: made for every rank of every frame, 5x cheaper than a dataclass
    local_rank: int
    pid: int
    step: int
    step_time_s: float
    state: str
    heard_ms_ago: int = 0
    phase: str = ""
    digest_step: int = 0
    digest: bytes = b""
    generation: int = 0  # of the group the rank is in or forming (0: none yet)
    compute_s: float = 0.0
    restarts: int = 0  # its slot's restarts by its agent
    snapshot_every: int = 0
    snapshot_bytes: int = 0
    steps_unmeasured: bool = False  # a script's rank without a step probe: step stays 0


@dataclass(frozen=True)
class Divergence:
    step: int
    ranks: tuple[int, ...]  # ranks whose parameters differ from the majority (all, without one)
    nodes: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class Recovery:
    """A new generation's recovery under way: decided at `decided_at`, the job then at `step`."""

    generation: int
    decided_at: float
    step: int


def placed(slots: Iterable[tuple[str, int]], rm: RankMap,
           nodes: dict[str, NodeLive]) -> Iterator[tuple[Placement, int, RankLive]]:
    """Of indexed slots (node, local rank), those `rm` places: (placement, slot, its rank)."""
    for node_id, slot in slots:
        p = rm.placement(node_id)
        if p is not None and slot in p.slots:
            yield p, slot, nodes[node_id].ranks[slot]
