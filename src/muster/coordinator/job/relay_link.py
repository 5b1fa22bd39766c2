"""The leader's end of one Relay call (`RelayLink`): the node streams one replica relays for a job,
each an ordinary `NodeStream` of the leader (`RelayTarget`: attach, frames, detach) whose directives
go back down the call, addressed by the relay's number for the stream; what the relay says of its
nodes' silence and progress goes into the leader's liveness (`RelayWord`). What a call may make the
leader do is bounded: MAX_ITEMS of each kind a message (`check_size`), and its unread replies
(PENDING_MESSAGES).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from muster.coordinator import wire
from muster.coordinator.codes import stream_end
from muster.coordinator.core.live_records import Vouch
from muster.coordinator.core.liveness import Liveness
from muster.coordinator.core.policy import MAX_STEP
from muster.coordinator.errors import InvalidArgument, MusterError, ResourceExhausted
from muster.coordinator.quotas import refusals
from muster.coordinator.core.relay_fold import MAX_ITEMS
from muster.coordinator.job.streams import NodeStream, RelayedBy, Streams
from muster.v1 import muster_pb2 as pb

# Replies a Relay call may leave unread: a new map's directive to each of its streams, twice over,
# and this many messages' worth besides. A caller that reads none is cut off there.
PENDING_MESSAGES = 4


class RelayWord:
    """What relays say of the nodes they carry, taken into the leader's liveness: a node silent at its
    relay, and a relay's summaries, whose word stands for its nodes' progress. Only of a stream that
    is still its node's: the node may have moved on to another."""

    def __init__(self, streams: Streams, live: Liveness, clock: Callable[[], float]):
        self.streams = streams
        self.live = live
        self._clock = clock

    def silent(self, stream: NodeStream, silent_ms: int) -> None:
        """The relay carrying `stream` has heard nothing from its node for `silent_ms`."""
        if self.streams.get(stream.node_id) is stream:
            self.live.silent_since(stream.node_id, self._clock() - silent_ms / 1000)

    def summarised(self, vouch: Vouch, summary: pb.RelaySummary, streams: dict[int, NodeStream]) -> None:
        """A relay's summary of the nodes it carries (`streams`, by its numbers): its word stands for
        the progress of those not lagging. O(the nodes it names), not O(the nodes it carries)."""
        if not summary.low_step <= summary.high_step <= MAX_STEP:
            raise InvalidArgument(f"a relay summary's steps must be low <= high <= {MAX_STEP}; "
                                  f"this one's {summary.low_step} and {summary.high_step}")
        now = self._clock()
        vouch.at, vouch.low, vouch.high = now, summary.low_step, summary.high_step
        named = [(streams.get(lag.stream), lag) for lag in summary.lagging]
        for stream, lag in named:
            if stream is not None and self.streams.get(stream.node_id) is stream:
                self.live.lagging(stream.node_id, lag.step, now - lag.since_ms / 1000)
        for stream in map(streams.get, summary.resumed):
            if stream is not None and self.streams.get(stream.node_id) is stream:
                self.live.resumed(stream.node_id)


class RelayTarget(Protocol):
    """What a Relay call's streams need of the job's leader (`leader.JobLeader`)."""

    job: str
    relay_word: RelayWord

    def attach(self, first: pb.NodeFrame, *, link: RelayedBy | None = None, stream_id: int = 0) -> NodeStream: ...

    def on_frame(self, stream: NodeStream, frame: pb.NodeFrame) -> None: ...

    def detach(self, stream: NodeStream, *, relay_lost: bool = False) -> None: ...


def check_size(up: pb.RelayUp) -> int:
    """The items of a RelayUp, at most MAX_ITEMS of each kind: what it may make the leader do."""
    lagging, resumed = len(up.summary.lagging), len(up.summary.resumed)
    if max(len(up.frames), len(up.ended), len(up.silent), lagging, resumed) > MAX_ITEMS:
        raise ResourceExhausted(f"a RelayUp carries at most {MAX_ITEMS} frames, {MAX_ITEMS} ended, {MAX_ITEMS} "
                                f"silent, {MAX_ITEMS} lagging and {MAX_ITEMS} resumed streams; this one "
                                f"{len(up.frames)}, {len(up.ended)}, {len(up.silent)}, {lagging} and {resumed}")
    return len(up.frames) + len(up.ended) + len(up.silent) + lagging + resumed


