"""A node's Session stream as one port, whoever takes its frames (`SessionPort`): the job's leader
on this replica (`LeaderPort`: frames to the `JobLeader`, directives from the node's `NodeStream`),
or the relay of a job led elsewhere (`RelayPort`: frames into the `Relay`'s batch, directives fanned
back out by it). `Replica.open_session` picks one by the stream's first frame; the gRPC edge hands
it the whole stream (`serve`) and writes the directives it yields, the same way for both.
A replica's Relay call at the job's leader is a port too (`RelayCall`, from `Replica.open_relay`).
`feed_each` is the one reader of a client's stream, a Relay call's too.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import structlog

from muster.coordinator import errors
from muster.coordinator.errors import MusterError
from muster.coordinator.job.leader import JobLeader
from muster.coordinator.quotas import FrameBudget
from muster.coordinator.replica.relay import Relay
from muster.coordinator.core.relay_fold import MAX_ITEMS, RelayedNode
from muster.coordinator.job.relay_link import RelayLink, check_size
from muster.coordinator.job.streams import CLOSE, NodeStream
from muster.v1 import muster_pb2 as pb

log = structlog.get_logger(__name__)


async def feed_each(items: AsyncIterator, budget: FrameBudget | None,
                    on_item: Callable[[Any], None]) -> MusterError | None:
    """Each item a client's stream sends, to `on_item`, spending a frame of `budget` each (None:
    `on_item` budgets them); the stream's end: None once the client stops writing (or is gone),
    else the refusal that ends it (an item that did not decode, or one `on_item` refused)."""
    try:
        async for item in items:
            if budget is not None:
                budget.spend()
            if isinstance(item, MusterError):  # it did not decode: the stream ends with it
                raise item
            on_item(item)
    except MusterError as exc:
        return exc
    except (asyncio.CancelledError, grpc.RpcError):
        pass
    return None


class SessionPort(ABC):
    """One node's Session stream at this replica. The node's directives arrive on the queue `open`
    returns as a direct `NodeStream`'s do (directives, then CLOSE or the error of the tree that
    ends the stream); `serve` pumps them out while a task reads the node's frames into `take`."""

    _reader: asyncio.Task | None = None
    _queue: asyncio.Queue | None = None

    @abstractmethod
    def open(self, first: pb.NodeFrame) -> asyncio.Queue:
        """Attach the node by its stream's first frame (raising the refusal); its directives' queue."""

    @abstractmethod
    def take(self, frame: pb.NodeFrame) -> None:
        """One frame of the node, decoded; raises the error of the tree that ends its stream."""

    @abstractmethod
    def hang_up(self) -> None:
        """The node's stream, attached, is gone (the node is not)."""

    async def serve(self, first: pb.NodeFrame, frames: AsyncIterator[pb.NodeFrame | MusterError],
                    budget: FrameBudget) -> AsyncIterator[pb.Directive]:
        """The node's stream, opened by its first frame: what to send the node, until the stream
        ends (raising the error it ends with). Its frames, a frame of `budget` each, are read
        meanwhile until it stops writing or is refused. The edge calls it as soon as the port is
        chosen, with no await between: the relay or leader chosen still takes the node."""
        queue = self._queue = self.open(first)
        self._reader = asyncio.create_task(self._feed(frames, budget, queue))
        while True:
            item = await queue.get()
            if item is CLOSE:
                return
            if isinstance(item, MusterError):
                raise item
            yield item

    async def _feed(self, frames: AsyncIterator[pb.NodeFrame | MusterError], budget: FrameBudget,
                    queue: asyncio.Queue) -> None:
        refusal = await feed_each(frames, budget, self.take)
        queue.put_nowait(CLOSE if refusal is None else refusal)

    def end(self, exc: MusterError) -> None:
        """End the stream with `exc` once the directives queued before it are out (its token was
        revoked). Only once `serve` opened it."""
        self._queue.put_nowait(exc)

    def close(self) -> None:
        """The call is over, however far `serve` got: nothing more is read, and an attached node's
        stream is hung up. Not in `serve`'s own cleanup: grpc may close the edge's generator while
        `serve` waits at its yield, and nothing would close `serve` then."""
        if self._reader is not None:
            self._reader.cancel()
        self.hang_up()


class LeaderPort(SessionPort):
    """A node stream of a job this replica leads: attached to the leader by its first frame."""

    def __init__(self, leader: JobLeader):
        self.leader = leader
        self.stream: NodeStream | None = None

    def open(self, first: pb.NodeFrame) -> asyncio.Queue:
        self.stream = self.leader.attach(first)
        return self.stream.queue

    def take(self, frame: pb.NodeFrame) -> None:
        self.leader.on_frame(self.stream, frame)

    def hang_up(self) -> None:
        if self.stream is not None:
            self.leader.detach(self.stream)


