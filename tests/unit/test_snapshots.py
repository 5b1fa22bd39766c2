"""Peer snapshots' pure parts: where a slot's buddy is, which snapshot every rank rolls back to after
a loss, when a shard is lost for good; a snapshot's packing; what register takes."""

import pytest
import torch

from muster.worker import LayoutMismatch, ShardLost, Snapshots, Worker, WorkerConfig
from muster.worker.library.snapshot_ring import pack
from muster.worker.library.snapshots import Holding, SnapshotState, buddy_stride, keep_slots, recover

ONE_NODE_EACH = ["a", "b", "c", "d"]


def holding(step, own=(), held=(), stride=1):
    return Holding(step, tuple(own), tuple(held), stride)


def test_a_buddy_is_on_another_node_where_there_is_one():
    assert buddy_stride(ONE_NODE_EACH) == 1
    assert buddy_stride(["a", "a", "b", "b"]) == 2  # 2 nodes x 2 slots: slot 0's copy on slot 2
    assert buddy_stride(["a", "a", "a", "b", "b", "b"]) == 3
    assert buddy_stride(["a", "a", "a", "a"]) == 1  # one node: the next slot


def test_slots_are_kept_and_a_fresh_process_takes_the_free_one():
    assert keep_slots([-1, -1, -1, -1], 4) == [0, 1, 2, 3]
    assert keep_slots([0, 2, 3, -1], 4) == [0, 3, 1, 2]  # slot 1 lost, its replacement numbered last
    with pytest.raises(LayoutMismatch, match="3 ranks.*exactly 4.*stays fixed"):
        keep_slots([0, 1, -1], 4)


def test_a_first_formation_keeps_every_built_state_and_places_buddies():
    r = recover([None] * 4, ["a", "a", "b", "b"])
    assert (r.step, r.stride, r.fresh) == (None, 2, ())


def test_without_a_loss_at_one_step_nothing_rolls_back():
    r = recover([holding(7, (0, 4), (0, 4))] * 4, ONE_NODE_EACH)
    assert (r.step, r.fresh) == (None, ())


def test_a_lost_slot_rolls_every_rank_back_to_the_newest_snapshot_all_slots_hold():
    # Snapshot 8 was in flight when slot 1 died: slot 2 (its buddy) holds only 4 of it completely.
    survivor = holding(9, (4, 8), (4, 8))
    r = recover([survivor, None, holding(9, (4, 8), (4,)), survivor], ONE_NODE_EACH)
    assert (r.step, r.fresh, r.receivers, r.buddy(1, 4)) == (4, (1,), (1,), 2)
    # Every copy of 8 complete: back to 8, one step redone.
    r = recover([survivor, None, survivor, survivor], ONE_NODE_EACH)
    assert r.step == 8


def test_a_survivor_whose_own_copy_was_replaced_takes_it_from_its_buddy_too():
    # Slot 2 holds slot 1's 4 only, and took its own 12 into the buffer of its own 4.
    r = recover([holding(13, (4, 8), (4, 8)), None, holding(13, (8, 12), (4,)), holding(13, (4, 8), (4, 8))],
                ONE_NODE_EACH)
    assert (r.step, r.fresh, r.receivers) == (4, (1,), (1, 2))


def test_ranks_at_different_steps_roll_back_even_without_a_loss():
    r = recover([holding(9, (4, 8), (4, 8)), holding(8, (4, 8), (4, 8))], ["a", "b"])
    assert r.step == 8 and r.fresh == ()


def test_a_rank_lost_with_its_buddy_ends_the_job():
    survivor = holding(9, (4, 8), (4, 8))
    with pytest.raises(ShardLost, match="slot 1 and its buddy slot 2.*both lost.*checkpoint"):
        recover([survivor, None, None, survivor], ONE_NODE_EACH)
    # On two nodes (stride 2) the same two slots are not each other's buddies: recoverable.
    r = recover([holding(9, (8,), (8,), 2), None, None, holding(9, (8,), (8,), 2)], ["a", "a", "b", "b"])
    assert r.step == 8 and r.fresh == (1, 2)


def test_no_snapshot_held_for_every_slot_ends_the_job():
    with pytest.raises(ShardLost, match="no snapshot step is held for every slot"):
        recover([holding(1, (0,), ()), None, holding(1, (0,), ()), holding(1, (0,), ())], ONE_NODE_EACH)


def test_a_holding_travels_as_text():
    h = holding(9, (4, 8), (4,), 2)
    assert Holding.decode(h.encode()) == h and Holding.decode(None) is None


def test_a_snapshot_unpacks_to_clones_of_what_was_packed():
    state = {"model": {"w": torch.arange(6.0).view(2, 3), "b": torch.ones(3, dtype=torch.float64)},
             "optimizer": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
             "extras": {"data": {"epoch": 4}}}
    snap = pack(state, 4)
    again = pack(state, 4, reuse=snap.data)
    assert again.data.data_ptr() == snap.data.data_ptr(), "a buffer large enough is reused"
    tree = snap.tree()
    assert torch.equal(tree["model"]["w"], state["model"]["w"]) and tree["model"]["b"].dtype == torch.float64
    assert tree["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    assert tree["extras"]["data"] == {"epoch": 4}
    tree["model"]["w"].add_(1)
    assert torch.equal(snap.tree()["model"]["w"], state["model"]["w"]), "loaded tensors never alias the buffer"


def test_register_takes_a_snapshots_layout_and_sizes_the_job():
    w = Worker(WorkerConfig(coordinators=("127.0.0.1:1",), job="j", node_id="n")).register(
        build=lambda mesh: None, layout=Snapshots(4, every=5))
    assert isinstance(w.state, SnapshotState) and (w.config.world_size_multiple, w.config.max_nodes) == (4, 4)
    assert Snapshots(4).every == 10
    with pytest.raises(ValueError, match="at least 2"):
        Snapshots(1)
    with pytest.raises(ValueError, match="every"):
        Snapshots(4, every=0)
