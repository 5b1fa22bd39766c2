"""Rank assignment: which slots of which nodes run the next generation, and as which ranks.

Deterministic and topology-aware: a node's ranks are contiguous and its local ranks are its
slot numbers; nodes of the previous map keep their relative order (so rank 0 stays put while
its node lives, and otherwise moves to the oldest surviving node); new nodes follow by age.
"""

from __future__ import annotations

from bisect import bisect_right
from itertools import accumulate, compress, count, repeat
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter, lt, ne, not_

from muster.coordinator.core.policy import JobSpec
from muster.coordinator.core.state import Member, Placement, RankMap, renumbered
from muster.net import join_host_port


_USABLE, _NODE_ID, _SLOTS, _JSON = (attrgetter("usable_slots"), attrgetter("node_id"), attrgetter("slots"),
                                   attrgetter("json"))


@dataclass(frozen=True)
class Assignment:
    placements: tuple[Placement, ...]  # empty when the job cannot run
    world_size: int
    reason: str
    left_out: int = 0  # usable slots of the job's nodes not placed (size rules, spares): RankMap.left_out

    @property
    def runnable(self) -> bool:
        return self.world_size > 0


def priority_order(members: Sequence[Member], previous: RankMap | None) -> list[Member]:
    """Nodes of the previous map in their node-rank order, then the others by age (only those
    sorted: at 125k nodes a sort of all of them was a tenth of a second of every change)."""
    others = dict(zip(map(_NODE_ID, members), members))
    placed = list(filter(None, map(others.pop, previous.node_ids, repeat(None)))) if previous else []
    return placed + sorted(others.values(), key=lambda m: m.seq)


def assign_ranks(members: Sequence[Member], previous: RankMap | None, spec: JobSpec) -> Assignment:
    usable = list(filter(_USABLE, priority_order(members, previous)))
    candidates = usable[: spec.max_nodes]
    total = sum(map(len, map(_USABLE, candidates)))  # in C: a generator over 125k nodes was 47 ms
    beyond = sum(map(len, map(_USABLE, usable[spec.max_nodes:])))
    target = total - total % spec.world_size_multiple
    if target < total:
        candidates = _short_nodes_out(candidates, total - target)
    placements = _kept_prefix(candidates, previous, target)
    offset = placements[-1].rank_offset + len(placements[-1].slots) if placements else 0
    # The rest in order, each from where the one before ended (C's accumulate: one pass in Python
    # per member, and that only to make its placement), up to the target; the last one cut to fit.
    rest = candidates[len(placements):]
    usables = list(map(_USABLE, rest))
    starts = list(accumulate(map(len, usables), initial=offset))
    whole = bisect_right(starts, target) - 1  # members whose every usable slot fits
    end = starts[whole]
    if whole < len(rest) and end < target:
        usables[whole] = usables[whole][:target - end]
        whole, end = whole + 1, target
    placements += _placed_tail(rest[:whole], usables[:whole], starts, len(placements), previous)
    offset = end
    if len(placements) < spec.min_nodes:
        return Assignment(
            (),
            0,
            f"{len(placements)} usable node(s) of min_nodes={spec.min_nodes} "
            f"({total} usable slot(s), world_size_multiple={spec.world_size_multiple})",
        )
    spares = len(members) - len(placements)
    return Assignment(
        tuple(placements),
        offset,
        f"world_size={offset} on {len(placements)} node(s)" + (f", {spares} spare/idle" if spares else ""),
        total + beyond - offset,
    )


def _short_nodes_out(candidates: list[Member], excess: int) -> list[Member]:
    """`candidates` less the nodes already short of slots (a rank lost) whose usable slots fit in the
    `excess` the size rule cuts, the last first: a node's slots often go together (a replica group of
    a sharded layout, a tensor-parallel group), so a cut takes out a node a loss has split already
    rather than split a whole one. Cutting from the tail instead left one rank of each replica group
    of an HSDP job, and a shard held by neither (issue 55)."""
    lens = list(map(len, map(_USABLE, candidates)))
    out = set()
    for i in reversed(list(compress(count(), map(lt, lens, map(_SLOTS, candidates))))):
        if lens[i] <= excess:
            out.add(i)
            excess -= lens[i]
    return [m for i, m in enumerate(candidates) if i not in out] if out else candidates


def _kept_prefix(candidates: Sequence[Member], previous: RankMap | None, target: int) -> list[Placement]:
    """The previous map's leading placements that stay as they were (the same nodes first, with the
    same slots, within the target): taken whole, so a loss costs the placements after it."""
    if previous is None:
        return []
    # The first difference found in C passes (compress of the unequal pairs), not a loop per node.
    before = previous.placements
    n = min(len(candidates), bisect_right(before, target, key=lambda p: p.rank_offset + len(p.slots)))
    n = next(compress(count(), map(ne, map(_NODE_ID, candidates[:n]), map(_NODE_ID, before[:n]))), n)
    n = next(compress(count(), map(ne, map(_USABLE, candidates[:n]), map(_SLOTS, before[:n]))), n)
    return list(before[:n])


