"""A client for a coordinator deployment: give it any replicas, it finds the job's leader.

Dead addresses are skipped; an UNAVAILABLE answer carrying `muster-leader` is followed to
that address. Used by the CLI and the tests; agents and the worker library build on it.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence

import grpc

from muster.net import Backoff, split_host_port
from muster.security import ClientSecurity
from muster.v1 import muster_pb2 as pb
from muster.v1 import muster_pb2_grpc as pb_grpc

LEADER_METADATA = "muster-leader"
RUN_ENDED_METADATA = "muster-run-ended"
# Worth another try (another replica, or the same later). A replica killed mid-call can surface as
# INTERNAL ("Internal error from Core") or UNKNOWN rather than UNAVAILABLE; refusals use other codes.
TRANSIENT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                       grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})


def parse_addresses(value: str | Sequence[str]) -> list[str]:
    items = value.split(",") if isinstance(value, str) else list(value)
    addresses = [a.strip() for a in items if a.strip()]
    for a in addresses:
        try:
            valid = split_host_port(a)[1] > 0
        except ValueError:
            valid = False
        if not valid:
            raise ValueError(f"coordinator address {a!r} is not HOST:PORT")
    if not addresses:
        raise ValueError("no coordinator address given")
    return addresses


def relay_of(node_id: str, addresses: Sequence[str]) -> str:
    """The replica a node of a large job streams through: rendezvous (highest random weight) hashing
    of node_id over the coordinator addresses, stable across processes (unlike `hash`) and moving
    only the nodes of a replica that is added or removed."""
    return max(addresses, key=lambda a: hashlib.blake2b(f"{a}|{node_id}".encode(), digest_size=8).digest())


def run_ended(error: grpc.RpcError) -> pb.JobEnd | None:
    """The end of the caller's run, when the coordinator refused it for that (`RunEnded`)."""
    for key, value in error.trailing_metadata() or ():
        if key == RUN_ENDED_METADATA:
            run, _, outcome = value.partition(" ")
            return pb.JobEnd(outcome=outcome, reason=error.details() or "", run=int(run) if run.isdigit() else 0)
    return None


def leader_hint(error: grpc.RpcError) -> str:
    for key, value in error.trailing_metadata() or ():
        if key == LEADER_METADATA:
            return value
    return ""


def electing(error: grpc.RpcError | None) -> bool:
    """A replica answered that the job has no leader yet (an election under way: a failover, or the
    one replica's own lease renewed late), as opposed to no replica answering at all."""
    return error is not None and error.code() == grpc.StatusCode.UNAVAILABLE and any(
        key == LEADER_METADATA and not value for key, value in error.trailing_metadata() or ())


def redirect(error: grpc.RpcError, address: str, order: list[str]) -> bool:
    """After a call to `address` failed: False when the error is final; otherwise True, with the
    leader it names (if any) put first in `order`. Used by the sync and the async clients."""
    if error.code() not in TRANSIENT:
        return False
    hint = leader_hint(error)
    if hint and hint != address:
        order.insert(0, hint)
    return True


class Coordinators:
    def __init__(self, addresses: str | Sequence[str], *, timeout_s: float = 5.0, retry_for_s: float = 0.0,
                 election_wait_s: float = 0.0, security: ClientSecurity | None = None):
        self.addresses = parse_addresses(addresses)
        self.security = security or ClientSecurity()
        self.timeout_s = timeout_s
        self.retry_for_s = retry_for_s  # keep trying (with backoff) while no leader answers
        self.election_wait_s = election_wait_s  # keep trying while a replica answers that none is elected yet
        self._channels: dict[str, grpc.Channel] = {}

    def stub(self, address: str) -> pb_grpc.CoordinatorStub:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = self.security.channel(address)
        return pb_grpc.CoordinatorStub(channel)

    def call(self, rpc: str, request, *, prefer: str | None = None):
        """Call `rpc` on the leader (for job RPCs) or the first live replica (for queries)."""
        deadline = time.monotonic() + self.retry_for_s
        election_deadline = time.monotonic() + self.election_wait_s
        backoff = Backoff(0.05, 1.0)
        last: grpc.RpcError | None = None
        while True:
            order = ([prefer] if prefer else []) + self.addresses
            hops = 0
            while order and hops < len(self.addresses) + 3:
                address = order.pop(0)
                hops += 1
                try:
                    return getattr(self.stub(address), rpc)(request, timeout=self.timeout_s,
                                                            metadata=self.security.metadata)
                except grpc.RpcError as exc:
                    if not redirect(exc, address, order):
                        raise
                    last = exc
            now = time.monotonic()
            if now >= deadline and not (electing(last) and now < election_deadline):
                raise last
            time.sleep(backoff.next())

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()

    def __enter__(self) -> Coordinators:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
