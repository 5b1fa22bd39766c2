"""A node's Session stream as one port, whoever takes its frames (`SessionPort`): the job's leader
on this replica (`LeaderPort`: frames to the `JobLeader`, directives from the node's `NodeStream`),
or the relay of a job led elsewhere (`RelayPort`: frames into the `Relay`'s batch, directives fanned
back out by it). `Replica.open_session` picks one by the stream's first frame; the gRPC edge hands
it the stream's frames and writes the directives it yields, the same way for both. `feed_each` is
the one reader of a client's stream, a Relay call's too.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import grpc

from muster.coordinator.errors import MusterError
from muster.coordinator.leader import JobLeader
from muster.coordinator.quotas import FrameBudget
from muster.coordinator.relay import Relay
from muster.coordinator.streams import CLOSE
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


class SessionPort(Protocol):
    async def feed(self, frames: AsyncIterator[pb.NodeFrame | MusterError], budget: FrameBudget) -> None:
        """The node's frames, a frame of `budget` each, until it stops writing or is refused;
        `directives` then ends (raising the refusal)."""

    def directives(self) -> AsyncIterator[pb.Directive]:
        """What to send the node, until its stream ends (raising the error it ends with)."""

    def close(self) -> None:
        """The call is over: the node's stream is gone (the node is not)."""


class QueuedPort(ABC):
    """What both ports share: the node's directives arrive on `queue` as a direct `NodeStream`'s do
    (directives, then CLOSE or the error of the tree that ends the stream), and are pumped out."""

    def __init__(self, queue: asyncio.Queue):
        self.queue = queue

    @abstractmethod
    def take(self, frame: pb.NodeFrame) -> None:
        """One frame of the node, decoded; raises the error of the tree that ends its stream."""

    @abstractmethod
    def close(self) -> None: ...

    async def feed(self, frames: AsyncIterator[pb.NodeFrame | MusterError], budget: FrameBudget) -> None:
        refusal = await feed_each(frames, budget, self.take)
        self.queue.put_nowait(CLOSE if refusal is None else refusal)

    async def directives(self) -> AsyncIterator[pb.Directive]:
        while True:
            item = await self.queue.get()
            if item is CLOSE:
                return
            if isinstance(item, MusterError):
                raise item
            yield item


class LeaderPort(QueuedPort):
    """A node stream of a job this replica leads: attached to the leader by its first frame."""

    def __init__(self, leader: JobLeader, first: pb.NodeFrame):
        self.leader = leader
        self.stream = leader.attach(first)
        super().__init__(self.stream.queue)

    def take(self, frame: pb.NodeFrame) -> None:
        self.leader.on_frame(self.stream, frame)

    def close(self) -> None:
        self.leader.detach(self.stream)


class RelayPort(QueuedPort):
    """A node stream this replica relays to the job's leader: one of the relay's nodes."""

    def __init__(self, relay: Relay, first: pb.NodeFrame):
        self.relay = relay
        self.node = relay.open(first)
        super().__init__(self.node.queue)

    def take(self, frame: pb.NodeFrame) -> None:
        self.relay.frame(self.node, frame)

    def close(self) -> None:
        self.relay.hang_up(self.node)