class RelayLink:
    """The leader's end of one Relay call: the node streams one replica relays for this job. Each is
    an ordinary `NodeStream` of the leader whose directives go into `out`. Streams are known only by
    the numbers this call attached: facts about others are ignored, so a caller can end no stream
    it did not open, and open none without the node's secret (checked by `attach`). What a call costs
    is bounded: MAX_ITEMS of each kind a message, and its unread replies (`overflowed`)."""

    def __init__(self, leader: RelayTarget, relay: str):
        self.leader = leader
        self.job = leader.job
        self.relay = relay[:256]
        self.streams: dict[int, NodeStream] = {}  # by the relay's number
        self.last_stream = 0  # numbers only grow: a frame of an ended stream does not open it again
        self.out: list[pb.RelayedDirective | pb.RelayedMap] = []  # a map goes after the items before it
        self.pulse_due: pb.Directive | None = None  # goes with the message that empties `out`
        self.overflowed = False  # the caller left too many replies unread: the call ends
        self.ready = asyncio.Event()
        self.heard_at = asyncio.get_running_loop().time()  # the relay's last message (it keeps alive)
        self.carried_at = self.heard_at  # the last message that found node streams on this call
        self.vouch = Vouch()  # its summaries' word for its nodes' progress (one update a summary)
        self.maps = False  # it builds its nodes' parts of a loss-only map (its first message says so)

    def push(self, stream: int, item) -> None:
        """`NodeStream.send` of a relayed stream: a Directive, an error that ends the stream, or CLOSE."""
        if len(self.out) >= PENDING_MESSAGES * MAX_ITEMS + 2 * len(self.streams):
            self.overflowed = True
            self.ready.set()
            return
        if isinstance(item, pb.Directive):
            self.out.append(pb.RelayedDirective(stream=stream, directive=item))
        else:
            self.out.append(pb.RelayedDirective(stream=stream, end=stream_end(item)))
        self.ready.set()

    def push_map(self, relayed_map: pb.RelayedMap) -> None:
        """A loss-only map for every stream of this relay (`streams.RelayedMaps`), after the items before it."""
        self.out.append(relayed_map)
        self.ready.set()

    def pulse(self, directive: pb.Directive) -> None:
        """The leader's pulse for every stream of this relay: one per message, after its directives."""
        self.pulse_due = directive
        self.ready.set()

    @property
    def pending(self) -> bool:
        return bool(self.out) or self.pulse_due is not None

    def take(self) -> pb.RelayDown:
        down = pb.RelayDown()
        taken = 0
        for item in self.out[:MAX_ITEMS]:
            taken += 1
            if isinstance(item, pb.RelayedMap):
                down.map.CopyFrom(item)  # the message ends with it: the next items go after it
                break
            down.items.append(item)
        del self.out[:taken]
        if not self.out:
            if self.pulse_due is not None:
                down.pulse.CopyFrom(self.pulse_due)
                self.pulse_due = None
            self.ready.clear()
        return down

    def receive(self, up: pb.RelayUp) -> None:
        self.heard_at = asyncio.get_running_loop().time()
        self.maps = self.maps or up.maps
        if up.job != self.job:
            raise InvalidArgument(f"every message of a Relay call must name its job {self.job!r}, not "
                                  f"{wire.shown(up.job)}")
        for rf in up.frames:
            stream = self.streams.get(rf.stream)
            try:
                if stream is not None:
                    self.leader.on_frame(stream, rf.frame)
                elif rf.stream > self.last_stream:
                    self.last_stream = rf.stream
                    if rf.frame.job != self.job:
                        raise InvalidArgument(f"a frame of job {wire.shown(rf.frame.job)} on a Relay call for "
                                              f"{self.job!r}")
                    self.streams[rf.stream] = self.leader.attach(rf.frame, link=self, stream_id=rf.stream)
            except MusterError as exc:  # ends that stream alone, with its precise status
                refusals.refused("relayed_stream_refused", type(exc).__name__, str(exc)[:300], job=self.job,
                                 relay=self.relay, node=rf.frame.node_id[:256], member=rf.frame.member_id)
                self.push(rf.stream, exc)
                if stream is not None:
                    del self.streams[rf.stream]
                    self.leader.detach(stream)
        for number in up.ended:
            stream = self.streams.pop(number, None)
            if stream is not None:
                self.leader.detach(stream)
        for silent in up.silent:
            stream = self.streams.get(silent.stream)
            if stream is not None:
                self.leader.relay_word.silent(stream, silent.silent_ms)
        if up.HasField("summary"):
            self.leader.relay_word.summarised(self.vouch, up.summary, self.streams)
        if self.streams:
            self.carried_at = self.heard_at

    def close(self) -> None:
        """The call ended: its streams are gone, their nodes are not (they reconnect elsewhere)."""
        streams, self.streams = self.streams, {}
        for stream in streams.values():
            self.leader.detach(stream, relay_lost=True)

