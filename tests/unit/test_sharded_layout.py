"""A sharded job's layout: how ranks of a generation land in mesh slots (a replacement in the exact
slot lost), what register takes, and what it refuses."""

import pytest
import torch

from muster.worker import LayoutMismatch, Replicas, StateMismatch, Worker, WorkerConfig
from muster.worker.library.sharded import Placement, ShardedState, place

LAYOUT = Replicas(2, 2)


def worker(**config) -> Worker:
    return Worker(WorkerConfig(coordinators=("127.0.0.1:1",), job="j", node_id="n", **config))


def build(mesh):
    raise AssertionError("not called before a group forms")


def fresh(n: int) -> list[tuple[int, int]]:
    return [(-1, 0)] * n


def test_a_first_formation_places_ranks_in_order_and_trains_on_the_whole_mesh_only():
    assert place(fresh(4), LAYOUT) == Placement((0, 1, 2, 3), (0, 1), 0)
    # Fewer ranks than slots: every shard comes from `build`, and a partial start is not trained.
    assert place(fresh(3), LAYOUT) == Placement((0, 1, 2, -1), (), 0)


def test_survivors_keep_their_slots_and_a_replacement_takes_the_lost_one():
    # Slot 1's rank died; the survivors are ranks 0..2 of the new map, the replacement rank 3.
    assert place([(0, 5), (2, 5), (3, 5), (-1, 0)], LAYOUT) == Placement((0, 3, 1, 2), (0, 1), 5)
    # A whole replica group lost (slots 0 and 1, a node), two fresh ranks first in the map.
    assert place([(-1, 0), (-1, 0), (2, 5), (3, 5)], LAYOUT).rank_of_slot == (0, 1, 2, 3)
    assert place([(3, 5), (2, 5), (-1, 0), (-1, 0)], LAYOUT).rank_of_slot == (2, 3, 1, 0)


def test_a_group_short_of_a_rank_is_benched_and_the_others_train():
    p = place([(0, 5), (2, 5), (3, 5)], LAYOUT)
    assert p == Placement((0, -1, 1, 2), (1,), 5)
    assert "replica group 0 lacks slot(s) [1]" in p.why_benched(0, LAYOUT)
    # A whole group lost: the other trains alone.
    assert place([(2, 5), (3, 5)], LAYOUT) == Placement((-1, -1, 0, 1), (1,), 5)


def test_a_benched_group_rejoins_when_filled_behind_the_others():
    # Slot 0 sat out at step 5 while replica 1 went on to step 9; a replacement fills slot 1.
    assert place([(0, 5), (2, 9), (3, 9), (-1, 0)], LAYOUT) == Placement((0, 3, 1, 2), (0, 1), 9)


def test_a_fresh_rank_fills_the_group_it_completes_first():
    layout = Replicas(3, 2)
    # Group 0 lost both ranks, group 1 one (slot 3): the one fresh rank completes group 1.
    p = place([(2, 7), (4, 7), (5, 7), (-1, 0)], layout)
    assert p.rank_of_slot == (-1, -1, 0, 3, 1, 2) and p.training == (1, 2)


def test_complete_groups_that_lack_a_shard_at_the_step_wait_for_the_rest():
    # Slots 1 and 2 were lost together: a replacement completes group 0, but shard 1 at step 5 is
    # only in slot 3, whose group is still short: nobody trains until it is complete too.
    p = place([(0, 5), (3, 5), (-1, 0)], LAYOUT)
    assert p == Placement((0, 2, -1, 1), (), 5)
    assert "lack a shard at step 5" in p.why_benched(0, LAYOUT)


def test_a_shard_lost_in_every_replica_ends_the_job():
    with pytest.raises(StateMismatch, match=r"shard\(s\) \[1\].*step 5.*every replica"):
        place([(0, 5), (2, 5), (-1, 0), (-1, 0)], LAYOUT)
    # Its only copy at the job's step lost: the benched group's older one is no substitute.
    with pytest.raises(StateMismatch, match=r"shard\(s\) \[0\].*step 9"):
        place([(0, 5), (3, 9), (-1, 0)], LAYOUT)


def test_a_shard_held_only_outside_the_generation_is_waited_for_not_called_lost():
    # The issue-55 map: one rank of each replica group (slots 0 and 2, both shard 0), the other
    # group's healthy rank (slot 3, shard 1) left out by the size rule: every rank waits for it.
    p = place([(0, 17), (2, 17)], LAYOUT, left_out=1)
    assert p == Placement((0, -1, 1, -1), (), 17, (1,))
    assert "no rank of this generation holds shard(s) [1] at step 17" in p.why_benched(1, LAYOUT)
    with pytest.raises(StateMismatch, match=r"shard\(s\) \[1\]"):
        place([(0, 17), (2, 17)], LAYOUT, left_out=0)  # nobody outside: lost


def test_a_generation_larger_than_the_layout_is_refused():
    with pytest.raises(LayoutMismatch, match="5 ranks.*has 4 slots"):
        place(fresh(5), LAYOUT)


def test_one_replica_is_refused():
    with pytest.raises(ValueError, match="at least 2"):
        Replicas(1, 4)


def test_register_takes_a_layout_and_sizes_the_job_it_may_create():
    w = worker().register(build=build, layout=Replicas(2, 4))
    assert isinstance(w.state, ShardedState) and w.model is None and w.mesh is None
    # One replica group at least (the others may be out), the whole mesh at most (more: spares).
    assert (w.config.min_nodes, w.config.world_size_multiple, w.config.max_nodes) == (4, 0, 8)
    # Under an agent the job's sizes are `muster run`'s (--world-size-multiple, --nodes): untouched.
    w = worker(agent_socket="/x").register(build=build, layout=Replicas(2, 4))
    assert (w.config.min_nodes, w.config.world_size_multiple, w.config.max_nodes) == (0, 0, 0)


def test_register_refuses_half_a_layout_or_a_model_beside_it():
    model = torch.nn.Linear(2, 2)
    for kwargs in ({"layout": LAYOUT}, {"build": build}, {"build": build, "layout": LAYOUT, "model": model}):
        with pytest.raises(TypeError, match="build= and layout= together"):
            worker().register(**kwargs)
    with pytest.raises(TypeError, match="digest_every"):
        worker(digest_every=5).register(build=build, layout=LAYOUT)
