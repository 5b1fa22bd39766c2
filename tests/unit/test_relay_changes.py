"""What a relay forwards of its nodes' frames: changes at once, progress now and then, silence
as a fact (`relay_fold.Changes`, pure)."""

from muster.coordinator.core.relay_fold import Changes, RelayedNode
from muster.v1 import muster_pb2 as pb

RUNNING, FORMING = pb.RANK_STATE_RUNNING, pb.RANK_STATE_FORMING


def frame(step, state=RUNNING, generation=1, exit_rank=None, heard_ms_ago=0):
    f = pb.NodeFrame(job="j", node_id="n", generation=generation, ranks=[
        pb.RankReport(local_rank=s, pid=100 + s, step=step, state=state, generation=generation,
                      heard_ms_ago=heard_ms_ago) for s in range(2)])
    if exit_rank is not None:
        f.exits.append(pb.RankExit(local_rank=exit_rank, pid=100 + exit_rank, exit_code=-9))
    return f


def steps(frames):
    return [f.ranks[0].step for f in frames]


def test_the_first_frame_a_change_and_the_first_advance_after_it_go_at_once():
    c, node = Changes(2.0, 1.0), RelayedNode(1, "n")
    assert steps(c.frame(node, frame(5), 0.0)) == [5]
    assert steps(c.frame(node, frame(6), 0.1)) == [6]  # the first advance: recovery is timed by it
    assert c.frame(node, frame(7), 0.2) == []  # progress only: held
    assert steps(c.frame(node, frame(7, state=FORMING, generation=2), 0.3)) == [7, 7]  # the held one first
    assert steps(c.frame(node, frame(8, generation=2), 0.4)) == [8]


def test_a_frame_bringing_a_ranks_reform_phases_goes_even_summarising():
    """The leader's recovery timeline is made of them; they may come steps after the new generation."""
    c, node = Changes(2.0, 1.0), RelayedNode(1, "n")
    c.summarising = True
    c.frame(node, frame(5, generation=2), 0.0)
    c.frame(node, frame(6, generation=2), 0.1)
    assert c.frame(node, frame(7, generation=2), 0.2) == []  # progress only: the summary's
    phased = frame(8, generation=2)
    for r in phased.ranks:
        r.reform.CopyFrom(pb.ReformPhases(generation=2, form_s=0.05))
    assert steps(c.frame(node, phased, 0.3)) == [8]


def test_progress_is_held_latest_wins_until_its_time():
    c, node = Changes(2.0, 1.0), RelayedNode(1, "n")
    c.frame(node, frame(1), 0.0)
    c.frame(node, frame(2), 0.1)
    for i, t in enumerate((0.2, 0.5, 0.9)):
        assert c.frame(node, frame(3 + i), t) == []
    assert c.due({1: node}, 1.1) == []
    assert [(s, f.ranks[0].step) for s, f in c.due({1: node}, 1.2)] == [(1, 5)]
    assert c.frame(node, frame(5), 1.3) == []  # nothing new: not even held
    assert c.due({1: node}, 5.0) == []


def test_an_exit_goes_at_once_and_a_rank_going_quiet_as_it_crosses_each_quarter_of_the_timeout():
    c, node = Changes(2.0, 1.0), RelayedNode(1, "n")
    c.frame(node, frame(1), 0.0)
    c.frame(node, frame(2), 0.1)
    assert c.frame(node, frame(2, heard_ms_ago=400), 0.2) == []
    assert len(c.frame(node, frame(2, heard_ms_ago=600), 0.3)) == 1
    assert len(c.frame(node, frame(2, heard_ms_ago=2100), 0.4)) == 1
    assert [len(f.exits) for f in c.frame(node, frame(2, exit_rank=1, heard_ms_ago=2100), 0.5)] == [1]


def test_silence_is_reported_once_and_the_node_speaking_again_goes_at_once():
    c = Changes(2.0, 1.0)
    a, b = RelayedNode(1, "a"), RelayedNode(2, "b")
    c.frame(a, frame(1), 0.0)
    c.frame(b, frame(1), 0.0)
    c.frame(b, frame(2), 1.5)
    assert c.silent([a, b], 1.9) == []
    assert [(s.stream, s.silent_ms) for s in c.silent([a, b], 2.2)] == [(1, 2200)]  # looked at every 0.25 s
    assert c.silent([a, b], 2.5) == []  # once
    assert steps(c.frame(a, frame(1), 2.6)) == [1]  # back: forwarded though nothing changed


def test_a_node_that_hangs_up_still_sends_its_held_progress():
    c, node = Changes(2.0, 1.0), RelayedNode(1, "n")
    c.frame(node, frame(1), 0.0)
    c.frame(node, frame(2), 0.1)
    c.frame(node, frame(3), 0.2)
    assert c.drop(1).ranks[0].step == 3 and c.drop(1) is None


def test_summarising_no_progress_goes_and_a_node_is_named_lagging_and_resumed_once():
    c, a, b = Changes(2.0, 1.0), RelayedNode(1, "a"), RelayedNode(2, "b")
    c.summarising = True
    for n in (a, b):
        assert steps(c.frame(n, frame(1), 0.0)) == [1]
        assert steps(c.frame(n, frame(2), 0.1)) == [2]  # the first advance still goes at once
    for i in range(3, 12):  # a advances, b stays at step 2
        assert c.frame(a, frame(i), i * 0.1) == []
        assert c.frame(b, frame(2), i * 0.1) == []
    summary, frames = c.summary([a, b], 1.2)
    assert [(lag.stream, lag.step, lag.since_ms) for lag in summary.lagging] == [(2, 2, 1100)]
    assert (summary.low_step, summary.high_step, summary.nodes, list(summary.resumed)) == (11, 11, 2, [])
    assert [(s, f.ranks[0].step) for s, f in frames] == [(1, 11)]  # the slowest's latest (b's it had)
    assert c.summary([a, b], 1.5) == (None, [])  # once an interval
    assert c.frame(a, frame(12), 2.0) == [] and c.frame(b, frame(3), 2.0) == []
    summary, frames = c.summary([a, b], 2.3)
    assert list(summary.lagging) == [] and list(summary.resumed) == [2] and summary.low_step == 3
    assert sorted(s for s, _ in frames) == [1, 2]  # at most SLOWEST of those the leader has not had


def test_not_summarising_no_summary_is_made():
    c, a = Changes(2.0, 1.0), RelayedNode(1, "a")
    c.frame(a, frame(1), 0.0)
    assert c.summary([a], 5.0) == (None, [])
