"""`muster status` and `muster jobs` on the wire: a status request's paging checked (`check_page`),
one page of a job's ranks in rank order (`rank_page`), the job's summary in counts, and the
`JobStatus` and `JobRecord` messages built from the core's state and the leader's liveness."""

from __future__ import annotations

import re
from bisect import bisect_right
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice

from muster.coordinator.core.liveness import Liveness
from muster.coordinator.core.state import JobState, Outcome, Placement
from muster.coordinator.errors import FailedPrecondition, InvalidArgument, NotFound
from muster.coordinator.wire import RANK_STATES, check_node, shown
from muster.v1 import muster_pb2 as pb

# The default keeps any Status far below the 1 MiB message limit (a rank is at most ~170 bytes
# with a 128-character node id), the most stays below it.
DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE = 1000, 5000
SCAN_FACTOR = 16  # a page filtered by state looks at most this many ranks per rank it may hold
MAX_LISTED_NODES = 1000  # JobStatus.nodes and .spares; the summary counts every one
STATUS_STATES = frozenset(RANK_STATES.values()) | {"unknown", "persisted"}  # RankStatus.state
PAGE_TOKEN = re.compile(r"g(\d{1,15})r(\d{1,10})")  # generation, first rank


@dataclass(frozen=True)
class Page:
    """Which ranks one Status answers with (StatusRequest's paging and filters, checked)."""

    size: int = DEFAULT_PAGE_SIZE
    token: tuple[int, int] | None = None  # (generation, first rank) of a next_page_token
    node: str = ""
    states: frozenset[str] = frozenset()

    @property
    def summarised(self) -> bool:
        """The first page of the whole job carries the summary (a node's ranks are about that node)."""
        return self.token is None and not self.node


def check_page(req: pb.StatusRequest) -> Page:
    if req.page_size > MAX_PAGE_SIZE:
        raise InvalidArgument(f"page_size is {req.page_size}; at most {MAX_PAGE_SIZE} (0: {DEFAULT_PAGE_SIZE})")
    if not req.job and (req.page_token or req.node):
        raise InvalidArgument("page_token and node need a job")
    token = None
    if req.page_token:
        found = PAGE_TOKEN.fullmatch(req.page_token)
        if found is None:
            raise InvalidArgument(f"page_token {shown(req.page_token)} is none that Status gave; "
                                  "ask without one for the first page")
        token = int(found[1]), int(found[2])
    if req.node:
        check_node(req.node)
    if len(req.states) > len(STATUS_STATES):
        raise InvalidArgument(f"states lists {len(req.states)} states; there are {len(STATUS_STATES)}")
    for name in req.states:
        if name not in STATUS_STATES:
            raise InvalidArgument(f"states: {shown(name)} is no rank state; use {', '.join(sorted(STATUS_STATES))}")
    return Page(req.page_size or DEFAULT_PAGE_SIZE, token, req.node, frozenset(req.states))


def rank_states(placements: Sequence[Placement], live: Liveness) -> Counter[str]:
    """The live state of every rank of `placements`, counted: one dict lookup per rank."""
    counts: Counter[str] = Counter()
    for p in placements:
        node = live.nodes.get(p.node_id)
        if node is None:
            counts["unknown"] += len(p.slots)
            continue
        ranks = node.ranks
        counts.update(r.state if (r := ranks.get(slot)) else "unknown" for slot in p.slots)
    return counts


def job_summary(state: JobState, live: Liveness | None, counts: Counter[str] | None = None) -> pb.JobSummary:
    """Counts over the whole job; `counts`: rank_states of the whole map, counted already (the
    leader counts a large map in slices, yielding to its loop between them)."""
    s = pb.JobSummary(nodes=len(state.members), spares=len(state.spares))
    rm = state.rank_map
    if rm is None or not rm.world_size:
        return s
    if live is None:
        s.rank_states["persisted"] = rm.world_size
    else:
        s.rank_states.update(rank_states(rm.placements, live) if counts is None else counts)
    return s


