"""Network helpers shared by the coordinator, the agents and the worker library: one way to read
`host:port`, to pick a free port, and to back off between retries."""

from __future__ import annotations

import ipaddress
import random
import socket
import threading
import time
from collections.abc import Callable


def split_host_port(address: str) -> tuple[str, int]:
    """`host:port` as (host, port). An IPv6 host comes bracketed (`[::1]:29500`) and is returned bare,
    ready for `socket` and `TCPStore`; port 0 (any) passes, a missing or non-numeric one does not."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"address {address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def join_host_port(host: str, port: int) -> str:
    """The inverse of `split_host_port`: an IPv6 host is bracketed again."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()


def address_towards(addresses: list[str]) -> str:
    """This host's address on the route to the first of `addresses` (HOST:PORT): what the others
    of a job can reach it at, as torchrun and NCCL would pick it. A UDP socket's connect sends
    nothing; it only asks the kernel for the route. 127.0.0.1 towards a coordinator on loopback (a
    job on one machine); the host's FQDN where no route is known (a name that does not resolve)."""
    for address in addresses:
        host, port = split_host_port(address)
        try:
            family = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
            with socket.socket(family[0], socket.SOCK_DGRAM) as s:
                s.connect(family[4])
                return s.getsockname()[0]
        except OSError:
            continue
    return socket.getfqdn()


def is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: it may resolve anywhere
        return False


def reserve_port(host: str) -> socket.socket:
    """A free port held for a server that another process starts later (a generation's master
    TCPStore): bound with SO_REUSEADDR and never listening, so that no other bind (a port-0 pick
    included) nor a connect's own port takes it meanwhile, while a server that sets SO_REUSEADDR,
    as c10d's TCPStore does, still binds and listens on it. A port merely found free was taken by
    another server before the workers bound it (a CI run: EADDRINUSE, then a worker pinged the
    stranger). Close it once the port is no longer wanted."""
    family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    held = socket.socket(family[0], socket.SOCK_STREAM)
    try:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(family[4])
    except OSError:
        held.close()
        raise
    return held


def free_port(host: str = "127.0.0.1") -> int:
    """Pick a currently free TCP port (racy by nature, fine for loopback tests).

    Never returns the same port twice in one process, so the client and peer
    ports of the members of one cluster cannot collide with each other.
    """
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        with _handed_out_lock:
            if port not in _handed_out:
                _handed_out.add(port)
                return port


# gRPC's own reconnection backoff for a channel whose peer went away: by default it grows 1.6x per
# failed attempt up to 120 s, so a peer back after a 30 s outage was tried again only ~13 s later (and
# every call meanwhile failed at once). Short and capped instead: a peer that answers again is
# reconnected within about a second however long it was gone. gRPC jitters each wait by +-20%.
RECONNECT_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


def jitter(delay: float) -> float:
    """A wait between `delay` and twice it: clients that failed together do not retry together."""
    return delay * (1 + random.random())


class Backoff:
    """Retry waits that double from `first` up to `most`, each jittered. With `reset_after_s`, a
    retry that comes more than that after the one before (a quiet period: what failed worked for a
    while) starts over from `first`."""

    def __init__(self, first: float, most: float, *, reset_after_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.first = first
        self.delay = first
        self.most = most
        self.reset_after_s = reset_after_s
        self._clock = clock
        self._last: float | None = None

    def next(self) -> float:
        if self.reset_after_s is not None:
            now = self._clock()
            if self._last is not None and now - self._last > self.reset_after_s:
                self.delay = self.first
            self._last = now
        wait = jitter(self.delay)
        self.delay = min(self.delay * 2, self.most)
        return wait

    def reset(self) -> None:
        """What failed worked again: the next wait is `first`'s."""
        self.delay = self.first
