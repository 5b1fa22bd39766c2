"""Relays: a replica terminates the node streams of a job it does not lead and carries them to the
job's leader on one multiplexed `Relay` stream, so that the leader reads one message per relay and
batch window instead of one per node frame.

Up, each batch holds each node's latest frame only (its exits merged in, never dropped; a batch
with an exit goes at once), the streams that ended and the nodes found silent. Only changes go
up: a frame that changes what the leader judges by (rank states, pids, generations, phases,
digests, exits) goes in the next batch (the first advance after a change too: recovery is timed
by it); a frame with nothing new is not sent at all. The relay vouches for its nodes' liveness
instead: it judges their silence with the heartbeat timeout and says so; and, to a leader that
asks for it, for their progress: one `RelaySummary` every `progress_s` stands for every node's
frames that only advance steps, naming only the nodes that start or stop lagging. So the leader's
work is O(relays + changes), not O(nodes x frame rate). (To a leader before summaries, such a
frame is held, the latest replacing the last, and goes once `progress_s` has passed.) Down, the
leader's directives come back addressed by stream and are fanned out; a loss-only new map comes
once for all the relay's nodes (`RelayedMap`), and the relay renumbers each node's placement
itself (`renumbered`). `FrameBatch` is the folding (pure), `RelayLink` the leader's
end of one Relay call, `Relay` the relaying replica's end.
"""

from __future__ import annotations

import asyncio
import bisect
import heapq
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc
import structlog

from muster.client import leader_hint
from muster.coordinator import wire
from muster.coordinator.auth import Tokens
from muster.coordinator.core.live_records import Vouch
from muster.coordinator.errors import InvalidArgument, MusterError, ResourceExhausted
from muster.coordinator.quotas import refusals
from muster.net import Backoff
from muster.security import ClientSecurity, TlsFiles
from muster.v1 import muster_pb2 as pb
from muster.v1 import muster_pb2_grpc as pb_grpc

log = structlog.get_logger(__name__)

# Items per Relay message, either way: a new generation's assignments to thousands of relayed nodes
# must stay well under the gRPC message limit (1 MiB by default); the rest go in the next message.
# Up, it is also the most of each kind (frames, ended, silent) the leader takes in one message: what
# one message may make the leader's loop do (a refused attach each, at worst) is bounded.
MAX_ITEMS = 1024
# How a leader refuses a Relay call for a job whose nodes it does not relay: they go to it at once.
NOT_RELAYED = grpc.StatusCode.FAILED_PRECONDITION.name
# Replies a Relay call may leave unread: a new map's directive to each of its streams, twice over,
# and this many messages' worth besides. A caller that reads none is cut off there.
PENDING_MESSAGES = 4
PULSE_SLICE = 64  # node streams a relay pulses per turn of its loop
LAG_STEPS = 3  # a summarised node is lagging once its slowest rank has not advanced for this many step times
SLOWEST = 2  # nodes whose latest frame a summary brings along, by their ranks' compute time
RETRY_MOST_S = 0.5  # a relay's attempts on the leader back off to this (or heartbeat_timeout/8), jittered x2


# ---- folding (pure) --------------------------------------------------------------------------


def fold(older: pb.NodeFrame, newer: pb.NodeFrame) -> pb.NodeFrame:
    """`newer` superseding `older` within one batch: the newer ranks and view win; the older's exits
    come first and are kept, and so are a first frame's secret and identity (the leader
    authenticates the stream with them) and its stream's number (by which the leader refuses a
    stream the node has since replaced: without it, a first frame held while the relay had no
    leader displaced the node's newer direct stream, and the node took that for its eviction).
    `newer` is updated in place and returned."""
    if older.exits:
        exits = [*older.exits, *newer.exits]
        del newer.exits[:]
        newer.exits.extend(exits)
    if older.session_secret and not newer.session_secret:
        newer.session_secret = older.session_secret
        newer.via_relay, newer.run, newer.stream_seq = older.via_relay, older.run, older.stream_seq
        if older.HasField("rejoin"):
            newer.rejoin.CopyFrom(older.rejoin)
    return newer


