"""Simulated nodes whose Session streams are written as raw HTTP/2: a load generator that costs
less than what it measures (as h2load does for web servers).

A node joins with the real client (`NodeSession.join`: Join, relay choice), then opens its Session
on a TCP connection of its own and writes each NodeFrame as one HTTP/2 DATA frame, at its own phase
in the interval (the crc32 phase the agent uses). The leader sees exactly what an agent sends: one
connection per node, the gRPC framing, the frames' fields (secret, rejoin, stream_seq on the first),
its ranks' steps advancing by one per frame, `steps_only` when nothing else changed. Directives
are read back (assignment -> generation, the frame's term); SETTINGS and PING are acknowledged and
the peer's flow-control window is kept. The gRPC aio client costs ~80 us of CPU per frame here, as
much as the leader it drives; this one costs ~15: on a 2-core host the cores stay with the leader.

No reconnection, no TLS, no token: a bench client for a leader or relay on loopback.
"""

from __future__ import annotations

import asyncio
import struct
import time
import zlib

from muster.v1 import muster_pb2 as pb
from muster.worker.node_session import NodeIdentity, NodeSession

PATH = b"/muster.v1.Coordinator/Session"
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7, 0x8
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
STREAM = 1
OUR_WINDOW = 2**31 - 1  # the directives never fill it: no WINDOW_UPDATE to send after the first
INITIAL_WINDOW = 65_535


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes((kind, flags)) + struct.pack(">I", stream) + payload


def _header(name: bytes, value: bytes) -> bytes:
    """HPACK: a literal header field without indexing, names and values not Huffman-coded."""
    assert len(name) < 127 and len(value) < 127
    return b"\x00" + bytes((len(name),)) + name + bytes((len(value),)) + value


def _opening(authority: str) -> bytes:
    headers = b"".join(_header(n, v) for n, v in (
        (b":method", b"POST"), (b":scheme", b"http"), (b":path", PATH), (b":authority", authority.encode()),
        (b"content-type", b"application/grpc"), (b"te", b"trailers")))
    return (PREFACE
            + _frame(SETTINGS, 0, 0, struct.pack(">HI", 0x4, OUR_WINDOW))  # SETTINGS_INITIAL_WINDOW_SIZE
            + _frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", OUR_WINDOW - INITIAL_WINDOW))
            + _frame(HEADERS, END_HEADERS, STREAM, headers))


