"""Rank assignment: the invariants every rank map keeps, by property tests and examples."""

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from muster.coordinator.core.policy import JobSpec
from muster.coordinator.core.rankmap import assign_ranks
from muster.coordinator.core.state import Member, Placement, RankMap


def member(i, slots=2, down=()):
    return Member(f"n{i}", i, f"10.0.0.{i}", 29500, slots, i, down_slots=frozenset(down))


def as_map(assignment, generation=1):
    return RankMap(generation, assignment.world_size, assignment.placements, "", False, 0)


def global_ranks(assignment):
    return {(p.node_id, slot): p.rank_of(slot) for p in assignment.placements for slot in p.slots}


nodes_strategy = st.lists(
    st.tuples(st.integers(1, 8), st.sets(st.integers(0, 7), max_size=3)), min_size=1, max_size=12
).map(lambda specs: [member(i + 1, slots, {d for d in down if d < slots}) for i, (slots, down) in enumerate(specs)])
spec_strategy = st.builds(
    lambda lo, extra, mult: JobSpec(lo, lo + extra, mult),
    st.integers(1, 4), st.integers(0, 8), st.sampled_from([1, 1, 2, 4, 8]),
)


def check_invariants(members, spec, a):
    ranks = sorted(global_ranks(a).values())
    assert ranks == list(range(a.world_size)), "ranks are a permutation of 0..world_size-1"
    assert a.world_size % spec.world_size_multiple == 0
    if a.runnable:
        assert spec.min_nodes <= len(a.placements) <= spec.max_nodes
    by_id = {m.node_id: m for m in members}
    for p in a.placements:
        assert list(p.slots) == sorted(p.slots) and set(p.slots) <= set(by_id[p.node_id].usable_slots)
        node_ranks = [p.rank_of(s) for s in p.slots]
        assert node_ranks == list(range(p.rank_offset, p.rank_offset + len(p.slots))), "contiguous per node"
    assert [p.node_rank for p in a.placements] == list(range(len(a.placements)))
    if a.runnable:
        assert a.left_out == sum(len(m.usable_slots) for m in members) - a.world_size


@settings(max_examples=300, deadline=None)
@given(nodes_strategy, spec_strategy)
def test_every_map_is_a_contiguous_permutation_within_bounds(members, spec):
    check_invariants(members, spec, assign_ranks(members, None, spec))


@settings(max_examples=300, deadline=None)
@given(nodes_strategy, spec_strategy, st.data())
def test_survivors_keep_relative_order_and_rank0_stays_with_its_node(members, spec, data):
    before = assign_ranks(members, None, spec)
    if not before.runnable:
        return
    lost = data.draw(st.sets(st.sampled_from([m.node_id for m in members])))
    survivors = [m for m in members if m.node_id not in lost]
    after = assign_ranks(survivors, as_map(before), spec)
    check_invariants(survivors, spec, after)
    old, new = global_ranks(before), global_ranks(after)
    kept = [k for k in old if k in new]
    assert sorted(kept, key=old.get) == sorted(kept, key=new.get), "survivors keep relative order"
    rank0 = before.placements[0].node_id
    if after.runnable and rank0 not in lost and after.placements[0].node_id != rank0:
        # only a multiple that trims every slot of the old rank-0 node may move rank 0
        assert rank0 not in {p.node_id for p in after.placements}


@settings(max_examples=300, deadline=None)
@given(nodes_strategy, spec_strategy, st.data())
def test_a_new_map_keeps_its_unchanged_placements_and_a_renumbered_ones_text(members, spec, data):
    """The next map after losses and joins reuses what did not change: a placement with the same
    numbers and slots is the previous map's own object (a loss-only check takes the untouched prefix
    by identity), and every placement's encoded text is its node and slots, numbers left out, so a
    renumbered one encodes as before (its state pages stay compressed)."""
    before = assign_ranks(members, None, spec)
    if not before.runnable:
        return
    lost = data.draw(st.sets(st.sampled_from([m.node_id for m in members])))
    sizes = data.draw(st.lists(st.integers(1, 8), max_size=3))
    joined = [member(len(members) + 1 + i, slots) for i, slots in enumerate(sizes)]
    now = [m for m in members if m.node_id not in lost] + joined
    previous = as_map(before)
    after = assign_ranks(now, previous, spec)
    check_invariants(now, spec, after)
    for p in after.placements:
        was = previous.placement(p.node_id)
        if was is not None and (was.node_rank, was.rank_offset, was.slots) == (p.node_rank, p.rank_offset, p.slots):
            assert p is was
        assert p.json == Placement(p.node_id, 0, 0, p.slots).json
        assert p.json == json.dumps({"node_id": p.node_id, "slots": list(p.slots)}, separators=(",", ":"))


def test_first_map_puts_rank0_on_the_oldest_node_and_ranks_follow_slots():
    a = assign_ranks([member(3, 2), member(1, 2), member(2, 2)], None, JobSpec())
    assert [p.node_id for p in a.placements] == ["n1", "n2", "n3"]
    assert a.world_size == 6
    assert a.placements[1].rank_of(1) == 3


def test_a_failed_slot_keeps_the_local_rank_of_the_others():
    a = assign_ranks([member(1, 4, down={1})], None, JobSpec())
    assert a.placements[0].slots == (0, 2, 3)
    assert a.placements[0].rank_of(2) == 1


