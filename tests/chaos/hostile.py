"""A hostile client on a coordinator's port, for the chaos suite: garbage bytes, oversized names,
a duplicate node, and a node's Session (a guessed secret) and Leave (none) with guessed member_ids.

Each probe returns an `Outcome`: what was sent and what came back (a gRPC status code name,
"OK" when the coordinator accepted it, or what the raw socket saw). The harness decides what is
allowed: every RPC must be refused with a precise status, and nothing may change in the job.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc

from muster.net import split_host_port
from muster.v1 import muster_pb2 as pb
from muster.v1 import muster_pb2_grpc as pb_grpc

RPC_TIMEOUT_S = 3.0
HUGE = 200_000  # characters: a name far past every limit, yet inside the 1 MiB message limit
OVER_MESSAGE_LIMIT = 2 << 20  # bytes: past the coordinator's --max-message-bytes (1 MiB)
# member_ids are small sequence numbers (one per Join of the job): guessing means counting up.
GUESSES = range(1, 33)
# A refusal must name its cause: these codes do; UNKNOWN/INTERNAL mean an unhandled error.
PRECISE_REFUSALS = frozenset({"INVALID_ARGUMENT", "FAILED_PRECONDITION", "NOT_FOUND", "ALREADY_EXISTS",
                              "RESOURCE_EXHAUSTED", "UNAUTHENTICATED", "PERMISSION_DENIED", "OUT_OF_RANGE"})


@dataclass
class Outcome:
    probe: str
    result: str  # a gRPC status code name, "OK" (accepted), or for raw bytes what the socket saw
    detail: str = ""
    rpc: bool = True  # False: raw bytes, no gRPC status to judge

    @property
    def accepted(self) -> bool:
        return self.rpc and self.result == "OK"

    @property
    def imprecise(self) -> bool:
        return self.rpc and self.result not in PRECISE_REFUSALS and self.result != "OK"

    def __str__(self) -> str:
        return f"{self.probe}: {self.result}" + (f" ({self.detail[:160]})" if self.detail else "")


def _raw(address: str, payload: bytes, what: str) -> Outcome:
    try:
        with socket.create_connection(split_host_port(address), timeout=2.0) as s:
            s.settimeout(1.0)
            if payload:
                s.sendall(payload)
            try:
                answer = s.recv(256)
                seen = f"answered {len(answer)} bytes" if answer else "closed by the server"
            except TimeoutError:
                seen = "no answer within 1 s"
            except ConnectionResetError:
                seen = "reset by the server"
    except OSError as exc:
        return Outcome(what, f"socket error: {exc}", rpc=False)
    return Outcome(what, seen, rpc=False)


def garbage(address: str) -> list[Outcome]:
    """Bytes that are not gRPC: random noise, HTTP/1.1, an HTTP/2 preface followed by a frame
    header announcing 16 MiB and noise, and a connection closed at once."""
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    return [
        _raw(address, os.urandom(4096), "4 KiB of random bytes"),
        _raw(address, b"GET / HTTP/1.1\r\nHost: muster\r\n\r\n", "an HTTP/1.1 request"),
        _raw(address, preface + b"\xff\xff\xff\x00\x00\x00\x00\x00\x01" + os.urandom(512),
             "an HTTP/2 preface, a 16 MiB frame header and noise"),
        _raw(address, b"", "a connection closed at once"),
    ]


def _call(what: str, fn: Callable[[], object]) -> Outcome:
    try:
        fn()
    except grpc.RpcError as exc:
        return Outcome(what, exc.code().name, exc.details() or "")
    return Outcome(what, "OK")


def _session(stub: pb_grpc.CoordinatorStub, frames: list[pb.NodeFrame]) -> None:
    """Open a Session with `frames`; returns if any directive comes back (the stream was accepted)."""
    def requests() -> Iterator[pb.NodeFrame]:
        yield from frames
        time.sleep(0.5)  # keep the stream open long enough for the first directive
    call = stub.Session(requests(), timeout=RPC_TIMEOUT_S)
    try:
        for _ in call:
            return  # a directive: this client now speaks for the node
    finally:
        call.cancel()


def oversized(stub: pb_grpc.CoordinatorStub, job: str) -> list[Outcome]:
    big = "n" * HUGE
    join = dict(job=job, node_id="intruder", slots=1, host="127.0.0.1", store_port=1)
    return [
        _call(f"Join with a {HUGE}-character job name",
              lambda: stub.Join(pb.JoinRequest(**{**join, "job": "j" * HUGE}), timeout=RPC_TIMEOUT_S)),
        _call(f"Join with a {HUGE}-character node_id",
              lambda: stub.Join(pb.JoinRequest(**{**join, "node_id": big}), timeout=RPC_TIMEOUT_S)),
        _call(f"Join with a {OVER_MESSAGE_LIMIT >> 20} MiB host (past the message limit)",
              lambda: stub.Join(pb.JoinRequest(**{**join, "host": "h" * OVER_MESSAGE_LIMIT}), timeout=RPC_TIMEOUT_S)),
        _call(f"Status of a {HUGE}-character job name",
              lambda: stub.Status(pb.StatusRequest(job="j" * HUGE), timeout=RPC_TIMEOUT_S)),
        _call(f"Session naming a {HUGE}-character node_id",
              lambda: _session(stub, [pb.NodeFrame(job=job, node_id=big, member_id=1)])),
        _call(f"Leave naming a {HUGE}-character node_id",
              lambda: stub.Leave(pb.LeaveRequest(job=job, node_id=big, member_id=1, immediate=True),
                                 timeout=RPC_TIMEOUT_S)),
    ]


def impostor_join(stub: pb_grpc.CoordinatorStub, job: str, node: str, slots: int) -> list[Outcome]:
    return [_call(f"Join as existing node {node!r}",
                  lambda: stub.Join(pb.JoinRequest(job=job, node_id=node, slots=slots, host="127.0.0.1",
                                                   store_port=1), timeout=RPC_TIMEOUT_S))]


def _guesses(real_member_id: int) -> list[int]:
    return sorted(set(GUESSES) | {real_member_id})


def _keep(o: Outcome, member_id: int, real_member_id: int) -> bool:
    """Report the real guess and anything not refused precisely; the 30 plain refusals say nothing."""
    return o.accepted or o.imprecise or member_id == real_member_id


def impostor_session(stub: pb_grpc.CoordinatorStub, job: str, node: str, real_member_id: int,
                     slots: int) -> list[Outcome]:
    """Count member_ids up (the real one among them) on a Session that speaks for `node` (its
    rejoin identity and all) with a guessed secret, reporting a rank exit. Stops at the first one
    accepted: one shows the hole, more would only break more."""
    out = []
    rejoin = pb.JoinRequest(job=job, node_id=node, slots=slots, host="127.0.0.1", store_port=1)
    for member_id in _guesses(real_member_id):
        frames = [pb.NodeFrame(job=job, node_id=node, member_id=member_id, rejoin=rejoin, session_secret=b"guessed"),
                  pb.NodeFrame(job=job, node_id=node, member_id=member_id,
                               exits=[pb.RankExit(local_rank=0, pid=1, exit_code=-9)])]
        o = _call(f"Session as {node!r} with guessed member_id {member_id}"
                  + (" (the real one)" if member_id == real_member_id else "") + ", a guessed secret, reporting an exit",
                  lambda: _session(stub, frames))
        if _keep(o, member_id, real_member_id):
            out.append(o)
        if o.accepted:
            break
    return out


def impostor_leave(stub: pb_grpc.CoordinatorStub, job: str, node: str, real_member_id: int) -> list[Outcome]:
    """An immediate Leave of `node` for every guessed member_id, without the secret."""
    out = []
    for member_id in _guesses(real_member_id):
        o = _call(f"immediate Leave of {node!r} with guessed member_id {member_id}"
                  + (" (the real one)" if member_id == real_member_id else "") + ", no secret",
                  lambda: stub.Leave(pb.LeaveRequest(job=job, node_id=node, member_id=member_id, immediate=True,
                                                     reason="hostile"), timeout=RPC_TIMEOUT_S))
        if _keep(o, member_id, real_member_id):
            out.append(o)
        if o.accepted:
            break
    return out


def attack(leader: str, replicas: list[str], job: str, node: str, real_member_id: int, slots: int,
           between: Callable[[str], None] = lambda probe: None) -> list[Outcome]:
    """Everything above: garbage on every replica's port, then the RPCs against the leader.
    `between(probe)` runs after each group (the harness looks for changes there)."""
    out: list[Outcome] = []
    for address in replicas:
        out += garbage(address)
    between("garbage bytes")
    with grpc.insecure_channel(leader, options=[("grpc.max_send_message_length", 4 * OVER_MESSAGE_LIMIT)]) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        out += oversized(stub, job)
        between("oversized names")
        out += impostor_join(stub, job, node, slots)
        between(f"a Join as existing node {node}")
        out += impostor_session(stub, job, node, real_member_id, slots)
        between(f"Sessions as {node} with guessed member_ids and secret")
        out += impostor_leave(stub, job, node, real_member_id)
        between(f"Leaves of {node} with guessed member_ids and no secret")
    return out
