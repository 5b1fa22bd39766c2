"""The gRPC edge: a thin servicer over the Replica, its refusals coded by `codes.STATUS_OF`.

`create_server` binds (port 0 in tests) and returns (server, port). Standbys answer job
traffic with UNAVAILABLE plus trailing metadata `muster-leader: HOST:PORT`. Every refusal is one
of the error tree, so a caller sees a precise code (never UNKNOWN) and a bounded message.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable

import grpc
import structlog
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass

from muster.client import LEADER_METADATA, RUN_ENDED_METADATA
from muster.coordinator import errors, wire
from muster.coordinator.job import status_pages
from muster.coordinator.auth import Tokens, check_replica_certificate
from muster.coordinator.codes import MAX_MESSAGE_CHARS, STATUS_OF
from muster.coordinator.quotas import FrameBudget, IdleStreams, RelayCalls, refusals, tenant_of
from muster.coordinator.replica.replica import Replica
from muster.v1 import muster_pb2 as pb
from muster.v1 import muster_pb2_grpc as pb_grpc

log = structlog.get_logger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 1 << 20
SERVICE = pb.DESCRIPTOR.services_by_name["Coordinator"]
# (client streaming, server streaming) -> handler; a method of another kind fails at startup.
HANDLER_OF = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


async def _abort(context: grpc.aio.ServicerContext, exc: errors.MusterError):
    if isinstance(exc, errors.NotLeader):  # (empty: no leader elected yet, which a client may wait out)
        context.set_trailing_metadata(((LEADER_METADATA, exc.leader),))
    elif isinstance(exc, errors.RunEnded):
        context.set_trailing_metadata(((RUN_ENDED_METADATA, f"{exc.run} {exc.outcome}"),))
    await context.abort(STATUS_OF[type(exc)], str(exc)[:MAX_MESSAGE_CHARS])


def _refusals(method):
    """Map the error tree at the boundary; the leader keeps serving."""

    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            self.admit(context, request)
            return await method(self, request, context)
        except errors.MusterError as exc:
            refusals.refused("request_refused", STATUS_OF[type(exc)].name, str(exc)[:MAX_MESSAGE_CHARS],
                             method=method.__name__)
            await _abort(context, exc)

    return wrapper


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    def __init__(self, replica: Replica, tokens: Tokens | None = None, replica_cert: bytes | None = None):
        """`replica_cert`: under mTLS, the DER of the certificate replicas present to each other,
        which a Relay caller must present (b"": none configured; None: no mTLS, no check)."""
        self.replica = replica
        self.tokens = tokens  # None: no tokens required
        self.replica_cert = replica_cert
        limits = replica.config.limits
        self.idle = IdleStreams(limits.idle_streams)
        self.relay_calls = RelayCalls(limits.relay_calls)

    def admit(self, context: grpc.aio.ServicerContext, request: Message | errors.MusterError, *,
              relay: bool = False) -> None:
        """Refuse a request that did not decode, or whose job is no job name (checked before the
        token, whose refusal quotes the name); then the caller's token must cover the job (a relay's
        covers every job: `relay_role`)."""
        if isinstance(request, errors.MusterError):
            raise request
        if request.job:  # "" asks Status for every job; the other methods refuse it themselves
            wire.check_job(request.job)
        if self.tokens is not None and not relay:
            self.tokens.check(context.invocation_metadata(), request.job)

    @property
    def _first_within_s(self) -> float:
        """A stream's first message comes at once (a node's first frame, a relay's job): a heartbeat
        timeout is plenty."""
        return self.replica.config.timing.heartbeat_timeout_s

    def tenant(self, context) -> str:
        """Whose idle-stream quota a stream spends (`quotas.tenant_of`); raises for a caller without
        a token the file knows, before anything of its stream is read."""
        grants = self.tokens.grants(context.invocation_metadata()) if self.tokens is not None else None
        return tenant_of(grants, context.peer())

    def hold(self, check: Callable[[], None], end: Callable[[Exception], None]) -> Callable[[], None]:
        """The open stream ends (`end`) once a reload of the tokens file fails its `check`
        (`Tokens.hold`); returns the release."""
        return self.tokens.hold(check, end) if self.tokens is not None else lambda: None

    def relay_role(self, context) -> str:
        """Relay is a replica's call: the leader trusts a relay to vouch for its nodes' liveness.
        Its tenant, as `tenant`."""
        if self.tokens is not None:
            self.tokens.check_relay(context.invocation_metadata())
        if self.replica_cert is not None:
            check_replica_certificate(context.auth_context(), self.replica_cert)
        return self.tenant(context)

    @_refusals
    async def Join(self, request, context):
        return await self.replica.join(request)

    @_refusals
    async def Leave(self, request, context):
        wire.check_leave(request)
        return await (await self.replica.leader_for(request.job)).leave(request)

    @_refusals
    async def Status(self, request, context):
        return await self.replica.status(request.job, request.brief, status_pages.check_page(request), request.run)

    @_refusals
    async def Events(self, request, context):
        return await self.replica.events(request.job, request.run)

    # ---- operator verbs: an operator's token, whichever job they name -------------------

    def _operator(self, context) -> None:
        if self.tokens is not None:
            self.tokens.check(context.invocation_metadata(), "")

    @_refusals
    async def Jobs(self, request, context):
        self._operator(context)
        return await self.replica.list_jobs(request.job)

    @_refusals
    async def Stop(self, request, context):
        self._operator(context)
        return await self.replica.stop_job(request.job, wire.check_reason(request.reason))

    @_refusals
    async def Drain(self, request, context):
        self._operator(context)
        wire.check_job(request.job)
        return await self.replica.drain_node(request.job, request.node, wire.check_reason(request.reason))

    @_refusals
    async def Delete(self, request, context):
        self._operator(context)
        return await self.replica.delete_runs(request.job, request.run)

    async def Session(self, request_iterator: AsyncIterator[pb.NodeFrame | errors.MusterError],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.Directive]:
        """A node's stream, whole, to the port its first frame opens (`Replica.open_session`: the
        job's leader here, or the relay to it); the port's directives back out."""
        port = release = None
        try:
            first = await self.idle.first(request_iterator, self.tenant(context), self._first_within_s,
                                          "a session starts with a frame naming its job and node")
            self.admit(context, first)
            port = await self.replica.open_session(first)
            budget = FrameBudget(self.replica.config.limits.max_frames_per_s)
            # held from here: `serve` opens the port at its first step, and no reload runs before it
            release = self.hold(lambda: self.admit(context, first), port.end)
            async for directive in port.serve(first, request_iterator, budget):
                yield directive
        except errors.MusterError as exc:
            refusals.refused("session_refused", STATUS_OF[type(exc)].name, str(exc)[:MAX_MESSAGE_CHARS])
            await _abort(context, exc)
        finally:
            if release:
                release()
            if port:
                port.close()

    async def Relay(self, request_iterator: AsyncIterator[pb.RelayUp | errors.MusterError],
                    context: grpc.aio.ServicerContext) -> AsyncIterator[pb.RelayDown]:
        """A relay's call, whole, to the leader's port its first message opens (`Replica.open_relay`).
        A replica's call (`relay_role`), checked before anything is read; every item of it is budgeted."""
        port = release = host = named = None
        try:
            tenant = self.relay_role(context)
            host = self.relay_calls.enter(context.peer(), len(self.replica.leaders))
            first = await self.idle.first(request_iterator, tenant, self._first_within_s,
                                          "a relay starts with a message naming its job")
            self.admit(context, first, relay=True)
            port = await self.replica.open_relay(first)
            named = self.relay_calls.name(host, first.job)  # before any of its streams is attached
            release = self.hold(lambda: self.relay_role(context), port.end)
            log.info("relay_attached", job=first.job, relay=port.link.relay)
            async for down in port.serve(first, request_iterator):
                yield down
        except errors.MusterError as exc:
            refusals.refused("relay_refused", STATUS_OF[type(exc)].name, str(exc)[:MAX_MESSAGE_CHARS])
            await _abort(context, exc)
        finally:
            if release:
                release()
            if port:
                port.close()
            if host:
                self.relay_calls.leave(host, named)


