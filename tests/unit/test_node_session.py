"""NodeSession's frame timing: each node keeps its own phase in the heartbeat interval."""

import statistics
import time

from muster.worker.node_session import NodeIdentity, NodeSession


def session(node_id: str, interval_s: float = 0.1) -> NodeSession:
    s = NodeSession("127.0.0.1:1", NodeIdentity("job", node_id, 1, "127.0.0.1", 1), reports=list,
                    on_directive=lambda d: None)
    s.heartbeat_interval_s = interval_s
    return s


def test_nodes_report_at_their_own_phase_spread_over_the_interval():
    now = time.time()
    # When each node's next frame falls, as a fraction of the interval: spread, not a burst.
    phases = sorted(((now + session(f"node-{i:05d}")._until_next_frame()) % 0.1) / 0.1 for i in range(1000))
    assert max(b - a for a, b in zip(phases, phases[1:])) < 0.02
    assert 0.4 < statistics.median(phases) < 0.6


def test_the_wait_is_never_shorter_than_half_an_interval_nor_longer_than_one_and_a_half():
    for i in range(200):
        wait = session(f"n{i}", 2.0)._until_next_frame()
        assert 1.0 <= wait < 3.0


def test_a_node_keeps_its_phase_across_sessions():
    first = time.time() + session("node-a")._until_next_frame()
    again = time.time() + session("node-a")._until_next_frame()  # a new stream, e.g. after a leader change
    apart = (first - again) % 0.1
    assert min(apart, 0.1 - apart) < 0.002
