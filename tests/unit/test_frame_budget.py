"""The frames budget of a stream: a node's Session is cut off past --max-frames-per-second
(bursts of 2 s worth); a Relay stream's budget scales with the node streams it carries."""

import pytest

from muster.coordinator.errors import ResourceExhausted
from muster.coordinator.quotas import FrameBudget
from muster.testing import FakeClock


def test_a_session_bursts_two_seconds_worth_then_is_held_to_its_rate():
    clock = FakeClock(0.0)
    budget = FrameBudget(10, clock)
    for _ in range(20):
        budget.spend()
    with pytest.raises(ResourceExhausted, match="10 frames/s per node stream"):
        budget.spend()
    clock.now += 0.1
    budget.spend()  # one frame's worth came back


def test_a_relay_stream_spends_for_all_its_node_streams_at_once():
    clock = FakeClock(0.0)
    budget = FrameBudget(10, clock)
    clock.now += 2.0
    budget.spend(frames=150, streams=10)  # refilled at 10 x 10 frames/s, up to 10 x 20
    clock.now += 0.1
    budget.spend(frames=60, streams=10)
    with pytest.raises(ResourceExhausted):
        budget.spend(frames=10, streams=10)


def test_a_relay_stream_holds_a_message_of_first_frames_ahead_of_the_streams_they_attach():
    clock = FakeClock(0.0)
    budget = FrameBudget(10, clock, floor=1024)
    budget.spend(frames=1024, streams=1)  # attaching: nothing attached yet
    with pytest.raises(ResourceExhausted):
        budget.spend(frames=1024, streams=1)  # a second message of fresh streams that attached none
    clock.now += 0.1
    budget.spend(frames=1000, streams=1000)  # once attached, the streams pay their way