class RawNode(asyncio.Protocol):
    """One simulated node: its Session over its own connection. `silent = True` stops its frames
    (the stream stays open), as `muster.local.SimulatedNode`."""

    def __init__(self, addresses: list[str], job: str, node_id: str, *, slots: int, spec: pb.JobSpec,
                 interval_s: float):
        self.session = NodeSession(addresses, NodeIdentity(job, node_id, slots, "127.0.0.1", 29500, spec),
                                   reports=list, on_directive=lambda d: None)
        self.node_id = node_id
        self.interval_s = interval_s
        self.phase_s = zlib.crc32(node_id.encode()) / 2**32 * interval_s
        self.step = 0
        self.generation = 0
        self.silent = False
        self.errors: list[str] = []
        self.skipped = 0  # frames not written: the peer's flow-control window was full
        self._transport: asyncio.Transport | None = None
        self._closing = False
        self._peer = ""
        self._template = pb.NodeFrame()
        self._first = True
        self._changed = True  # since the last frame written: it is not steps_only (as an agent's)
        self._inbound = b""
        self._messages = b""
        self._send_window = {0: INITIAL_WINDOW, STREAM: INITIAL_WINDOW}
        self._stream_initial = INITIAL_WINDOW

    async def join(self) -> None:
        await self.session.join(retry_for_s=10)
        s = self.session
        self._template = pb.NodeFrame(job=s.identity.job, node_id=self.node_id, member_id=s.member_id, term=s.term)

    async def open(self) -> None:
        """The Session stream: to the node's relay if the job relays it, else to the leader."""
        s = self.session
        self._peer = s.relay or s.leader or s.addresses[0]
        host, _, port = self._peer.rpartition(":")
        await asyncio.get_running_loop().create_connection(lambda: self, host.strip("[]"), int(port))

    def send(self) -> None:
        """Write this node's next frame (its active ranks one step on)."""
        if self.silent or self._transport is None or self._transport.is_closing():
            return
        t = self._template
        if self._first:
            s = self.session
            t.session_secret = s.secret
            t.rejoin.CopyFrom(s._join_request())
            t.via_relay = bool(s.relay)
            t.stream_seq = 1
        elif t.ranks:
            self.step += 1
            for r in t.ranks:
                r.step = self.step
        t.steps_only = not self._changed
        body = t.SerializeToString()
        size = len(body) + 5
        if min(self._send_window[0], self._send_window[STREAM]) < size:
            self.skipped += 1
            return
        self._send_window[0] -= size
        self._send_window[STREAM] -= size
        self._transport.write(_frame(DATA, 0, STREAM, b"\x00" + struct.pack(">I", len(body)) + body))
        self._changed = False
        if self._first:
            self._first = False
            for name in ("session_secret", "rejoin", "via_relay", "stream_seq"):
                t.ClearField(name)

    async def stop(self) -> None:
        self._closing = True
        if self._transport is not None:
            self._transport.close()

    # ---- asyncio.Protocol: what the peer sends -------------------------------------------------

    def connection_made(self, transport) -> None:
        transport.write(_opening(self._peer))  # before anything the pump writes
        self._transport = transport

    def connection_lost(self, exc) -> None:
        if not self._closing:
            self.errors.append(f"connection lost: {exc!r}")

    def data_received(self, data: bytes) -> None:
        buf = self._inbound + data
        at = 0
        while len(buf) - at >= 9:
            length = int.from_bytes(buf[at:at + 3], "big")
            if len(buf) - at < 9 + length:
                break
            kind, flags = buf[at + 3], buf[at + 4]
            stream = int.from_bytes(buf[at + 5:at + 9], "big") & 0x7FFFFFFF
            payload = buf[at + 9:at + 9 + length]
            at += 9 + length
            self._on_frame(kind, flags, stream, payload)
        self._inbound = buf[at:]

    def _on_frame(self, kind: int, flags: int, stream: int, payload: bytes) -> None:
        if kind == DATA:
            self._messages += payload
            self._on_messages()
        elif kind == SETTINGS and not flags & ACK:
            for i in range(0, len(payload), 6):
                ident, value = struct.unpack(">HI", payload[i:i + 6])
                if ident == 0x4:  # the peer's SETTINGS_INITIAL_WINDOW_SIZE: our stream's window moves by it
                    self._send_window[STREAM] += value - self._stream_initial
                    self._stream_initial = value
            self._transport.write(_frame(SETTINGS, ACK, 0, b""))
        elif kind == PING and not flags & ACK:
            self._transport.write(_frame(PING, ACK, 0, payload))
        elif kind == WINDOW_UPDATE:
            self._send_window[stream if stream else 0] = (
                self._send_window.get(stream, 0) + (int.from_bytes(payload[:4], "big") & 0x7FFFFFFF))
        elif kind == HEADERS and flags & END_STREAM:
            self.errors.append(f"stream ended by the peer (trailers {payload[:200]!r})")
        elif kind == RST_STREAM:
            self.errors.append(f"stream reset: code {int.from_bytes(payload[:4], 'big')}")
        elif kind == GOAWAY:
            self.errors.append("connection going away")

    def _on_messages(self) -> None:
        """gRPC messages (a flag byte and a 4-byte length each) out of the DATA received so far."""
        buf = self._messages
        while len(buf) >= 5:
            length = int.from_bytes(buf[1:5], "big")
            if len(buf) < 5 + length:
                break
            directive = pb.Directive.FromString(buf[5:5 + length])
            buf = buf[5 + length:]
            if directive.term != self._template.term:
                self._template.term, self._changed = directive.term, True
            if directive.HasField("assignment"):
                self._assigned(directive.assignment)
        self._messages = buf

    def _assigned(self, a: pb.Assignment) -> None:
        """A new map: the frames carry its generation and the ranks it runs (as an agent's would)."""
        self.generation = a.generation
        self._changed = True
        t = self._template
        t.generation = a.generation
        del t.ranks[:]
        if a.role == pb.ROLE_ACTIVE:
            for s in a.local_ranks:
                t.ranks.add(local_rank=s, pid=10_000 + s, step=self.step, step_time_us=50_000,
                            state=pb.RANK_STATE_RUNNING, compute_us=30_000)  # measured: stragglers are looked for
        elif a.start_ranks:  # joining a running job: the ranks start first, then get a place
            for s in a.down_local_ranks:
                t.ranks.add(local_rank=s, pid=10_000 + s, state=pb.RANK_STATE_STARTING)


async def pump(nodes: list[RawNode], stop: asyncio.Event, tick_s: float = 0.001) -> None:
    """Write every node's frames at its own phase in its interval, until `stop`: one timer for all
    (wakes every `tick_s` and writes the frames that are due), not one per node."""
    if not nodes:
        return
    interval = nodes[0].interval_s
    order = sorted(nodes, key=lambda n: n.phase_s)
    phases = [n.phase_s for n in order]
    start = time.time()
    cycle = int(start // interval)
    i = next((k for k, p in enumerate(phases) if cycle * interval + p >= start), None)
    if i is None:  # every phase of this cycle has passed
        i, cycle = 0, cycle + 1
    while not stop.is_set():
        now = time.time()
        while cycle * interval + phases[i] <= now:
            order[i].send()
            i += 1
            if i == len(order):
                i, cycle = 0, cycle + 1
        await asyncio.sleep(tick_s)

