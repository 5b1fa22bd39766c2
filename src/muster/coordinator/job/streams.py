"""The directive side of a job's node streams: each node's stream (direct, or carried by a relay)
and what the leader sends to many of them: pulses spread over their period, what an adopted
decision tells (evictions, a new map's assignments in slices, drains), an ending."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

from muster.coordinator import wire
from muster.coordinator.core.live_records import Vouch
from muster.coordinator.core.machine import Decision
from muster.coordinator.core.rankmap import removed_node_ranks
from muster.coordinator.core.state import JobState, NodeKind, Outcome, RankMap
from muster.coordinator.errors import FailedPrecondition
from muster.v1 import muster_pb2 as pb

CLOSE = object()  # queued on a NodeStream to end it
FAN_OUT_SLICE = 1_000  # directives sent between yields to the loop


class RelayedBy(Protocol):
    """What a node's stream needs of the relay carrying it (`relay_link.RelayLink`): its directives go
    into the relay's batch under the relay's number for the stream, and one pulse per relay; its
    summaries' word for the progress of the nodes it carries."""

    vouch: Vouch
    maps: bool  # it builds its nodes' parts of a loss-only map (`RelayedMaps`)

    def push(self, stream: int, item) -> None: ...

    def push_map(self, relayed_map: pb.RelayedMap) -> None: ...

    def pulse(self, directive: pb.Directive) -> None: ...


@dataclass(eq=False)
class NodeStream:
    """The directive side of one node's Session stream."""

    job: str
    node_id: str
    member_id: int
    kind: NodeKind
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    departed: bool = False  # the node left: its frames are ignored until it hangs up
    pending: bool = False  # the node is being taken back (a rebuild): its frames wait for the decision
    closed: bool = False  # the node hung up, or opened a newer session: its frames in flight are ignored
    # A node taken back after etcd lost everything may have seen higher terms than this leader's
    # (etcd's revisions restarted): its frames up to that term are no sign of a newer leader.
    term_ahead: int = 0
    # A node relayed by another replica: its directives go into that relay's batch (`RelayLink`),
    # addressed by the relay's number for the stream, instead of into `queue`.
    link: RelayedBy | None = None
    stream_id: int = 0
    seq: int = 0  # NodeFrame.stream_seq of its first frame: the member's streams counted (0: not counted)
    local_ranks: tuple[int, ...] | None = None  # of its last frame read in full: what a steps_only frame reports
    assigned: int = -1  # the generation of the last assignment sent to it (its relay holds that placement)

    def send(self, item) -> None:
        if isinstance(item, pb.Directive) and item.HasField("assignment"):
            self.assigned = item.generation
        if self.link is not None:
            self.link.push(self.stream_id, item)
        else:
            self.queue.put_nowait(item)


class Pulses:
    """The pulses of one period to the direct node streams, spread over it: a slice each tally
    tick, in the order the streams had when it began. Sent all at once, 1,000 streams' pulses held
    the loop for ~40 ms, and every node frame behind them waited (a frame's p99 was that burst).
    A stream is pulsed once a period (one that attached during it, in the next: its assignment
    came on attach)."""

    def __init__(self, every_s: float, tick_s: float):
        self.every_s, self.tick_s = every_s, tick_s
        self._began = -math.inf
        self._order: list[NodeStream] = []
        self._sent = 0

    def period_over(self, now: float) -> bool:
        return now >= self._began + self.every_s

    def start(self, streams: list[NodeStream], now: float) -> None:
        self._began, self._order, self._sent = now, streams, 0

    def send_due(self, pulse: pb.Directive, now: float) -> None:
        """The streams due by `now` (one tick ahead: the first slice goes as the period begins)."""
        share = min(1.0, (now - self._began + self.tick_s) / self.every_s)
        self._send(pulse, math.ceil(len(self._order) * share))

    def send_rest(self, pulse: pb.Directive) -> None:
        """What a period left (its ticks came late): before the next one begins."""
        self._send(pulse, len(self._order))

    def _send(self, pulse: pb.Directive, upto: int) -> None:
        for stream in self._order[self._sent:upto]:
            if not stream.closed:
                stream.send(pulse)
        self._sent = max(self._sent, upto)