def rank_page(state: JobState, live: Liveness | None, page: Page) -> tuple[list[pb.RankStatus], str]:
    """One page of ranks and the token of the next ("" after the last). O(page size): placements
    are ordered by rank offset, so the page's first node is found by bisection; a states filter
    scans at most SCAN_FACTOR x page size ranks."""
    rm = state.rank_map
    start = 0
    if page.token is not None:
        generation, start = page.token
        if generation != state.generation:
            raise FailedPrecondition(f"page_token is of generation {generation}; the job is at generation "
                                     f"{state.generation}: its ranks moved, ask again without a page_token")
        if rm is None or start > rm.world_size:
            raise InvalidArgument(f"page_token starts at rank {start}, beyond the job's world size "
                                  f"{rm.world_size if rm else 0}")
    if page.node and state.member(page.node) is None:
        raise NotFound(f"node {page.node!r} is no member of job {state.job!r}")
    if rm is None:
        return [], ""
    if page.node:
        placement = rm.placement(page.node)
        placements: tuple[Placement, ...] = (placement,) if placement else ()
    else:
        placements = rm.placements
    first = max(0, bisect_right(placements, start, key=lambda p: p.rank_offset) - 1)
    budget = page.size * SCAN_FACTOR if page.states else page.size
    ranks: list[pb.RankStatus] = []
    for p in placements[first:]:
        node = live.nodes.get(p.node_id) if live else None
        member = state.member(p.node_id)
        for index in range(max(0, start - p.rank_offset), len(p.slots)):
            if len(ranks) == page.size or budget == 0:
                return ranks, f"g{state.generation}r{p.rank_offset + index}"
            budget -= 1
            slot = p.slots[index]
            r = node.ranks.get(slot) if node else None
            step = (node.vouch.step_of(node, r) if node.vouch is not None else r.step) if r else 0
            rank_state = (r.state if r else "unknown") if live else "persisted"
            if page.states and rank_state not in page.states:
                continue
            ranks.append(pb.RankStatus(rank=p.rank_offset + index, local_rank=slot, node=p.node_id,
                                       node_rank=p.node_rank, pid=r.pid if r else 0, step=step,
                                       state=rank_state, compute_us=int(r.compute_s * 1e6) if r else 0,
                                       step_time_us=int(r.step_time_s * 1e6) if r else 0,
                                       straggler_factor=r.straggler_factor if r else 0.0,
                                       phase=r.phase if r and live else "", host=member.host if member else "",
                                       restarts=r.restarts if r else 0,
                                       snapshot_every=r.snapshot_every if r else 0,
                                       snapshot_bytes=r.snapshot_bytes if r else 0))
    return ranks, ""


def job_status(state: JobState, leader: str, term: int, live: Liveness | None, brief: bool = False,
               page: Page = Page(), summary: pb.JobSummary | None = None) -> pb.JobStatus:
    """Persisted map always; pids, steps and rank states only when `live` (the leader) is given;
    `brief`: neither ranks nor nodes (O(1) in the job size). Otherwise one page of ranks, and with
    the first page (of the whole job, no node filter) the summary (`summary`, or counted here) and
    the nodes and spares (at most MAX_LISTED_NODES of each)."""
    rm = state.rank_map
    js = pb.JobStatus(
        name=state.job,
        leader=leader,
        term=term,
        generation=state.generation,
        world_size=rm.world_size if rm else 0,
        phase=state.phase.value if state.outcome is Outcome.RUNNING else "ended",  # no live phase once over
        live=live is not None,
        run=state.run,
        outcome=state.outcome.value,
        outcome_reason=state.outcome_reason,
        started_unix_ms=state.started_ms,
        ended_unix_ms=state.ended_ms,
    )
    if brief:
        return js
    ranks, js.next_page_token = rank_page(state, live, page)
    js.ranks.extend(ranks)
    if page.summarised:
        js.nodes.extend(m.node_id for m in islice(state.members, MAX_LISTED_NODES))
        js.spares.extend(state.spares[:MAX_LISTED_NODES])
        js.summary.CopyFrom(summary or job_summary(state, live))
    return js


def job_record(job: str, run: int, summary: dict, leader: str = "") -> pb.JobRecord:
    """A run as `muster jobs` lists it, from a finished run's summary or a running job's state."""
    return pb.JobRecord(name=job, run=run, outcome=summary["outcome"], reason=summary["reason"],
                        world_size=summary["world_size"], generation=summary["generation"],
                        started_unix_ms=summary["started_ms"], ended_unix_ms=summary["ended_ms"], leader=leader)