def _placed_tail(members: Sequence[Member], usables: list[tuple[int, ...]], starts: list[int], first: int,
                 previous: RankMap | None) -> list[Placement]:
    """The placements of the members after the kept prefix. After a loss these are the same nodes
    with the same slots, renumbered: they keep their encoded text and are made in C (`renumbered`);
    otherwise a node is placed anew where it is new or its slots changed."""
    ids = list(map(_NODE_ID, members))
    kept = list(map(previous.by_node.get, ids)) if previous else [None] * len(ids)
    if None not in kept and list(map(_SLOTS, kept)) == usables:
        head, tail = (kept[0], kept[-1]) if kept else (None, None)
        if head and (head.node_rank, head.rank_offset, tail.node_rank) == (first, starts[0], first + len(ids) - 1):
            return kept  # consecutive in the previous map and numbered from the same place: each unchanged
        return renumbered(ids, first, starts, usables, map(_JSON, kept))
    return [_place(node_id, node_rank, start, slots, p)
            for node_id, node_rank, start, slots, p in zip(ids, count(first), starts, usables, kept)]


def _place(node_id: str, node_rank: int, start: int, slots: tuple[int, ...], before: Placement | None) -> Placement:
    """A node's placement: kept as it was where nothing changed, its text kept where its slots did not."""
    if before is None or before.slots != slots:
        return Placement(node_id, node_rank, start, slots)
    if before.rank_offset != start or before.node_rank != node_rank:
        return Placement(node_id, node_rank, start, slots, before.json)
    return before


def excluded_ranks(previous: RankMap | None, placements: Sequence[Placement]) -> tuple[int, ...]:
    """The ranks of `previous` that a loss-only map leaves out, or () when the map is not one:
    every rank it places held a rank in `previous`, and the survivors keep their order (the i-th
    rank of the new map is the i-th surviving rank of the old). Its ranks can then shrink the old
    group's communicator (NCCL's comm shrink numbers survivors so) instead of making a new one."""
    if previous is None:
        return ()
    # O(nodes), not O(ranks): a node's old ranks are a contiguous block, and its kept ones rise
    # with its slots, so the order holds iff the blocks of the kept nodes still rise.
    excluded: list[int] = []
    same = 0  # the leading placements the map kept as they were: nothing left out among them
    for p, before in zip(placements, previous.placements):
        if p is not before:
            break
        same += 1
    whole = _whole_nodes_left_out(placements[same:], previous.placements[same:])
    if whole is not None:
        return whole
    end = placements[same - 1].rank_offset + len(placements[same - 1].slots) if same else 0
    by_node = previous.by_node
    for p in placements[same:]:
        before = by_node.get(p.node_id)
        if before is None or (p.slots != before.slots and not set(p.slots) <= set(before.slots)):
            return ()  # a node or a slot that joined: a full init
        if before.rank_offset < end:
            return ()  # the order changed
        excluded.extend(range(end, before.rank_offset))  # whole nodes left out
        if p.slots != before.slots:
            excluded.extend(before.rank_of(s) for s in before.slots if s not in p.slots)
        end = before.rank_offset + len(before.slots)
    excluded.extend(range(end, previous.world_size))
    return tuple(excluded)  # () when nobody was left out


def _whole_nodes_left_out(placements: Sequence[Placement], before: Sequence[Placement]) -> tuple[int, ...] | None:
    """The common loss: `placements` are `before` less some whole nodes, in order, with their slots.
    Then their ranks are what is left out (in list passes: at 125k nodes the general walk was
    a tenth of the decision); None when it is not that."""
    ids = list(map(_NODE_ID, placements))
    kept = list(map(set(ids).__contains__, map(_NODE_ID, before)))
    survivors = list(compress(before, kept))
    if list(map(_NODE_ID, survivors)) != ids or list(map(_SLOTS, survivors)) != list(map(_SLOTS, placements)):
        return None
    left_out = compress(before, map(not_, kept))
    return tuple(r for b in left_out for r in range(b.rank_offset, b.rank_offset + len(b.slots)))


def removed_node_ranks(previous: RankMap, rm: RankMap) -> list[int]:
    """The node ranks of `previous` that the loss-only map `rm` (`excluded_ranks`) leaves out,
    ascending: found from its excluded ranks, O(excluded x log nodes), not O(nodes)."""
    found: list[int] = []
    for rank in rm.excluded_ranks:
        p = previous.placements[bisect_right(previous.placements, rank, key=lambda p: p.rank_offset) - 1]
        if (not found or found[-1] != p.node_rank) and rm.placement(p.node_id) is None:
            found.append(p.node_rank)
    return found


def rank0_address(members: Sequence[Member], placements: Sequence[Placement], *, master: bool = False) -> str:
    """The store of a generation lives on the node holding its rank 0 (`master`: the port its
    rank 0 hosts a plain env:// store on, "" when the node offers none)."""
    if not placements:
        return ""
    node = next(m for m in members if m.node_id == placements[0].node_id)
    port = node.master_port if master else node.store_port
    if not port:
        return ""
    return join_host_port(node.host, port)