class FrameBatch:
    """What a relay sends next: the latest frame of each stream since the last batch, and the
    streams that ended. Frames keep the order of their stream's first frame in the batch, so a new
    stream's number is never behind another new one's."""

    def __init__(self) -> None:
        self.frames: dict[int, pb.NodeFrame] = {}
        self.ended: list[int] = []
        self.silent: list[pb.SilentStream] = []
        self.summary: pb.RelaySummary | None = None  # goes with the message that takes the last frame

    def __bool__(self) -> bool:
        return bool(self.frames or self.ended or self.silent or self.summary)

    def add(self, stream: int, frame: pb.NodeFrame) -> bool:
        """Keep `frame` as the stream's latest; True when the batch should go at once (an exit)."""
        urgent = bool(frame.exits)
        older = self.frames.get(stream)
        self.frames[stream] = frame if older is None else fold(older, frame)
        return urgent

    def end(self, stream: int) -> bool:
        """The stream's node hung up; its pending frame still goes (it may hold exits). Urgent: for a
        process node a hang-up is its exit."""
        self.ended.append(stream)
        return True

    def take(self, job: str, relay: str) -> pb.RelayUp:
        """The next message: up to MAX_ITEMS frames (the oldest streams first), ended and silent
        streams; a stream's end never goes before its last frame."""
        frames = self.frames
        if len(frames) > MAX_ITEMS:
            items = list(frames.items())
            frames, self.frames = dict(items[:MAX_ITEMS]), dict(items[MAX_ITEMS:])
        else:
            self.frames = {}
        ended = [s for s in self.ended if s not in self.frames][:MAX_ITEMS]
        if ended:
            gone = set(ended)
            self.ended = [s for s in self.ended if s not in gone]
        up = pb.RelayUp(job=job, relay=relay, ended=ended, silent=self.silent[:MAX_ITEMS],
                        frames=[pb.RelayedFrame(stream=s, frame=f) for s, f in frames.items()])
        del self.silent[:MAX_ITEMS]
        if self.summary is not None and not self.frames:  # after the lagging nodes' frames it names
            up.summary.CopyFrom(self.summary)
            self.summary = None
        return up

    def put_back(self, up: pb.RelayUp) -> None:
        """A batch that no leader took: it goes again, under whatever came since."""
        pending, self.frames = self.frames, {}
        for rf in up.frames:
            self.frames[rf.stream] = rf.frame
        for stream, frame in pending.items():
            self.add(stream, frame)
        self.ended[:0] = up.ended
        self.silent[:0] = up.silent
        if up.HasField("summary") and self.summary is None:
            self.summary = up.summary


# ---- the leader's end ------------------------------------------------------------------------


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

    def __init__(self, leader, relay: str, stream_end: Callable[[object], pb.StreamEnd]):
        """`stream_end`: an error of the tree (or CLOSE) as the wire carries it (the server's table)."""
        self.leader = leader
        self._stream_end = stream_end
        self.job = leader.job
        self.relay = relay[:256]
        self.streams = {}  # stream number -> NodeStream
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
            self.out.append(pb.RelayedDirective(stream=stream, end=self._stream_end(item)))
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
                self.leader.silent_at_relay(stream, silent.silent_ms)
        if up.HasField("summary"):
            self.leader.summarised(self.vouch, up.summary, self.streams)
        if self.streams:
            self.carried_at = self.heard_at

    def close(self) -> None:
        """The call ended: its streams are gone, their nodes are not (they reconnect elsewhere)."""
        streams, self.streams = self.streams, {}
        for stream in streams.values():
            self.leader.detach(stream, relay_lost=True)


# ---- the relaying replica's end --------------------------------------------------------------


@dataclass(frozen=True)
class PeerAccess:
    """How a replica calls another (a relay calls the leader): its client TLS and, where tokens are
    required, the relay token from the tokens file."""

    tls: TlsFiles = TlsFiles()  # --peer-tls-*
    tokens: Tokens | None = None

    def security(self) -> ClientSecurity:
        """The same for every job: relaying is a replica's role (`Tokens.check_relay`), not a job's."""
        return ClientSecurity(self.tokens.relay_token() if self.tokens else "", self.tls)