def test_nodes_beyond_max_nodes_wait_as_spares_and_are_promoted_on_failure():
    spec = JobSpec(1, 2, 1)
    first = assign_ranks([member(1), member(2), member(3)], None, spec)
    assert [p.node_id for p in first.placements] == ["n1", "n2"]
    second = assign_ranks([member(2), member(3)], as_map(first), spec)
    assert [p.node_id for p in second.placements] == ["n2", "n3"]


def test_world_size_multiple_trims_slots_from_the_youngest_node():
    a = assign_ranks([member(1, 4), member(2, 4), member(3, 2)], None, JobSpec(1, 8, 4))
    assert a.world_size == 8
    assert [p.node_id for p in a.placements] == ["n1", "n2"]


def test_a_cut_leaves_out_a_node_short_of_slots_rather_than_split_a_whole_one():
    # Replicas(2, 2) with a replica group per node (--world-size-multiple 2): one rank lost, 3 usable
    # slots. Cutting the tail took one rank of each group (issue 55); the short node goes out whole.
    spec = JobSpec(1, 2, 2)
    first = as_map(assign_ranks([member(1), member(2)], None, spec))
    for lost_on, kept in (("n1", "n2"), ("n2", "n1")):
        members = [member(i, down={1} if f"n{i}" == lost_on else ()) for i in (1, 2)]
        a = assign_ranks(members, first, spec)
        assert [(p.node_id, p.slots) for p in a.placements] == [(kept, (0, 1))]
        assert (a.world_size, a.left_out) == (2, 1)
    # A short node larger than the cut stays; the cut comes from the tail as before.
    a = assign_ranks([member(1, 4, down={0}), member(2, 4)], None, JobSpec(1, 2, 2))
    assert [(p.node_id, p.slots) for p in a.placements] == [("n1", (1, 2, 3)), ("n2", (0, 1, 2))]
    assert a.left_out == 1


def test_below_min_nodes_the_job_cannot_run_and_says_why():
    a = assign_ranks([member(1)], None, JobSpec(2, 4, 1))
    assert not a.runnable
    assert "min_nodes=2" in a.reason


def test_excluded_ranks_only_for_a_map_that_only_removes_ranks_in_order():
    from muster.coordinator.core.rankmap import excluded_ranks

    members = [member(1), member(2), member(3)]
    before = as_map(assign_ranks(members, None, JobSpec(1, 3, 1)))
    assert excluded_ranks(None, before.placements) == ()
    assert excluded_ranks(before, before.placements) == ()  # nobody left out
    lost_n2 = assign_ranks([members[0], members[2]], before, JobSpec(1, 3, 1))
    assert excluded_ranks(before, lost_n2.placements) == (2, 3)
    lost_slot = assign_ranks([member(1), member(2, down={1}), member(3)], before, JobSpec(1, 3, 1))
    assert excluded_ranks(before, lost_slot.placements) == (3,)
    joined = assign_ranks([members[0], members[2], member(4)], before, JobSpec(1, 3, 1))
    assert excluded_ranks(before, joined.placements) == ()  # n4 is new: a full init


@settings(max_examples=200, deadline=None)
@given(nodes_strategy, spec_strategy, st.data())
def test_a_shrink_renumbers_survivors_exactly_as_the_new_map_does(members, spec, data):
    """NCCL's comm shrink numbers the survivors in their old order: wherever the leader offers a
    shrink, that order is the new map's ranks."""
    from muster.coordinator.core.rankmap import excluded_ranks

    before = assign_ranks(members, None, spec)
    if not before.runnable:
        return
    lost = data.draw(st.sets(st.sampled_from([m.node_id for m in members])))
    after = assign_ranks([m for m in members if m.node_id not in lost], as_map(before), spec)
    excluded = excluded_ranks(as_map(before), after.placements)
    if excluded:
        old, new = global_ranks(before), global_ranks(after)
        survivors = sorted(set(range(before.world_size)) - set(excluded))
        assert sorted(new, key=new.get) == sorted(new, key=old.get)  # the same order
        assert [old[k] for k in sorted(new, key=new.get)] == survivors


def reference_excluded(previous, placements):
    """excluded_ranks by its definition, rank by rank."""
    kept = []
    for p in placements:
        before = previous.placement(p.node_id)
        if before is None or not set(p.slots) <= set(before.slots):
            return ()
        kept.extend(before.rank_of(slot) for slot in p.slots)
    if len(kept) >= previous.world_size or any(b <= a for a, b in zip(kept, kept[1:])):
        return ()
    return tuple(sorted(set(range(previous.world_size)).difference(kept)))


@settings(max_examples=300, deadline=None)
@given(nodes_strategy, spec_strategy, st.data())
def test_excluded_ranks_is_its_definition_over_lost_nodes_slots_and_joins(members, spec, data):
    """excluded_ranks works per node (O(nodes) at 100k ranks): the same answer as rank by rank."""
    from muster.coordinator.core.rankmap import excluded_ranks

    before = assign_ranks(members, None, spec)
    if not before.runnable:
        return
    lost = data.draw(st.sets(st.sampled_from([m.node_id for m in members])))
    after_members = [member(int(m.node_id[1:]), m.slots,
                            set(m.down_slots) | data.draw(st.sets(st.integers(0, m.slots - 1), max_size=2)))
                     for m in members if m.node_id not in lost]
    if data.draw(st.booleans()):
        after_members.append(member(99, 2))
    after = assign_ranks(after_members, as_map(before), spec)
    assert excluded_ranks(as_map(before), after.placements) == reference_excluded(as_map(before), after.placements)