class RelayPort(SessionPort):
    """A node stream this replica relays to the job's leader: one of the relay's nodes."""

    def __init__(self, relay: Relay):
        self.relay = relay
        self.node: RelayedNode | None = None

    def open(self, first: pb.NodeFrame) -> asyncio.Queue:
        self.node = self.relay.open(first)
        return self.node.queue

    def take(self, frame: pb.NodeFrame) -> None:
        self.relay.frame(self.node, frame)

    def hang_up(self) -> None:
        if self.node is not None:
            self.relay.hang_up(self.node)


class RelayCall:
    """A replica's Relay call at the job's leader: its messages into the call's `RelayLink`, each
    budgeted; the leader's replies out. The call ends when the relay stops writing, leaves replies
    unread, goes silent (frozen or cut off: its nodes are excused and move once they notice),
    carries no node stream, or the leadership is lost."""

    def __init__(self, leader: JobLeader, first: pb.RelayUp, max_frames_per_s: float, timeout_s: float):
        self.leader = leader
        self.link = RelayLink(leader, first.relay)
        self.timeout_s = timeout_s
        self.budget = FrameBudget(max_frames_per_s, floor=MAX_ITEMS)
        self._ended: asyncio.Future = asyncio.get_running_loop().create_future()
        self._tasks: list[asyncio.Task] = []

    def _receive(self, up: pb.RelayUp) -> None:
        """Every frame, ended and silent stream is budgeted before any is looked at, a first frame
        too: the budget grows with the streams attached (as each node's own Session would be), and a
        relay attaching its nodes spends at most a message's worth ahead of them."""
        self.budget.spend(check_size(up), max(1, len(self.link.streams)))
        self.link.receive(up)
        if self.link.overflowed:
            raise self._unread()

    def _unread(self) -> errors.ResourceExhausted:
        return errors.ResourceExhausted(f"this Relay call left {len(self.link.out)} replies unread; it is closed")

    async def _read(self, messages: AsyncIterator[pb.RelayUp | MusterError]) -> MusterError | None:
        """Feed the link; the call ends when the relay stops writing (or with the refusal returned).
        A refused call's streams go at once: one that reads no reply holds its last write forever
        (grpc cannot end a call with a write pending), but nothing more of it is read or kept."""
        try:
            refusal = await feed_each(messages, None, self._receive)
            if refusal is not None:
                self.link.close()
            return refusal
        finally:
            self.link.ready.set()

    async def serve(self, first: pb.RelayUp,
                    messages: AsyncIterator[pb.RelayUp | MusterError]) -> AsyncIterator[pb.RelayDown]:
        """The call from its first message: that message taken, its acceptance (the relay stops
        retrying elsewhere), then the leader's replies as they come, until the call ends (raising
        the refusal it ends with)."""
        link, timeout_s = self.link, self.timeout_s
        self._receive(first)
        yield pb.RelayDown(summaries=True)
        reader = asyncio.create_task(self._read(messages))
        lost = asyncio.create_task(self.leader.leadership.lost.wait())
        self._tasks = [reader, lost]
        loop = asyncio.get_running_loop()
        while not reader.done() or link.pending:
            if self._ended.done():
                raise self._ended.result()
            if reader.done() and reader.result() is not None:
                raise reader.result()  # refused: the replies it was owed go no further
            if link.overflowed:
                raise self._unread()
            if link.pending:
                yield link.take()
                continue
            # Woken by a reply to carry, the leadership's loss, the reader's end, the call's end
            # (its token revoked), or the moment the relay would count as silent (or as carrying nothing).
            due = link.heard_at + timeout_s / 2 if link.streams else link.carried_at + timeout_s
            ready = asyncio.ensure_future(link.ready.wait())
            await asyncio.wait((ready, lost, reader, self._ended), timeout=max(0.0, due - loop.time()) + 0.01,
                               return_when=asyncio.FIRST_COMPLETED)
            ready.cancel()
            if self.leader.lost_reason is not None and not link.pending:
                raise errors.NotLeader(link.job, "")
            self._judge_silence(loop.time())
        if isinstance(reader.result(), MusterError):
            raise reader.result()

    def _judge_silence(self, now: float) -> None:
        """A relay with node streams speaks every half heartbeat timeout (its pulse); one without
        any has no business calling past a heartbeat timeout."""
        link, timeout_s = self.link, self.timeout_s
        silent_s = now - link.heard_at
        if link.streams and silent_s > timeout_s / 2:
            log.warning("relay_silent", job=link.job, relay=link.relay, silent_s=round(silent_s, 2),
                        streams=len(link.streams))
            raise errors.Unavailable(f"this relay sent nothing for {silent_s:.1f}s")
        if not link.streams and now - link.carried_at > timeout_s:
            raise errors.FailedPrecondition(f"this Relay call carried no node stream for {timeout_s:g}s: "
                                            "a relay calls while it relays nodes")

    def end(self, exc: Exception) -> None:
        """End the call with `exc` (its token was revoked)."""
        if not self._ended.done():
            self._ended.set_result(exc)

    def close(self) -> None:
        """The call is over, however far `serve` got: nothing more is read, its streams are gone."""
        for task in self._tasks:
            task.cancel()
        self.link.close()