class Streams(dict[str, NodeStream]):
    """The current stream of each node of one job, by node id."""

    def __init__(self, pulse_every_s: float, tick_s: float):
        super().__init__()
        self._pulses = Pulses(pulse_every_s, tick_s)
        # The state of the newest map formed at once while planned switches away from it are pending
        # (None: the current map was formed at once, or this leader did not publish the one before).
        self._base: JobState | None = None

    @property
    def relayed(self) -> bool:
        return any(s.link for s in self.values())

    def _split(self) -> tuple[list[NodeStream], set[RelayedBy]]:
        direct, links = [], set()
        for stream in self.values():
            if stream.link is None:
                direct.append(stream)
            else:
                links.add(stream.link)
        return direct, links

    def pulse(self, pulse: pb.Directive, now: float) -> None:
        """An empty directive: a node that hears nothing for heartbeat_timeout looks for the leader.
        Relayed nodes get it from their relay, which is pulsed once (not once per node)."""
        if self._pulses.period_over(now):
            self._pulses.send_rest(pulse)
            direct, links = self._split()
            for link in links:
                link.pulse(pulse)
            self._pulses.start(direct, now)
        self._pulses.send_due(pulse, now)

    def pulse_all(self, pulse: pb.Directive) -> None:
        """Every stream at once (the job started finishing: no rank may be restarted from now on)."""
        direct, links = self._split()
        for stream in direct:
            stream.send(pulse)
        for link in links:
            link.pulse(pulse)

    async def fan_out(self, directive_for: Callable[[str], pb.Directive], in_slices: bool,
                      maps: RelayedMaps | None = None) -> None:
        """Each node's own directive (not to a node that is leaving), unless its relay builds it from
        `maps`. `in_slices` (a large job): the loop is yielded between slices. A stream that attaches
        during a yield has the new map already (`bind`): a second copy is harmless."""
        streams = list(self.values())
        slice_ = FAN_OUT_SLICE if in_slices else max(1, len(streams))
        for start in range(0, len(streams), slice_):
            part = streams[start:start + slice_]
            for stream in (maps.own(part) if maps is not None else part):
                if not stream.departed:
                    stream.send(directive_for(stream.node_id))
            if in_slices:
                await asyncio.sleep(0)
        if maps is not None:
            maps.send()

    async def deliver(self, d: Decision, term: int, in_slices: bool, previous: RankMap | None = None) -> None:
        """What an adopted decision tells the nodes: the evicted their eviction (and the end of their
        stream), every node its part of a new map (a loss-only one to the relayed nodes through
        their relays, `RelayedMaps`), the leaving their drain. `previous`: the map before."""
        state = d.state
        for node_id, member_id in d.evicted:
            self.evict(node_id, member_id, wire.evicted_directive(state, "evicted: " + reason_for(state, node_id)))
        if d.new_generation:
            self._base = base_of(state, previous, self._base)
            assignments = wire.Assignments(state, d.events[-1].reason if d.events else "")
            await self.fan_out(assignments.directive, in_slices, RelayedMaps.of(state, previous, assignments.active))
        stopped = d.ended and state.outcome is Outcome.STOPPED
        for node_id, after_step in d.drains:
            stream = self.get(node_id)
            if stream:
                stream.send(pb.Directive(term=term, generation=state.generation, drain=pb.Drain(
                    after_step=after_step, reason=state.outcome_reason if stopped else reason_for(state, node_id),
                    stop=stopped)))

    def attach(self, stream: NodeStream, state: JobState, term: int, ran: int = 0) -> None:
        """`stream` is its node's from now on, and gets the node's current assignment. `ran`: the
        generation its first frame says the node runs. A node placed in the group a pending planned
        switch leaves, which it never ran (a fresh process whose Session opened after the switch was
        published, its Join before), gets that group's assignment first: it must form it with the
        others, who wait for it there and train in it up to the switch. Given the planned map alone,
        it would form that at once and wait there for them: neither side would ever form."""
        previous = self.get(stream.node_id)
        if previous is not None:
            # Its frames still in flight are no news: one would put a node its relay vouches for
            # back under this leader's silence watch, where no frame of a waiting node comes.
            previous.closed = True
            previous.send(FailedPrecondition(f"node {stream.node_id!r} opened a newer session"))
        self[stream.node_id] = stream
        if state.rebuilt_members:
            # The nodes run on in their old groups until the rebuild ends: no assignment (a
            # generation nobody published), only this leader's term.
            stream.send(pb.Directive(term=term, generation=state.generation))
        else:
            base = self._base
            if base is not None and ran < base.generation and base.rank_map.placement(stream.node_id) is not None:
                stream.send(wire.assignment_for(base, stream.node_id, "current assignment, before the planned switch"))
            stream.send(wire.assignment_for(state, stream.node_id, "current assignment"))

    def detach(self, stream: NodeStream) -> bool:
        """The stream ended; whether it was its node's current one (not replaced or evicted already)."""
        stream.closed = True
        if self.get(stream.node_id) is not stream:
            return False
        del self[stream.node_id]
        return True

    def evict(self, node_id: str, member_id: int, directive: pb.Directive) -> None:
        """The member's last directive, and the end of its stream."""
        stream = self.get(node_id)
        if stream and stream.member_id == member_id:
            del self[node_id]
            stream.send(directive)
            stream.send(CLOSE)

    def depart(self, node_id: str) -> NodeStream | None:
        """The node is leaving: its frames are ignored from now on (it is no member once the leave
        is applied)."""
        stream = self.get(node_id)
        if stream:
            stream.departed = True
        return stream

    def end_all(self, *items) -> None:
        """`items` to every stream, then none is the job's any more."""
        for stream in self.values():
            for item in items:
                stream.send(item)
        self.clear()


