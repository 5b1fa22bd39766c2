"""The client side of the Muster protocol for one node: join, keep one Session stream to the
job's leader, follow leader changes, leave.

The leader pulses every stream; a stream that stays silent for the heartbeat timeout is ended
and another replica is tried (a frozen or partitioned leader). Standbys answer UNAVAILABLE with
a `muster-leader` hint, which is followed. A node of a large job (JoinResponse.relay) streams
through the replica its node_id hashes to (`relay_of`), which relays it to the leader; a relay
that refuses or cannot be reached is left for the leader for a while. Used by the worker library, the node agent and the
simulated nodes of `muster.local`. Runs on one asyncio loop.
"""

from __future__ import annotations

import asyncio
import random
import secrets
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc
import structlog

from muster.client import TRANSIENT, leader_hint, parse_addresses, redirect, relay_of, run_ended
from muster.net import Backoff
from muster.security import ClientSecurity
from muster.v1 import muster_pb2 as pb
from muster.v1 import muster_pb2_grpc as pb_grpc

log = structlog.get_logger(__name__)

RELAY_AVOID_TIMEOUTS = 5  # a relay that refused or did not answer is skipped for this many heartbeat timeouts
RECONNECT_FIRST_S = 0.02  # a lost stream is taken up again at once: recovery waits on it
RECONNECT_MOST_S = 1.0  # and at most heartbeat_timeout/8 (then this) apart while nothing answers
# A Leave follows the frame carrying the node's last exit reports by this much: frames and Leave are
# separate calls, and the leader ignores a node's frames read after its Leave (a CI run lost a
# given-up slot's final crash that way; the run still failed).
EXITS_BEFORE_LEAVE_S = 0.1
JOIN_KEY_BYTES = 32  # JoinRequest.join_key


def job_spec(min_nodes: int, max_nodes: int, world_size_multiple: int,
             stragglers: tuple[str, float, int], on_state_lost: str = "") -> pb.JobSpec:
    """The spec a node asks for when it creates the job (0 and "": the coordinator's defaults);
    `stragglers` is the job's (action, factor, min steps)."""
    action, factor, min_steps = stragglers
    return pb.JobSpec(min_nodes=min_nodes, max_nodes=max_nodes, world_size_multiple=world_size_multiple,
                      straggler_action=action, straggler_factor=factor, straggler_min_steps=min_steps,
                      on_state_lost=on_state_lost)


def shape(frame: pb.NodeFrame) -> tuple:
    """What a frame reports but its ranks' steps, step and compute times and heard_ms_ago
    (`NodeFrame.steps_only`)."""
    return (frame.term, frame.generation, [(r.local_rank, r.pid, r.state, r.phase, r.generation, r.digest_step,
                                            r.digest, r.restarts, r.snapshot_every, r.snapshot_bytes, r.reform.generation)
                                           for r in frame.ranks])


class Evicted(Exception):
    """The coordinator fenced this node out (or it never was a member): rejoin as a new member."""


def evicted(d: pb.Directive) -> str | None:
    """Why `d` evicts its receiver from the job, or None: the one check of every transport and the
    agent (an evicted node joins again or ends; its stream raises Evicted)."""
    if d.HasField("assignment") and d.assignment.role == pb.ROLE_EVICTED:
        return d.assignment.reason
    return None


class JobEnded(Exception):
    """The job's run ended (`JobEnd`: succeeded, failed or stopped): nothing more to run here."""

    def __init__(self, end: pb.JobEnd):
        super().__init__(f"run {end.run} of the job ended: {end.outcome}" + (f" ({end.reason})" if end.reason else ""))
        self.end = end


@dataclass
class NodeIdentity:
    job: str
    node_id: str
    slots: int
    host: str
    store_port: int
    spec: pb.JobSpec = field(default_factory=pb.JobSpec)
    is_process: bool = False
    agent_pid: int = 0
    master_port: int = 0