def _decoder(message_type):
    """Parse a request of `message_type`, or return the refusal for bytes that are none (a string
    field that is not UTF-8, a truncated field): grpc.aio answers a deserializer that raises with
    UNKNOWN, so the servicer raises the refusal instead (`admit`, `ports.feed_each`)."""
    name = message_type.DESCRIPTOR.full_name

    def decode(data: bytes):
        try:
            return message_type.FromString(data)
        except DecodeError as exc:
            return errors.InvalidArgument(f"request is not valid {name}: {exc}")

    return decode


def _handlers(servicer: CoordinatorServicer) -> dict[str, grpc.RpcMethodHandler]:
    """The service's methods as the generated `add_CoordinatorServicer_to_server` has them, with
    request deserializers that refuse undecodable bytes (`_decoder`)."""
    return {
        method.name: HANDLER_OF[method.client_streaming, method.server_streaming](
            getattr(servicer, method.name),
            request_deserializer=_decoder(GetMessageClass(method.input_type)),
            response_serializer=GetMessageClass(method.output_type).SerializeToString,
        )
        for method in SERVICE.methods
    }


async def create_server(
    replica: Replica, listen: str = "127.0.0.1:0", *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    tokens: Tokens | None = None, credentials: grpc.ServerCredentials | None = None, replica_cert: bytes | None = None,
) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
            ("grpc.keepalive_permit_without_calls", 1),
            # No bandwidth-delay probing: a PING per stream about every second, to size windows that
            # heartbeat frames never fill (1,000 node streams: ~10% of the leader's CPU per frame).
            ("grpc.http2.bdp_probe", 0),
        ]
    )
    handlers = _handlers(CoordinatorServicer(replica, tokens, replica_cert))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
    server.add_registered_method_handlers(SERVICE.full_name, handlers)
    port = server.add_secure_port(listen, credentials) if credentials else server.add_insecure_port(listen)
    if port == 0:
        raise OSError(f"could not listen on {listen}")
    return server, port