def base_of(state: JobState, previous: RankMap | None, base: JobState | None) -> JobState | None:
    """The newest map formed at once, as a state to build its assignments from, while `state`'s map
    is a planned switch away from it: `previous` if that one was formed at once, or the `base` kept
    through planned maps published since (None: `state`'s map was formed at once, or it follows a
    map this leader did not publish)."""
    rm = state.rank_map
    if rm is None or not rm.planned or previous is None:
        return None
    if not previous.planned:
        return replace(state, generation=previous.generation, rank_map=previous)
    return base if base is not None and base.generation < previous.generation else None


class RelayedMaps:
    """A loss-only map (`RankMap.shrink_of`) for the relayed nodes: one `RelayedMap` per relay, from
    which it renumbers the placements of shrink_of it gave its nodes; only a node it cannot renumber
    (given no such placement, left out, or with a slot down) gets a directive of its own. The
    leader's cost is a check per node and a message per relay, not a directive per node."""

    def __init__(self, state: JobState, previous: RankMap, shared: pb.Directive):
        self.state, self.rm = state, state.rank_map
        self._removed = removed_node_ranks(previous, self.rm)
        self._shared = shared
        self._maps: dict[RelayedBy, pb.RelayedMap] = {}

    @classmethod
    def of(cls, state: JobState, previous: RankMap | None, shared: pb.Directive) -> RelayedMaps | None:
        rm = state.rank_map
        if rm is None or not rm.shrink_of or previous is None or previous.generation != rm.shrink_of:
            return None
        return cls(state, previous, shared)

    def own(self, streams: list[NodeStream]) -> list[NodeStream]:
        """Of `streams`, those whose relay does not build their directive: the leader sends each its
        own (a departed one, which the caller skips, is withheld from its relay too). One pass, no
        call per stream: at 125k nodes this pass is most of what adopting a loss costs."""
        own: list[NodeStream] = []
        shrink_of, generation = self.rm.shrink_of, self.rm.generation
        placed, members, maps = self.rm.by_node, self.state.members_by_node, self._maps
        for stream in streams:
            link = stream.link
            if link is None or not link.maps:
                own.append(stream)
                continue
            member = members.get(stream.node_id)
            if (not stream.departed and stream.assigned == shrink_of and member is not None
                    and not member.down_slots and stream.node_id in placed):
                if link not in maps:
                    self._map_for(link)
                stream.assigned = generation
            else:
                self._map_for(link).own.append(stream.stream_id)  # its relay builds it nothing
                own.append(stream)
        return own

    def _map_for(self, link: RelayedBy) -> pb.RelayedMap:
        m = self._maps.get(link)
        if m is None:
            m = self._maps[link] = pb.RelayedMap(directive=self._shared, removed_node_ranks=self._removed)
        return m

    def send(self) -> None:
        for link, m in self._maps.items():
            link.push_map(m)


def reason_for(state: JobState, node_id: str) -> str:
    """Why the node is no member: the last change that named it."""
    for e in reversed(state.history):
        if node_id in e.nodes and e.kind != "generation":
            return f"{e.kind}: {e.reason}"
    return "no longer a member"
