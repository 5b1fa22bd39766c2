"""A relay's batch: each node's latest frame wins, exits are merged and never dropped, a first
frame's proof survives being superseded, and exits or hang-ups ask for a flush at once."""

from muster.client import relay_of
from muster.coordinator.core.relay_fold import MAX_ITEMS, FrameBatch
from muster.v1 import muster_pb2 as pb


def frame(node: str, step: int, *exit_pids: int, secret: bytes = b"") -> pb.NodeFrame:
    f = pb.NodeFrame(job="j", node_id=node, member_id=1, generation=3, session_secret=secret,
                     ranks=[pb.RankReport(local_rank=0, step=step, state=pb.RANK_STATE_RUNNING)],
                     exits=[pb.RankExit(local_rank=1, pid=p, exit_code=-9) for p in exit_pids])
    if secret:
        f.rejoin.CopyFrom(pb.JoinRequest(job="j", node_id=node, slots=2))
        f.via_relay = True
    return f


def test_only_the_latest_frame_of_each_stream_is_sent():
    batch = FrameBatch()
    for step in range(1, 6):
        assert not batch.add(1, frame("a", step))
    batch.add(2, frame("b", 7))
    up = batch.take("j", "r:1")
    assert [(rf.stream, rf.frame.ranks[0].step) for rf in up.frames] == [(1, 5), (2, 7)]
    assert up.job == "j" and up.relay == "r:1"
    assert not batch and not batch.take("j", "r:1").frames


def test_exits_of_superseded_frames_are_merged_into_the_latest_in_order():
    batch = FrameBatch()
    assert batch.add(1, frame("a", 1, 100))
    assert not batch.add(1, frame("a", 2))
    assert batch.add(1, frame("a", 3, 101))
    (rf,) = batch.take("j", "r").frames
    assert rf.frame.ranks[0].step == 3
    assert [e.pid for e in rf.frame.exits] == [100, 101]


def test_a_first_frame_superseded_keeps_its_secret_and_identity():
    batch = FrameBatch()
    first = frame("a", 0, secret=b"s" * 32)
    first.stream_seq, first.run = 7, 2
    batch.add(4, first)
    batch.add(4, frame("a", 1))
    (rf,) = batch.take("j", "r").frames
    assert rf.frame.session_secret == b"s" * 32 and rf.frame.via_relay
    assert rf.frame.rejoin.node_id == "a" and rf.frame.ranks[0].step == 1
    # its stream's number: a leader refuses it as stale once the node opened a newer stream elsewhere
    assert (rf.frame.stream_seq, rf.frame.run) == (7, 2)


def test_a_hang_up_asks_for_a_flush_and_the_pending_frame_still_goes():
    batch = FrameBatch()
    batch.add(1, frame("a", 1, 100))
    assert batch.end(1)
    up = batch.take("j", "r")
    assert list(up.ended) == [1] and [e.pid for e in up.frames[0].frame.exits] == [100]


def test_a_batch_put_back_goes_again_under_what_came_since():
    batch = FrameBatch()
    batch.add(1, frame("a", 1, 100, secret=b"s" * 32))
    batch.add(2, frame("b", 1))
    batch.end(3)
    lost = batch.take("j", "r")
    batch.add(1, frame("a", 2, 101))
    batch.add(5, frame("c", 1, secret=b"t" * 32))
    batch.put_back(lost)
    up = batch.take("j", "r")
    assert [rf.stream for rf in up.frames] == [1, 2, 5]  # new streams keep ascending numbers
    first = up.frames[0].frame
    assert first.ranks[0].step == 2 and [e.pid for e in first.exits] == [100, 101]
    assert first.session_secret == b"s" * 32
    assert list(up.ended) == [3]


def test_relay_choice_is_stable_and_spreads_nodes():
    addresses = ["10.0.0.1:7600", "10.0.0.2:7600", "10.0.0.3:7600"]
    picks = [relay_of(f"node-{i:05d}", addresses) for i in range(3000)]
    assert picks == [relay_of(f"node-{i:05d}", list(reversed(addresses))) for i in range(3000)]
    counts = {a: picks.count(a) for a in addresses}
    assert all(800 < c < 1200 for c in counts.values()), counts
    # a replica removed moves only its own nodes
    fewer = addresses[:2]
    moved = sum(1 for i, p in enumerate(picks) if p in fewer and relay_of(f"node-{i:05d}", fewer) != p)
    assert moved == 0


def test_a_batch_larger_than_one_message_goes_in_order_over_several():
    batch = FrameBatch()
    for stream in range(1, MAX_ITEMS + 6):
        batch.add(stream, frame(f"n{stream}", 1))
    first, second = batch.take("j", "r"), batch.take("j", "r")
    assert [rf.stream for rf in first.frames] == list(range(1, MAX_ITEMS + 1))
    assert [rf.stream for rf in second.frames] == list(range(MAX_ITEMS + 1, MAX_ITEMS + 6))
    assert not batch


def test_a_message_carries_at_most_max_items_of_each_kind_and_no_end_before_its_streams_frame():
    batch = FrameBatch()
    for stream in range(1, MAX_ITEMS + 3):
        batch.add(stream, frame("a", 1))
        batch.end(stream)
    batch.silent.extend(pb.SilentStream(stream=s) for s in range(1, MAX_ITEMS + 3))
    first = batch.take("j", "r")
    assert len(first.frames) == len(first.ended) == len(first.silent) == MAX_ITEMS
    assert list(first.ended) == list(range(1, MAX_ITEMS + 1)), "the ends of streams whose frame went"
    second = batch.take("j", "r")
    assert [rf.stream for rf in second.frames] == list(second.ended) == [MAX_ITEMS + 1, MAX_ITEMS + 2]
    assert len(second.silent) == 2 and not batch
