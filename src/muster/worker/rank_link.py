"""A library rank's link to its node agent: one NodeAgent.RankSession stream over the agent's
Unix socket, this rank's reports up, its node's directives down. The agent speaks for the node
to the coordinator; if the agent dies, PR_SET_PDEATHSIG ends this process too. The stream presents
the secret the agent handed this process at its start: another process of the same user cannot
speak for the slot by naming its pid."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc
import structlog

from muster.v1 import muster_pb2 as pb
from muster.v1 import muster_pb2_grpc as pb_grpc
from muster.worker.node_session import Evicted, JobEnded, evicted

log = structlog.get_logger(__name__)

SLOT_SECRET_ENV = "MUSTER_SLOT_SECRET"  # set by the agent for each process it starts, never inherited
SLOT_SECRET_METADATA = "muster-slot-secret"
# Set by the agent: a file of its private directory, one per slot, where a process exiting stuck leaves
# what it alone holds (its peer snapshots) for the slot's next process.
HANDOVER_FILE_ENV = "MUSTER_HANDOVER_FILE"


class RankLink:
    def __init__(self, socket_path: str, local_rank: int, secret: str, *, report: Callable[[], pb.RankReport],
                 on_directive: Callable[[pb.Directive], None], interval_s: float = 0.05,
                 connect_for_s: float = 30.0):
        self.socket_path = socket_path
        self.local_rank = local_rank
        self._metadata = ((SLOT_SECRET_METADATA, secret),)
        self._report = report
        self._on_directive = on_directive
        self.interval_s = interval_s
        self.connect_for_s = connect_for_s
        self.generation = 0  # not sent: the agent reports the node's generation
        self.joined_run = 0  # the agent's (it joined the job for its ranks)
        self._lost_at: float | None = time.monotonic()  # since when the agent's stream is down (None: up)
        self._call = None
        self._stopping = False

    async def _frames(self):
        while True:
            yield self._report()
            await asyncio.sleep(self.interval_s)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.connect_for_s
        while not self._stopping:
            try:
                async with grpc.aio.insecure_channel(f"unix:{self.socket_path}") as channel:
                    stub = pb_grpc.NodeAgentStub(channel)
                    self._call = call = stub.RankSession(self._frames(), metadata=self._metadata)
                    self._lost_at = None
                    async for d in call:
                        self._on_directive(d)
                        if (reason := evicted(d)) is not None:
                            raise Evicted(reason)
                        if d.HasField("end"):  # relayed by the agent, which stops its ranks next
                            raise JobEnded(d.end)
                    return
            except asyncio.CancelledError:
                if self._stopping:
                    return
                raise
            except grpc.aio.AioRpcError as exc:
                if self._stopping:
                    return
                if exc.code() != grpc.StatusCode.UNAVAILABLE or loop.time() > deadline:
                    raise
                await asyncio.sleep(0.05)  # the agent's socket is not up yet

    def silent_s(self) -> float:
        """The agent answers for the coordinator (it gives up on it after its own hold timeout, and
        its ranks die with it): silent only while the agent's stream is down."""
        return 0.0 if self._lost_at is None else time.monotonic() - self._lost_at

    async def join(self, **_) -> None:
        """Membership is the agent's business: the agent is the job's member for its ranks."""

    async def leave(self, **_) -> None:
        """Membership is the agent's business: a rank just exits."""

    async def stop(self) -> None:
        self._stopping = True
        if self._call is not None:
            self._call.cancel()