class NodeSession:
    def __init__(
        self,
        addresses: str | Sequence[str],
        identity: NodeIdentity,
        *,
        reports: Callable[[], Sequence[pb.RankReport]],
        on_directive: Callable[[pb.Directive], None],
        rpc_timeout_s: float = 5.0,
        security: ClientSecurity | None = None,
    ):
        self.addresses = parse_addresses(addresses)
        self.security = security or ClientSecurity()  # token and TLS
        self.identity = identity
        self._reports = reports
        self._on_directive = on_directive
        self.rpc_timeout_s = rpc_timeout_s
        self.member_id = 0
        self.secret = b""  # from Join: proves on each stream and on Leave that this node is the member
        # On every attempt of one join, new once it is answered: a leader that admitted an attempt
        # whose answer was lost (a deadline, under load) answers the next one with that membership.
        self._join_key = secrets.token_bytes(JOIN_KEY_BYTES)
        self.term = 0  # the term of the leader last heard
        self.generation = 0  # the generation this node runs: set by the owner
        # ...its world size and this node's ranks in it (set with it): a rebuilt leader keeps a whole group
        self.sizes: tuple[int, int] = (0, 0)
        self.joined_run = 0  # the run of the job's name this node joined (JoinResponse.run)
        self.heard_as_member = False  # a directive came since the latest Join
        self.finishing = False  # the leader said a rank finished its script: the job is ending
        self.leader = ""
        self.relay = ""  # the replica this node streams through ("": straight to the leader)
        self._relay_avoided_until = 0.0
        self.heartbeat_interval_s = 0.1
        self.heartbeat_timeout_s = 2.0
        self.exits: list[pb.RankExit] = []  # appended by the owner, sent with the next frame
        self._exits_sent_at = -1e9  # (monotonic) the last frame with exit reports left
        self.paused = False  # send no frames (tests simulate a hung node with it)
        self.pulses = 0  # the leader's pulses heard (a relayed node's come from its relay)
        self.retry_sleep = asyncio.sleep  # the wait between attempts (a test's fake time goes here)
        self._streams_opened = 0  # NodeFrame.stream_seq of the latest stream
        self._call = None
        self._stopping = False
        self._leader_silent = False
        self._heard_at = 0.0
        self._heard_from_leader = time.monotonic()  # wall of the hold timeout: starts counting at creation
        self._suspect: dict[str, float] = {}  # address -> until when it is not trusted (it went silent)
        self._wake = asyncio.Event()
        self.log = log.bind(job=identity.job, node=identity.node_id)

    # ---- unary calls -----------------------------------------------------------------

    async def _unary(self, rpc: str, request, *, retry_for_s: float):
        """Call the job's leader, following hints; retry UNAVAILABLE with backoff and jitter."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + retry_for_s
        backoff = Backoff(0.05, 1.0)
        while True:
            order = ([self.leader] if self.leader else []) + self.addresses
            last: grpc.aio.AioRpcError | None = None
            for _ in range(len(self.addresses) + 3):
                if not order:
                    break
                address = order.pop(0)
                async with self.security.aio_channel(address) as channel:
                    try:
                        response = await getattr(pb_grpc.CoordinatorStub(channel), rpc)(
                            request, timeout=self.rpc_timeout_s, metadata=self.security.metadata)
                        self.leader = address
                        self._heard_from_leader = time.monotonic()
                        return response
                    except grpc.aio.AioRpcError as exc:
                        if not redirect(exc, address, order):
                            raise
                        last = exc
            if loop.time() >= deadline:
                raise last or TimeoutError(f"{rpc}: no coordinator answered")
            await asyncio.sleep(backoff.next())

    def _join_request(self) -> pb.JoinRequest:
        i = self.identity
        return pb.JoinRequest(job=i.job, node_id=i.node_id, slots=i.slots, host=i.host, store_port=i.store_port,
                              spec=i.spec, agent_pid=i.agent_pid, is_process=i.is_process, master_port=i.master_port)

    async def join(self, *, retry_for_s: float = 30.0) -> pb.JoinResponse:
        request = self._join_request()
        request.join_key = self._join_key
        response = await self._unary("Join", request, retry_for_s=retry_for_s)
        self._join_key = secrets.token_bytes(JOIN_KEY_BYTES)
        self.member_id = response.member_id
        self.joined_run = response.run
        self.heard_as_member = False
        self.secret = response.session_secret
        self.term = response.term
        self.heartbeat_interval_s = response.heartbeat_interval_ms / 1000
        self.heartbeat_timeout_s = response.heartbeat_timeout_ms / 1000
        # Over the replicas other than the leader: the leader reads relays' changes, not frames.
        others = [a for a in self.addresses if a != self.leader] or self.addresses
        self.relay = relay_of(self.identity.node_id, others) if response.relay else ""
        self.log.info("node_joined", member=self.member_id, leader=self.leader, term=response.term,
                      relay=self.relay or None, host=self.identity.host)
        return response

    async def leave(self, *, immediate: bool = False, finished: bool = False, reason: str = "",
                    retry_for_s: float = 10.0) -> pb.LeaveResponse:
        await self._exits_out()
        i = self.identity
        return await self._unary("Leave", pb.LeaveRequest(
            job=i.job, node_id=i.node_id, member_id=self.member_id, immediate=immediate, finished=finished,
            reason=reason, session_secret=self.secret), retry_for_s=retry_for_s)

    # ---- the stream ------------------------------------------------------------------

    def frame(self) -> pb.NodeFrame:
        exits, self.exits = self.exits, []
        i = self.identity
        return pb.NodeFrame(job=i.job, node_id=i.node_id, member_id=self.member_id, term=self.term,
                            generation=self.generation, ranks=self._reports(), exits=exits)

    async def _exits_out(self, within_s: float = 1.0) -> None:
        """Queued exit reports leave in a frame EXITS_BEFORE_LEAVE_S ahead of the Leave (bounded)."""
        self.send_now()
        deadline = time.monotonic() + within_s
        while self.exits and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        await asyncio.sleep(max(0.0, self._exits_sent_at + EXITS_BEFORE_LEAVE_S - time.monotonic()))

    def send_now(self) -> None:
        """Send a frame at once (an exit report must not wait for the interval)."""
        self._wake.set()

    def _until_next_frame(self) -> float:
        """Seconds to this node's next frame. Nodes keep their own phase in the interval (a stable
        hash of the node id, on the wall clock shared by the hosts): in synchronous training every
        node would otherwise report at the same moment, and the leader take N frames in a burst."""
        interval = self.heartbeat_interval_s
        phase = zlib.crc32(self.identity.node_id.encode()) / 2**32 * interval
        wait = interval - (time.time() - phase) % interval
        return wait if wait >= interval / 2 else wait + interval  # never two frames back to back

    async def _frames(self, relayed: bool):
        first = True
        last = None  # the shape of this stream's previous frame
        while True:
            if not self.paused:
                frame = self.frame()
                now = shape(frame)
                # Only steps advanced since the previous frame: the leader reads three fields a rank.
                frame.steps_only = not first and now == last and not frame.exits
                if frame.exits:
                    self._exits_sent_at = time.monotonic()
                last = now
                if first:
                    # Who this node is, on every new stream: its secret, and its Join, from which a
                    # leader that lost the job's state (etcd lost its data) takes it back.
                    frame.session_secret = self.secret
                    frame.rejoin.CopyFrom(self._join_request())
                    frame.world_size, frame.local_world_size = self.sizes
                    frame.via_relay = relayed
                    frame.run = self.joined_run
                    self._streams_opened += 1
                    frame.stream_seq = self._streams_opened
                    first = False
                yield frame
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), self._until_next_frame())
            except TimeoutError:
                pass

    async def run(self) -> None:
        """Stream until stopped. Raises Evicted when fenced out, JobEnded when the job's run ended,
        AioRpcError on a refusal."""
        # Attempts that heard nothing back off: during an etcd outage every node of a large job
        # was refused at once ~21 times a second, by relays and replicas that could do nothing.
        retry = Backoff(RECONNECT_FIRST_S, min(RECONNECT_MOST_S, self.heartbeat_timeout_s / 8))
        while not self._stopping:
            loop = asyncio.get_running_loop()
            address, relayed = self._route(loop.time())
            self._leader_silent = False
            hint, evicted, ended = "", None, None
            heard = False
            try:
                async with self.security.aio_channel(address) as channel:
                    self._call = call = pb_grpc.CoordinatorStub(channel).Session(self._frames(relayed),
                                                                                 metadata=self.security.metadata)
                    watchdog = asyncio.create_task(self._watch(call, channel, address, relayed))
                    try:
                        async for directive in call:
                            self._heard_at = loop.time()
                            heard = True
                            evicted = self._directive(directive)
                            if directive.HasField("end"):
                                ended = directive.end
                                break
                            if evicted is not None:
                                break
                        else:
                            return
                    finally:
                        watchdog.cancel()
            except asyncio.CancelledError:
                if self._stopping:
                    return
                if not self._leader_silent:
                    raise
                self.log.warning("leader_silent", leader=address, timeout_s=self.heartbeat_timeout_s)
                # Standbys name it as leader until its lease expires: do not go straight back.
                self._suspect[address] = asyncio.get_running_loop().time() + 2 * self.heartbeat_timeout_s
            except grpc.aio.AioRpcError as exc:
                if self._stopping:
                    return
                ended = run_ended(exc)  # it ended while this node was away: end as it did
                if ended is not None:
                    raise JobEnded(ended) from exc
                if exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
                    evicted = exc.details()
                elif exc.code() not in TRANSIENT:
                    raise
                else:
                    hint = leader_hint(exc)
            if ended is not None:
                raise JobEnded(ended)
            if evicted is not None:  # told so on the stream, or refused as no member
                raise Evicted(evicted)
            now = asyncio.get_running_loop().time()
            if relayed and (not heard or self._leader_silent):
                # Refused (--no-relay), unreachable or silent: the leader takes this node for a while.
                self._relay_avoided_until = now + RELAY_AVOID_TIMEOUTS * self.heartbeat_timeout_s
                self.log.info("relay_avoided", relay=address, leader=hint or None)
            if hint and self._suspect.get(hint, 0) > now and await self._probe(hint):
                # It went silent before but leads now (it lost etcd and won again): a new leader's
                # grace is short, so going back must not wait for the suspicion to end.
                del self._suspect[hint]
            trusted = [a for a in self.addresses if self._suspect.get(a, 0) <= now]
            others = [a for a in trusted if a != address] or trusted or self.addresses
            self.leader = hint if hint and self._suspect.get(hint, 0) <= now else random.choice(others)
            if heard:
                retry.reset()
            await self.retry_sleep(retry.next())

    def _route(self, now: float) -> tuple[str, bool]:
        """Where the next stream goes, and whether that is a relay: the relay, unless this node avoids
        it for a while or just found it silent (a relay that was also the frozen leader was tried
        again at once, and the new leader judged the node silent meanwhile); else the leader."""
        relayed = bool(self.relay) and self.relay != self.leader and now >= self._relay_avoided_until \
            and self._suspect.get(self.relay, 0) <= now
        return (self.relay if relayed else self.leader or self.addresses[0]), relayed

    async def _probe(self, address: str) -> bool:
        """Does `address` lead the job and answer? (A frozen leader does not.)"""
        async with self.security.aio_channel(address) as channel:
            return await self._leads(channel, address)

    def silent_s(self) -> float:
        """Seconds since the coordinator was last heard (a directive, a pulse, an answer)."""
        return time.monotonic() - self._heard_from_leader

    def _directive(self, d: pb.Directive) -> str | None:
        """Handle one directive; the reason if it evicts this node."""
        self._heard_from_leader = time.monotonic()
        self.heard_as_member = True
        # The leader's, even when lower than one seen before: after etcd lost its data, terms
        # (etcd revisions) start again, and a frame ahead of its leader's term is refused.
        self.term = d.term
        self.finishing = self.finishing or d.finishing
        if d.WhichOneof("kind") is None:
            self.pulses += 1
            return None
        self._on_directive(d)
        return evicted(d)

    async def _watch(self, call, channel, address: str, relayed: bool) -> None:
        """End a stream whose leader (or relay) went silent, but only once a probe confirms it is
        not serving: for a process node, closing its stream reads as its exit. A relay is given
        half the heartbeat timeout: the leader, alive, counts this node's silence meanwhile. The
        probe waits a quarter of the timeout: a frozen leader is left within 1.5 timeouts of its
        last pulse, before its successor's grace (a timeout after the first node reaches it) ends;
        with a probe of a whole timeout, 2.25 timeouts, the nodes on it came after that."""
        loop = asyncio.get_running_loop()
        self._heard_at = loop.time()
        limit = self.heartbeat_timeout_s / (2 if relayed else 1)
        while True:
            await asyncio.sleep(limit / 4)
            if loop.time() - self._heard_at <= limit:
                continue
            if await self._leads(channel, address, relayed):
                self._heard_at = loop.time()  # slow, not gone
                continue
            self._leader_silent = True
            call.cancel()
            return

    async def _leads(self, channel, address: str, relayed: bool = False) -> bool:
        """Does `address` lead the job and answer? A relay need only answer and know a leader."""
        try:
            status = await pb_grpc.CoordinatorStub(channel).Status(
                pb.StatusRequest(job=self.identity.job, brief=True),
                timeout=self.heartbeat_timeout_s / 4,
                metadata=self.security.metadata)
        except grpc.aio.AioRpcError:
            return False
        if relayed:
            return bool(status.jobs) and bool(status.jobs[0].leader)
        return bool(status.jobs) and status.jobs[0].live and status.jobs[0].leader == address

    async def stop(self) -> None:
        """End the stream the gRPC way: cancelling a pending read from asyncio can wedge it."""
        self._stopping = True
        if self._call is not None:
            self._call.cancel()
