"""Relays: a replica terminates the node streams of a job it does not lead and carries them to the
job's leader on one multiplexed `Relay` stream, so that the leader reads one message per relay and
batch window instead of one per node frame.

Up, each batch holds each node's latest frame only (its exits merged in, never dropped; a batch
with an exit goes at once), the streams that ended and the nodes found silent. Only changes go
up: a frame that changes what the leader judges by (rank states, pids, generations, phases,
reform phases, digests, exits) goes in the next batch (the first advance after a change too: recovery is timed
by it); a frame with nothing new is not sent at all. The relay vouches for its nodes' liveness
instead: it judges their silence with the heartbeat timeout and says so; and, to a leader that
asks for it, for their progress: one `RelaySummary` every `progress_s` stands for every node's
frames that only advance steps, naming only the nodes that start or stop lagging. So the leader's
work is O(relays + changes), not O(nodes x frame rate). (To a leader before summaries, such a
frame is held, the latest replacing the last, and goes once `progress_s` has passed.) Down, the
leader's directives come back addressed by stream and are fanned out; a loss-only new map comes
once for all the relay's nodes (`RelayedMap`), and the relay renumbers each node's placement
itself (`renumbered`). The folding is `relay_fold`'s (pure), the leader's end of
one Relay call `relay_link`'s; here, the relaying replica's end (`Relay`).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
import structlog

from muster.client import leader_hint
from muster.coordinator.auth import Tokens
from muster.coordinator.codes import CLOSE_CODE, error_of
from muster.coordinator.errors import NotLeader
from muster.coordinator.core.relay_fold import Changes, FrameBatch, RelayedNode, placement_of, renumbered
from muster.coordinator.job.streams import CLOSE
from muster.net import Backoff
from muster.security import ClientSecurity, TlsFiles
from muster.v1 import muster_pb2 as pb
from muster.v1 import muster_pb2_grpc as pb_grpc

log = structlog.get_logger(__name__)

# How a leader refuses a Relay call for a job whose nodes it does not relay: they go to it at once.
NOT_RELAYED = grpc.StatusCode.FAILED_PRECONDITION.name
PULSE_SLICE = 64  # node streams a relay pulses per turn of its loop
RETRY_MOST_S = 0.5  # a relay's attempts on the leader back off to this (or heartbeat_timeout/8), jittered x2


@dataclass(frozen=True)
class PeerAccess:
    """How a replica calls another (a relay calls the leader): its client TLS and, where tokens are
    required, the relay token from the tokens file."""

    tls: TlsFiles = TlsFiles()  # --peer-tls-*
    tokens: Tokens | None = None

    def security(self) -> ClientSecurity:
        """The same for every job: relaying is a replica's role (`Tokens.check_relay`), not a job's."""
        return ClientSecurity(self.tokens.relay_token() if self.tokens else "", self.tls)



class Relay:
    """This replica's relay of one job it does not lead: one Relay call to the leader. Until the
    leader accepts the call, a refused or failed attempt is retried (the leader looked up again, the
    unsent frames kept) for up to `connect_s`, counted afresh from a new leader's election; once the
    call ends, every node stream it carried ends with UNAVAILABLE and a leader hint, and the replica
    opens a new Relay for the next node."""

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
        self._task: asyncio.Task | None = None
        self.log = log.bind(job=job, relay=address)

    def start(self) -> None:
        """Call the leader (and go on calling it, as `_run` says), in this replica's loop."""
        self._task = asyncio.create_task(self._run(), name=f"relay:{self.job}")

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
        start = loop.time()
        deadline = start + self.connect_s
        tried = {self.leader}
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
            if self.leader and self.leader not in tried:
                # A leader elected meanwhile gets the whole `connect_s` to take the call: a dead one's
                # key outlives it by up to the session TTL, then etcd's lease check and the takeover
                # take their time, and a relay that gave up just before put its nodes on the new
                # leader directly, all at once (bounded: twice `connect_s` in all).
                tried.add(self.leader)
                deadline = min(start + 2 * self.connect_s, max(deadline, loop.time() + self.connect_s))
        self.accepting = False
        if self._pulsing is not None:
            self._pulsing.cancel()
        if self.nodes:
            self.log.info("relay_ended", leader=self.leader, reason=reason, nodes=len(self.nodes), accepted=accepted)
        nodes, self.nodes = self.nodes, {}
        for node in nodes.values():  # each to the leader: the relay's call to it ended
            node.queue.put_nowait(NotLeader(self.job, self.leader))

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
        if self._task is not None:
            self._task.cancel()

    def fan_out(self, down: pb.RelayDown) -> None:
        """What the leader sent down, to the nodes it names (a loss-only map, to each node it does not
        name, renumbered); its pulse to every node, spread. A node's queue takes what a direct
        node's stream does: its directives, and how the stream ends (CLOSE, or an error of the tree)."""
        for item in down.items:
            node = self.nodes.get(item.stream)
            if node is None:
                continue  # it hung up meanwhile
            if not item.HasField("directive"):
                del self.nodes[item.stream]
                node.queue.put_nowait(CLOSE if item.end.code == CLOSE_CODE else error_of(item.end, self.job))
                continue
            if item.directive.HasField("assignment"):
                node.placement = placement_of(item.directive)
            node.queue.put_nowait(item.directive)
        if down.HasField("map"):
            own = set(down.map.own)
            for node in self.nodes.values():
                directive = None if node.stream_id in own else renumbered(node.placement, down.map)
                if directive is not None:
                    node.placement = placement_of(directive)
                    node.queue.put_nowait(directive)
        if down.HasField("pulse"):
            if self._pulsing is not None:
                self._pulsing.cancel()  # superseded
            self._pulsing = asyncio.create_task(self._pulse(down.pulse))

    async def _pulse(self, pulse: pb.Directive) -> None:
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


class Relays:
    """This replica's relays, one a job it relays and does not lead: a new one once the last
    stopped taking nodes."""

    def __init__(self, address: Callable[[], str], security: Callable[[], ClientSecurity],
                 find_leader: Callable[[str], Awaitable[str]], *, window_s: float, connect_s: float,
                 heartbeat_timeout_s: float, progress_s: float):
        # Both looked up for each new relay: the replica's address is known once its server listens,
        # and a reload may have changed the security
        self._address, self._security = address, security
        self._find_leader = find_leader
        self._timing = dict(window_s=window_s, connect_s=connect_s, heartbeat_timeout_s=heartbeat_timeout_s,
                            progress_s=progress_s)
        self._relays: dict[str, Relay] = {}

    def of(self, job: str, leader: str) -> Relay:
        """The relay of `job` (led at `leader`, "" unknown) that takes the next node."""
        relay = self._relays.get(job)
        if relay is None or not relay.accepting:
            relay = self._relays[job] = Relay(job, self._address(), leader, security=self._security(),
                                              find_leader=self._find_leader, **self._timing)
            relay.start()
        return relay

    def forget(self, job: str) -> None:
        relay = self._relays.pop(job, None)
        if relay is not None:
            relay.close()

    def close(self) -> None:
        for relay in self._relays.values():
            relay.close()
