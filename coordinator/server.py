"""The gRPC edge: a thin servicer over the Replica and the one table from errors to status codes.

`create_server` binds (port 0 in tests) and returns (server, port). Standbys answer job
traffic with UNAVAILABLE plus trailing metadata `muster-leader: HOST:PORT`.
"""

from __future__ import annotations

import asyncio
import functools
import time

import grpc
import structlog

from muster.coordinator import errors, wire
from muster.coordinator.auth import Tokens
from muster.coordinator.client import LEADER_METADATA
from muster.coordinator.leader import CLOSE
from muster.coordinator.replica import Replica
from muster.v1 import muster_pb2_grpc as pb_grpc

log = structlog.get_logger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 1 << 20

STATUS_OF: dict[type[errors.MusterError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.NotLeader: grpc.StatusCode.UNAVAILABLE,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    errors.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
}


async def _abort(context: grpc.aio.ServicerContext, exc: errors.MusterError):
    if isinstance(exc, errors.NotLeader) and exc.leader:
        context.set_trailing_metadata(((LEADER_METADATA, exc.leader),))
    await context.abort(STATUS_OF[type(exc)], str(exc))


def _refusals(method):
    """Map the error tree at the boundary; the leader keeps serving."""

    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            self.authorize(context, request.job)
            return await method(self, request, context)
        except errors.MusterError as exc:
            log.info("request_refused", method=method.__name__, code=STATUS_OF[type(exc)].name, error=str(exc))
            await _abort(context, exc)

    return wrapper


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    def __init__(self, replica: Replica, tokens: Tokens | None = None):
        self.replica = replica
        self.tokens = tokens  # None: no tokens required

    def authorize(self, context, job: str) -> None:
        if self.tokens is not None:
            self.tokens.check(context.invocation_metadata(), job)

    @_refusals
    async def Join(self, request, context):
        return await self.replica.join(request)

    @_refusals
    async def Leave(self, request, context):
        wire.check_node(request.node_id)
        return await (await self.replica.leader_for(request.job)).leave(request)

    @_refusals
    async def Status(self, request, context):
        return await self.replica.status(request.job, request.brief)

    @_refusals
    async def Events(self, request, context):
        return await self.replica.events(request.job)

    async def Session(self, request_iterator, context):
        stream = leader = reader = None
        try:
            first = await anext(request_iterator, None)
            if first is None:
                raise errors.InvalidArgument("a session starts with a frame naming its job and node")
            self.authorize(context, first.job)
            leader = await self.replica.leader_for(first.job)
            stream = leader.attach(first)
            budget = FrameBudget(self.replica.config.limits.max_frames_per_s)
            reader = asyncio.create_task(self._read(leader, stream, request_iterator, budget))
            while True:
                item = await stream.queue.get()
                if item is CLOSE:
                    return
                if isinstance(item, errors.MusterError):
                    raise item
                yield item
        except errors.MusterError as exc:
            log.info("session_refused", code=STATUS_OF[type(exc)].name, error=str(exc))
            await _abort(context, exc)
        finally:
            if reader:
                reader.cancel()
            if stream:
                leader.detach(stream)

    @staticmethod
    async def _read(leader, stream, request_iterator, budget: FrameBudget) -> None:
        try:
            async for frame in request_iterator:
                budget.spend()
                leader.on_frame(stream, frame)
        except errors.MusterError as exc:
            stream.send(exc)
            return
        except (asyncio.CancelledError, grpc.RpcError):
            pass
        stream.send(CLOSE)


class FrameBudget:
    """A token bucket per Session stream: `rate` frames/s sustained, bursts of 2 s worth. A node
    sends one frame per heartbeat interval (plus one per exit); one that floods is cut off."""

    def __init__(self, rate: float, clock=time.monotonic):
        self.rate, self.capacity = rate, max(2.0 * rate, 10.0)
        self.tokens, self._clock = self.capacity, clock
        self._at = clock()

    def spend(self) -> None:
        now = self._clock()
        self.tokens = min(self.capacity, self.tokens + (now - self._at) * self.rate)
        self._at = now
        if self.tokens < 1.0:
            raise errors.ResourceExhausted(f"more than {self.rate:g} frames/s on this session "
                                           f"(--max-frames-per-second); the stream is closed")
        self.tokens -= 1.0


async def create_server(
    replica: Replica, listen: str = "127.0.0.1:0", *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    tokens: Tokens | None = None, credentials: grpc.ServerCredentials | None = None,
) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
            ("grpc.keepalive_permit_without_calls", 1),
        ]
    )
    pb_grpc.add_CoordinatorServicer_to_server(CoordinatorServicer(replica, tokens), server)
    port = server.add_secure_port(listen, credentials) if credentials else server.add_insecure_port(listen)
    if port == 0:
        raise OSError(f"could not listen on {listen}")
    return server, port
