"""A node's Session stream as one port, whoever takes its frames (`SessionPort`): the job's leader
on this replica (`LeaderPort`: frames to the `JobLeader`, directives from the node's `NodeStream`),
or the relay of a job led elsewhere (`RelayPort`: frames into the `Relay`'s batch, directives fanned
back out by it). `Replica.open_session` picks one by the stream's first frame; the gRPC edge hands
it the whole stream (`serve`) and writes the directives it yields, the same way for both.
`feed_each` is the one reader of a client's stream, a Relay call's too.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from muster.coordinator.errors import MusterError
from muster.coordinator.leader import JobLeader
from muster.coordinator.quotas import FrameBudget
from muster.coordinator.relay import Relay
from muster.coordinator.relay_fold import RelayedNode
from muster.coordinator.streams import CLOSE, NodeStream
from muster.v1 import muster_pb2 as pb


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