def signature(frame: pb.NodeFrame, heard_quantum_ms: float) -> tuple:
    """What the leader judges a node by, less its steps: a frame whose signature is the last
    forwarded one's only advances steps. How long the agent has not heard a rank counts by
    quarters of the heartbeat timeout, so a rank going quiet is forwarded as it crosses it."""
    return (frame.term, frame.generation, tuple(
        (r.local_rank, r.pid, r.state, r.generation, r.phase, r.digest_step, r.restarts, r.snapshot_every,
         r.snapshot_bytes, int(r.heard_ms_ago // heard_quantum_ms)) for r in frame.ranks))


def top_step(frame: pb.NodeFrame) -> int:
    return max((r.step for r in frame.ranks), default=0)


JUDGED = frozenset({pb.RANK_STATE_RUNNING, pb.RANK_STATE_STARTING, pb.RANK_STATE_LONG_PHASE})


def slowest_step(frame: pb.NodeFrame) -> int | None:
    """The step of the node's slowest rank whose progress the leader judges (None: none is)."""
    return min((r.step for r in frame.ranks if r.state in JUDGED), default=None)


@dataclass(eq=False)
class RelayedNode:
    """A node stream this replica relays: its directives (RelayedDirective) arrive on `queue`."""

    stream_id: int
    node_id: str
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    heard_at: float = 0.0  # the relay's clock: its last frame
    signature: tuple | None = None  # of the last frame forwarded
    step: int = 0  # the highest step of the last frame forwarded
    fresh: bool = True  # no step advance forwarded since its signature changed
    silent: bool = False  # reported silent to the leader; its next frame goes at once
    # Summarised (the leader reads RelaySummary): what the relay judges its progress by.
    low: int | None = None  # its slowest judged rank's step (None: no rank judged)
    advanced_at: float = 0.0  # when `low` last changed
    step_time_s: float = 0.0  # its ranks' longest step time, last reported
    compute_us: int = 0  # its ranks' longest compute time, last reported (the slowest node goes up)
    lagging: bool = False  # named lagging to the leader
    latest: pb.NodeFrame | None = None  # its latest frame, when the leader has not had it
    # The placement it was last given (generation, node rank, rank offset, local ranks): what a
    # loss-only map renumbers (`renumbered`).
    placement: tuple[int, int, int, tuple[int, ...]] | None = None


class Changes:
    """What of its nodes' frames a relay forwards (pure; the clock is an argument). A frame that
    changes the node's signature, carries exits, or is its first (or its first since it was
    reported silent) goes at once, and so does the first step advance after a change (recovery is
    timed by it); one that only advances steps is held, the latest replacing the last, until
    `progress_s` after the first of them; one with nothing new is dropped. Silence is judged here,
    with the heartbeat timeout, and reported once.

    `summarising` (the leader reads summaries): a frame that only advances steps is not sent at all;
    once every `progress_s` a `RelaySummary` stands for every node's progress, naming only the nodes
    that started or stopped lagging (their slowest judged rank not advanced for LAG_STEPS of their
    step time, at least `progress_s`), with the frames of the lagging and of the SLOWEST nodes."""

    def __init__(self, heartbeat_timeout_s: float, progress_s: float):
        self.heartbeat_timeout_s, self.progress_s = heartbeat_timeout_s, progress_s
        self.held: dict[int, tuple[float, pb.NodeFrame]] = {}  # stream -> (held since, latest), in due order
        self._silence_checked_at = -math.inf
        self.summarising = False
        self._summarised_at = -math.inf

    def frame(self, node: RelayedNode, frame: pb.NodeFrame, now: float) -> list[pb.NodeFrame]:
        """The frames of `node` to forward now, oldest first (a held one goes with a newer change)."""
        node.heard_at = now
        sig = signature(frame, self.heartbeat_timeout_s * 250)
        step = top_step(frame)
        if self.summarising:
            self._progress(node, frame, now)
        if node.signature is not None and sig == node.signature and not frame.exits and not node.silent:
            if step <= node.step:
                return []  # a keep-alive: the relay vouches for the node
            if not node.fresh:
                if self.summarising:  # the summary stands for it
                    node.step, node.latest = step, frame
                    return []
                since = self.held.get(node.stream_id, (now, None))[0]
                self.held[node.stream_id] = (since, frame)
                return []
        node.fresh = sig != node.signature or (node.fresh and step <= node.step)
        node.signature, node.step, node.silent, node.latest = sig, step, False, None
        held = self.held.pop(node.stream_id, None)
        return [held[1], frame] if held else [frame]

    @staticmethod
    def _progress(node: RelayedNode, frame: pb.NodeFrame, now: float) -> None:
        low = slowest_step(frame)
        if low != node.low:
            node.low, node.advanced_at = low, now
        node.step_time_s = max((r.step_time_us for r in frame.ranks), default=0) / 1e6
        node.compute_us = max((r.compute_us for r in frame.ranks), default=0)

    def summary(self, nodes, now: float) -> tuple[pb.RelaySummary | None, list[tuple[int, pb.NodeFrame]]]:
        """Every `progress_s` while summarising: the summary of `nodes` (O(nodes of this relay)), and
        the frames to send before it (the newly lagging nodes' and the slowest's, where the leader
        has not had them)."""
        if not self.summarising or now - self._summarised_at < self.progress_s:
            return None, []
        self._summarised_at = now
        summary, frames = pb.RelaySummary(nodes=len(nodes)), []
        low, high = None, 0
        for node in nodes:
            high = max(high, node.step)
            if node.low is None:
                continue  # no rank judged by its progress (forming, exited, a script's)
            lags = now - node.advanced_at > max(self.progress_s, LAG_STEPS * node.step_time_s)
            if lags and not node.lagging and len(summary.lagging) < MAX_ITEMS:
                node.lagging = True
                summary.lagging.append(pb.LaggingStream(stream=node.stream_id, step=node.low,
                                                        since_ms=round((now - node.advanced_at) * 1000)))
                if node.latest is not None:
                    frames.append((node.stream_id, node.latest))
                    node.latest = None
            elif not lags and node.lagging and len(summary.resumed) < MAX_ITEMS:
                node.lagging = False
                summary.resumed.append(node.stream_id)
            if not node.lagging:
                low = node.low if low is None else min(low, node.low)
        summary.low_step, summary.high_step = low or 0, high
        for node in heapq.nlargest(SLOWEST, (n for n in nodes if n.latest is not None), key=lambda n: n.compute_us):
            frames.append((node.stream_id, node.latest))  # the straggler watch's view of it stays fresh
            node.latest = None
        return summary, frames

    def due(self, nodes: dict[int, RelayedNode], now: float) -> list[tuple[int, pb.NodeFrame]]:
        """Held progress whose time has come (O(what is due))."""
        found = []
        while self.held:
            stream, (since, frame) = next(iter(self.held.items()))
            if now - since < self.progress_s:
                break
            del self.held[stream]
            node = nodes.get(stream)
            if node is not None:
                node.step = top_step(frame)
                found.append((stream, frame))
        return found

    def silent(self, nodes, now: float) -> list[pb.SilentStream]:
        """Nodes heard from no more within the heartbeat timeout, each reported once (looked at every
        eighth of it: O(nodes of this relay) then)."""
        if now - self._silence_checked_at < self.heartbeat_timeout_s / 8:
            return []
        self._silence_checked_at = now
        found = []
        for node in nodes:
            if not node.silent and now - node.heard_at > self.heartbeat_timeout_s:
                node.silent = True
                found.append(pb.SilentStream(stream=node.stream_id, silent_ms=int((now - node.heard_at) * 1000)))
        return found

    def drop(self, stream: int) -> pb.NodeFrame | None:
        """The stream ended: its held frame, if any (it still goes, before the end)."""
        held = self.held.pop(stream, None)
        return held[1] if held else None


def placement_of(directive: pb.Directive) -> tuple[int, int, int, tuple[int, ...]] | None:
    """What a relay keeps of a node's assignment: its placement, if it is placed."""
    a = directive.assignment
    if a.role != pb.ROLE_ACTIVE:
        return None
    return directive.generation, a.node_rank, a.rank_offset, tuple(a.local_ranks)


def renumbered(placement: tuple[int, int, int, tuple[int, ...]] | None, m: pb.RelayedMap) -> pb.Directive | None:
    """A node's directive of the loss-only map `m`, from its placement of the map it shrinks: its
    ranks left out dropped, the rest moved down past every rank and node left out before them. None:
    the node had no placement of that map, or keeps no rank."""
    a = m.directive.assignment
    if placement is None or placement[0] != a.shrink_of:
        return None
    _, node_rank, offset, slots = placement
    excluded = a.excluded_ranks
    kept = [s for i, s in enumerate(slots) if not _holds(excluded, offset + i)]
    if not kept:
        return None
    d = pb.Directive()
    d.CopyFrom(m.directive)
    mine = d.assignment
    mine.node_rank = node_rank - bisect.bisect_left(m.removed_node_ranks, node_rank)
    mine.rank_offset = offset - bisect.bisect_left(excluded, offset)
    mine.local_world_size = len(kept)
    mine.local_ranks.extend(kept)
    return d


def _holds(ascending, value: int) -> bool:
    i = bisect.bisect_left(ascending, value)
    return i < len(ascending) and ascending[i] == value


class Relay:
    """This replica's relay of one job it does not lead: one Relay call to the leader. Until the
    leader accepts the call, a refused or failed attempt is retried (the leader looked up again, the
    unsent frames kept) for up to `connect_s`; once the call ends, every node stream it carried ends
    with UNAVAILABLE and a leader hint, and the replica opens a new Relay for the next node."""

    def __init__(self, job: str, address: str, leader: str, *, security: ClientSecurity,
                 find_leader: Callable[[str], Awaitable[str]], window_s: float, connect_s: float,
                 heartbeat_timeout_s: float, progress_s: float):
        self.job, self.address, self.leader = job, address, leader
        self.security = security
        self._find_leader = find_leader
        self.window_s, self.connect_s = window_s, connect_s
        # An idle relay still writes (the leader takes a silent one for frozen), and this is also
        # how often silence and held progress are looked at.
        self.keepalive_s = heartbeat_timeout_s / 8
        # Attempts on a leader not elected yet: its nodes must reach it within a heartbeat timeout of
        # the first frame it hears (its takeover grace), so they come at most a quarter of one apart.
        self.retry_most_s = min(RETRY_MOST_S, heartbeat_timeout_s / 8)
        self.pulse_spread_s = heartbeat_timeout_s / 8  # half the leader's pulse period: done before the next
        self._pulsing: asyncio.Task | None = None
        self.nodes: dict[int, RelayedNode] = {}
        self.batch = FrameBatch()
        self.changes = Changes(heartbeat_timeout_s, progress_s)
        self._clock = asyncio.get_running_loop().time
        self.accepting = True  # False once the call is over or closing: new nodes go to a new Relay
        self._last_stream = 0
        self._pending = asyncio.Event()
        self._urgent = asyncio.Event()
        self._sent: list[pb.RelayUp] = []  # batches of the current call, until a leader accepts it
        self._accepted = False
        self._heard_at = 0.0  # the current call's last message from the leader
        self._elected = ""  # the leader etcd named when the current call's went silent
        self._task = asyncio.create_task(self._run(), name=f"relay:{job}")
        self.log = log.bind(job=job, relay=address)

    def open(self, first: pb.NodeFrame) -> RelayedNode:
        self._last_stream += 1
        node = RelayedNode(self._last_stream, first.node_id)
        self.nodes[node.stream_id] = node
        self.frame(node, first)
        return node

    def frame(self, node: RelayedNode, frame: pb.NodeFrame) -> None:
        for older_first in self.changes.frame(node, frame, self._clock()):
            self._forward(node.stream_id, older_first)

    def _forward(self, stream: int, frame: pb.NodeFrame) -> None:
        # The leader does not see every frame of the node: what it saw last may not be what the
        # node's steps_only referred to.
        frame.steps_only = False
        if self.batch.add(stream, frame):
            self._urgent.set()
        self._pending.set()

    def _sweep(self) -> None:
        now = self._clock()
        for stream, frame in self.changes.due(self.nodes, now):
            self._forward(stream, frame)
        summary, frames = self.changes.summary(self.nodes.values(), now)
        for stream, frame in frames:
            self._forward(stream, frame)
        if summary is not None:
            self.batch.summary = summary
            self._pending.set()
        silent = self.changes.silent(self.nodes.values(), now)
        if silent:
            self.batch.silent.extend(silent)
            self._urgent.set()
            self._pending.set()

    def hang_up(self, node: RelayedNode) -> None:
        if self.nodes.pop(node.stream_id, None) is None:
            return  # ended by the leader or by the call's end
        held = self.changes.drop(node.stream_id)
        if held is not None:
            self.batch.add(node.stream_id, held)
        self.batch.end(node.stream_id)
        if not self.nodes:
            self.accepting = False  # the last node went: the call ends once this is sent
        self._urgent.set()
        self._pending.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.connect_s
        backoff = Backoff(0.05, self.retry_most_s)
        while True:
            accepted, reason, hint = await self._call(self.leader)
            self.leader = hint or self.leader
            if (accepted or not self.nodes or self.leader == self.address or loop.time() >= deadline
                    or reason.startswith(NOT_RELAYED)):  # its nodes go to the leader at once
                break
            await asyncio.sleep(min(backoff.next(), max(0.0, deadline - loop.time())))
            if not hint:
                self.leader = await self._find_leader(self.job)
        self.accepting = False
        if self._pulsing is not None:
            self._pulsing.cancel()
        if self.nodes:
            self.log.info("relay_ended", leader=self.leader, reason=reason, nodes=len(self.nodes), accepted=accepted)
        end = pb.RelayedDirective(end=pb.StreamEnd(code=grpc.StatusCode.UNAVAILABLE.value[0], leader=self.leader,
                                                   message=f"the relay's stream to the leader ended: {reason}"[:512]))
        nodes, self.nodes = self.nodes, {}
        for node in nodes.values():
            node.queue.put_nowait(end)

    async def _call(self, address: str) -> tuple[bool, str, str]:
        """One Relay call to `address`: (accepted by a leader, why it ended, the leader it named).
        The batches of a call no leader accepted are put back, to go on the next."""
        if not address or address == self.address:
            return False, "no other replica leads the job", ""
        self._sent, self._accepted = [], False
        self._heard_at, self._elected = self._clock(), ""
        async with self.security.aio_channel(address) as channel:
            call = pb_grpc.CoordinatorStub(channel).Relay(metadata=self.security.metadata)
            writer = asyncio.create_task(self._write(call))
            following = asyncio.create_task(self._follow_election(call, address))
            try:
                async for down in call:
                    self._heard_at = self._clock()
                    if not self._accepted:  # the leader's first, empty answer
                        self._accepted, self._sent = True, []
                        self.changes.summarising = down.summaries
                        self.log.info("relay_accepted", leader=address, nodes=len(self.nodes))
                    self.fan_out(down)
                return self._accepted, "the leader ended it", ""
            except grpc.aio.AioRpcError as exc:
                return self._accepted, f"{exc.code().name}: {exc.details()}", leader_hint(exc)
            except asyncio.CancelledError:
                if not self._elected or asyncio.current_task().cancelling():
                    raise  # the relay is closing
                return self._accepted, f"{address} went silent and etcd elected {self._elected}", self._elected
            finally:
                writer.cancel()
                following.cancel()
                for up in reversed(self._sent):
                    self.batch.put_back(up)
                if self.batch:
                    self._pending.set()

    async def _follow_election(self, call, address: str) -> None:
        """End the call once `address` has sent nothing for half the heartbeat timeout (it pulses
        every quarter) and etcd names another leader, this replica included. A frozen leader keeps
        the call open (its socket still takes writes) and the nodes on it trust their relay, which
        answers: without this they reached the successor only on their own timeouts, some too late
        for its takeover grace, and were evicted. A leader that is only slow stays elected and keeps
        the call; so does one etcd cannot name (an outage, or nobody elected yet)."""
        silent_s = 4 * self.keepalive_s
        while True:
            await asyncio.sleep(self.keepalive_s)
            if self._clock() - self._heard_at <= silent_s:
                continue
            elected = await self._find_leader(self.job)
            if elected and elected != address:
                self.log.info("relay_leader_moved", silent=address, elected=elected,
                              silent_s=round(self._clock() - self._heard_at, 2), nodes=len(self.nodes))
                self._elected = elected
                call.cancel()
                return

    async def _write(self, call) -> None:
        """Send a batch once per window (at once when urgent) until the last node hung up."""
        try:
            await self._batches(call)
        except (grpc.RpcError, asyncio.InvalidStateError):
            pass  # the call ended: its reader tells why

    async def _batches(self, call) -> None:
        await call.write(pb.RelayUp(job=self.job, relay=self.address, maps=True))
        while True:
            try:  # an idle relay still writes: the leader takes a silent one for frozen
                await asyncio.wait_for(self._pending.wait(), self.keepalive_s)
            except TimeoutError:
                self._sweep()
                if not self._pending.is_set():
                    await call.write(pb.RelayUp(job=self.job, relay=self.address))
                continue
            self._sweep()
            if not self._urgent.is_set():
                try:
                    await asyncio.wait_for(self._urgent.wait(), self.window_s)
                except TimeoutError:
                    pass
            self._pending.clear()
            self._urgent.clear()
            up = self.batch.take(self.job, self.address)
            if self.batch:
                self._pending.set()  # more than one message's worth: the rest next
            if not self._accepted:
                self._sent.append(up)
            await call.write(up)
            if not self.nodes and not self.accepting:
                await call.done_writing()
                return

    def close(self) -> None:
        """The replica stops: the call ends with it."""
        self.accepting = False
        self._task.cancel()

    def fan_out(self, down: pb.RelayDown) -> None:
        """What the leader sent down, to the nodes it names (a loss-only map, to each node it does not
        name, renumbered); its pulse to every node, spread."""
        for item in down.items:
            node = self.nodes.get(item.stream)
            if node is None:
                continue  # it hung up meanwhile
            if item.HasField("end"):
                del self.nodes[item.stream]
            elif item.directive.HasField("assignment"):
                node.placement = placement_of(item.directive)
            node.queue.put_nowait(item)
        if down.HasField("map"):
            own = set(down.map.own)
            for node in self.nodes.values():
                directive = None if node.stream_id in own else renumbered(node.placement, down.map)
                if directive is not None:
                    node.placement = placement_of(directive)
                    node.queue.put_nowait(pb.RelayedDirective(stream=node.stream_id, directive=directive))
        if down.HasField("pulse"):
            if self._pulsing is not None:
                self._pulsing.cancel()  # superseded
            self._pulsing = asyncio.create_task(self._pulse(pb.RelayedDirective(directive=down.pulse)))

    async def _pulse(self, pulse: pb.RelayedDirective) -> None:
        """The leader's pulse to every node of this relay, a slice at a time over `pulse_spread_s`:
        all at once, 6,250 nodes' pulses held the relay's loop for a quarter of a second, and every
        frame and directive behind them."""
        nodes = list(self.nodes.values())
        slices = math.ceil(len(nodes) / PULSE_SLICE)
        for i in range(slices):
            for node in nodes[i * PULSE_SLICE:(i + 1) * PULSE_SLICE]:
                if self.nodes.get(node.stream_id) is node:  # not hung up meanwhile
                    node.queue.put_nowait(pulse)
            await asyncio.sleep(self.pulse_spread_s / slices)
