"""What a relay sends up, folded (pure: the clock is an argument): a node's frames folded into the
latest one per batch window (`fold`, `FrameBatch`), which of them change what the leader judges a
node by and which only advance steps (`Changes`, with the summaries that stand for the latter and
the silence the relay reports), and a loss-only map renumbered for each node (`renumbered`). The
relaying replica (`relay.Relay`) drives it; the leader's end of the call is `relay_link`.
"""

from __future__ import annotations

import asyncio
import bisect
import heapq
import math
from dataclasses import dataclass, field

from muster.v1 import muster_pb2 as pb

# Items per Relay message, either way: a new generation's assignments to thousands of relayed nodes
# must stay well under the gRPC message limit (1 MiB by default); the rest go in the next message.
# Up, it is also the most of each kind (frames, ended, silent) the leader takes in one message: what
# one message may make the leader's loop do (a refused attach each, at worst) is bounded.
MAX_ITEMS = 1024
LAG_STEPS = 3  # a summarised node is lagging once its slowest rank has not advanced for this many step times
SLOWEST = 2  # nodes whose latest frame a summary brings along, by their ranks' compute time


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



def signature(frame: pb.NodeFrame, heard_quantum_ms: float) -> tuple:
    """What the leader judges a node by, less its steps: a frame whose signature is the last
    forwarded one's only advances steps. How long the agent has not heard a rank counts by
    quarters of the heartbeat timeout, so a rank going quiet is forwarded as it crosses it. A
    rank's reform phases count (the leader's recovery timeline): they may come in a frame after
    the one with its new generation, and a summarising relay sends no frame that only advances steps."""
    return (frame.term, frame.generation, tuple(
        (r.local_rank, r.pid, r.state, r.generation, r.phase, r.digest_step, r.restarts, r.snapshot_every,
         r.snapshot_bytes, r.reform.generation, int(r.heard_ms_ago // heard_quantum_ms)) for r in frame.ranks))


def top_step(frame: pb.NodeFrame) -> int:
    return max((r.step for r in frame.ranks), default=0)


JUDGED = frozenset({pb.RANK_STATE_RUNNING, pb.RANK_STATE_STARTING, pb.RANK_STATE_LONG_PHASE})


def slowest_step(frame: pb.NodeFrame) -> int | None:
    """The step of the node's slowest rank whose progress the leader judges (None: none is)."""
    return min((r.step for r in frame.ranks if r.state in JUDGED), default=None)


@dataclass(eq=False)
class RelayedNode:
    """A node stream this replica relays: what a direct node's stream queues arrives on `queue` (its
    directives, then CLOSE or the error its stream ends with)."""

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

