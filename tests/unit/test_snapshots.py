"""Peer snapshots' pure parts: where a slot's buddy is, which snapshot every rank rolls back to after
a loss, when a shard is lost for good; a snapshot's packing; what register takes; the snapshots a
process exiting stuck leaves for its slot's next process."""

import subprocess
import sys
import textwrap

import pytest
import torch

from muster.worker import LayoutMismatch, ShardLost, Snapshots, Worker, WorkerConfig
from muster.worker.library.snapshot_ring import Ring, pack
from muster.worker.library.snapshots import NO_LIVE_STATE, Holding, SnapshotState, buddy_stride, keep_slots, recover
from muster.worker.library.stuck import STUCK_EXIT_CODE

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
    # Snapshots taken over claim their slot unless a live rank holds it (refilled since): then it is fresh.
    assert keep_slots([-1, 0, 2, 3], 4, [False, True, False, False]) == [1, 0, 2, 3]
    assert keep_slots([0, 0, 2, 3], 4, [True, False, False, False]) == [1, 0, 2, 3]
    assert keep_slots([0, 0, 2, 3], 4, [False, False, False, False]) == [0, 1, 2, 3]


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


def test_snapshots_taken_over_without_a_live_state_roll_every_rank_back():
    # Slot 0's process exited stuck; the next one holds its snapshots but no live state, so the
    # survivors cannot keep theirs even at one step: back to the newest snapshot held for every slot.
    survivor = holding(9, (4, 8), (4, 8))
    r = recover([holding(NO_LIVE_STATE, (4, 8), (4, 8)), survivor, survivor, survivor], ONE_NODE_EACH)
    assert (r.step, r.fresh, r.receivers) == (8, (), ())
    # ...and it is the copy of its predecessor's shard that a lost buddy needs (2 nodes: slot 2's on slot 0)
    r = recover([holding(NO_LIVE_STATE, (8,), (8,), 2), holding(9, (8,), (8,), 2), None, None], ["a", "a", "b", "b"])
    assert (r.step, r.fresh, r.receivers) == (8, (2, 3), (2, 3))


def snapshot_ring(tmp_path):
    ring = Ring()
    for step in (4, 8):
        ring.own[step] = pack({"w": torch.full((3,), float(step))}, step)
        ring.held[step] = pack({"w": torch.full((5,), -float(step)), "lr": 0.1}, step)
    return ring


def test_a_ring_left_behind_is_taken_over_once_byte_for_byte(tmp_path):
    ring, path = snapshot_ring(tmp_path), str(tmp_path / "handover-slot0")
    assert Ring().leave(path, 0, 2) == 0 and not (tmp_path / "handover-slot0").exists(), "nothing held, nothing written"
    written = ring.leave(path, 1, 2)
    assert written == sum(s.nbytes for s in (*ring.own.values(), *ring.held.values()))
    assert oct((tmp_path / "handover-slot0").stat().st_mode & 0o777) == "0o600"
    again = Ring()
    assert again.take_over(path) == (1, 2)
    assert not (tmp_path / "handover-slot0").exists(), "taken once"
    for kind in ("own", "held"):
        mine, theirs = getattr(ring, kind), getattr(again, kind)
        assert sorted(mine) == sorted(theirs) == [4, 8]
        for step in (4, 8):
            assert torch.equal(mine[step].tree()["w"], theirs[step].tree()["w"])
    assert again.held[8].tree()["lr"] == 0.1
    assert Ring().take_over(path) is None


def test_a_handover_cut_short_is_refused_and_the_process_starts_without_it(tmp_path):
    path = tmp_path / "handover-slot0"
    snapshot_ring(tmp_path).leave(str(path), 1, 2)
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ValueError, match="cut short"):
        Ring().take_over(str(path))
    path = tmp_path / "handover-slot1"
    snapshot_ring(tmp_path).leave(str(path), 1, 2)
    path.write_bytes(path.read_bytes()[:-10])
    state = SnapshotState(lambda mesh: None, Snapshots(4), {}, handover=str(path))
    state._take_over()
    assert (state.slot, state.ring.own, state.ring.held) == (-1, {}, {}), "as a fresh process"


def test_a_stuck_exit_leaves_the_snapshots_behind_then_exits_even_if_that_fails(tmp_path):
    """In a real process: exit_stuck calls what was left behind, then exits with STUCK_EXIT_CODE."""
    child = textwrap.dedent(f"""
        import sys
        from muster.worker.library import stuck
        def leave():
            open({str(tmp_path / "left")!r}, "w").write("left")
            if sys.argv[1] == "fails":
                raise OSError("disk full")
        stuck.exit_stuck("a test", 3.0, leave)
    """)
    for how in ("works", "fails"):
        done = subprocess.run([sys.executable, "-c", child, how], capture_output=True, text=True, timeout=60)
        assert done.returncode == STUCK_EXIT_CODE, done.stderr
        assert (tmp_path / "left").read_text() == "left"
        assert ("leave_behind_failed" in done.stdout + done.stderr) == (how == "fails")


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
