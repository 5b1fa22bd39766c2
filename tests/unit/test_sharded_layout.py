"""A sharded job's layout: how ranks of a generation land in mesh slots (a replacement in the exact
slot lost), what register takes, and what it refuses."""

import pytest
import torch

from muster.worker import LayoutMismatch, Replicas, StateMismatch, Worker, WorkerConfig
from muster.worker.library.sharded import ShardedState, place

LAYOUT = Replicas(2, 2)


def worker(**config) -> Worker:
    return Worker(WorkerConfig(coordinators=("127.0.0.1:1",), job="j", node_id="n", **config))


def build(mesh):
    raise AssertionError("not called before a group forms")


def test_a_first_formation_places_ranks_in_order():
    assert place([-1, -1, -1, -1], LAYOUT) == [0, 1, 2, 3]


def test_survivors_keep_their_slots_and_a_replacement_takes_the_lost_one():
    # Slot 1's rank died; the survivors are ranks 0..2 of the new map, the replacement rank 3.
    assert place([0, 2, 3, -1], LAYOUT) == [0, 3, 1, 2]
    # A whole replica group lost (slots 0 and 1, a node), two fresh ranks first in the map.
    assert place([-1, -1, 2, 3], LAYOUT) == [0, 1, 2, 3]
    assert place([3, 2, -1, -1], Replicas(2, 2)) == [2, 3, 1, 0]


def test_a_shard_lost_in_every_replica_ends_the_job():
    with pytest.raises(StateMismatch, match=r"shard\(s\) \[1\].*every replica"):
        place([0, 2, -1, -1], LAYOUT)


def test_a_generation_of_another_size_is_refused():
    with pytest.raises(LayoutMismatch, match="3 ranks.*needs exactly 4"):
        place([0, 1, -1], LAYOUT)


def test_one_replica_is_refused():
    with pytest.raises(ValueError, match="at least 2"):
        Replicas(1, 4)


def test_register_takes_a_layout_and_sizes_the_job_it_may_create():
    w = worker().register(build=build, layout=Replicas(2, 4))
    assert isinstance(w.state, ShardedState) and w.model is None and w.mesh is None
    assert (w.config.world_size_multiple, w.config.max_nodes) == (8, 8)
    # Under an agent the job's sizes are `muster run`'s (--world-size-multiple, --nodes): untouched.
    w = worker(agent_socket="/x").register(build=build, layout=Replicas(2, 4))
    assert (w.config.world_size_multiple, w.config.max_nodes) == (0, 0)


def test_register_refuses_half_a_layout_or_a_model_beside_it():
    model = torch.nn.Linear(2, 2)
    for kwargs in ({"layout": LAYOUT}, {"build": build}, {"build": build, "layout": LAYOUT, "model": model}):
        with pytest.raises(TypeError, match="build= and layout= together"):
            worker().register(**kwargs)
    with pytest.raises(TypeError, match="digest_every"):
        worker(digest_every=5).register(build=build, layout=LAYOUT)
