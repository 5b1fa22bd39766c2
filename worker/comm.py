"""Process groups, one per generation: form, abort, destroy. The only module of the worker that
touches torch.distributed's process-group machinery.

Every process hosts a TCPStore from the start, so whichever process is rank 0 of a generation
already serves that generation's store (under a fresh prefix). Forming starts with an arrival
barrier polled without blocking, so a newer generation can abandon a half-formed one, or one whose
store does not answer (its host died as the map was published).
Abort: NCCL has `abort()`; gloo has none, so the sockets the generation's group opened are shut
down, which makes a collective blocked on a hung or dead peer fail at once.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import structlog
import torch
import torch.distributed as dist

from muster.net import split_host_port

log = structlog.get_logger(__name__)

CONNECT_TIMEOUT = timedelta(seconds=30)  # the backend's store reads while a group connects
CONNECT_ATTEMPT_S = 1.0  # first attempt of a store client's connect (doubled after each failure, up to the max)
CONNECT_ATTEMPT_MAX_S = 4.0
ABANDONED_CONNECT_EXIT_S = 5.0  # an abandoned group's backend connect still running this long: the process exits
STUCK_EXIT_CODE = 3  # a rank that exits stuck: its agent starts a fresh process for the slot


class Superseded(Exception):
    """A newer generation arrived while this one was forming."""


class StoreKeyTaken(RuntimeError):
    """A key only this process writes was already on the generation's store (which has no auth):
    planted there by someone who knew the prefix. Its value is never used: the generation fails."""


def publish(store: dist.Store, key: str, value: str) -> None:
    """Write a key that the other nodes read on trust, the first write only: one already there is
    refused loudly, never shared silently with the readers that got to it first."""
    found = store.compare_set(key, "", value)
    if found != value.encode():
        raise StoreKeyTaken(f"store key {key!r} held {found[:64]!r} before this process published it: "
                            "planted on the generation's store, so this generation is not formed")


def exit_stuck(cause: str, waited_s: float) -> None:
    """The training thread is stuck in a C++ call that nothing reaches and would hold its slot for
    that call's own timeout: the process exits, and its agent starts a fresh one for the slot."""
    log.error("rank_exited_stuck", error=cause, waited_s=waited_s)
    os._exit(STUCK_EXIT_CODE)


# How a broken group shows itself: gloo raises a plain RuntimeError from its transport (a peer
# closed or reset the connection), NCCL its own errors; torch's c10d raises DistError subclasses.
_COMM_MARKERS = ("gloo/transport", "Connection reset", "Connection closed", "Broken pipe", "NCCL", "nccl",
                 "ProcessGroup", "Socket Timeout", "timed out", "Timed out")


def is_comm_failure(exc: BaseException) -> bool:
    """An error of the process group (a peer died, hung or was aborted), not of the script."""
    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _COMM_MARKERS)


@dataclass(frozen=True)
class GroupSpec:
    generation: int
    rank: int
    world_size: int
    local_rank: int
    store_address: str  # host:port of rank 0's store
    store_prefix: str


def interface_of(address: str) -> str | None:
    """The network interface holding an IPv4 address, or None (a name, IPv6, not local)."""
    try:
        wanted = socket.inet_aton(address)
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                info = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
            except OSError:
                continue  # no IPv4 address on it
            if info[20:24] == wanted:
                return name
    return None


def _socket_fds() -> set[int]:
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                fds.add(int(name))
        except OSError:
            continue
    return fds


def _store_connections(fds: set[int], store_port: int) -> set[int]:
    """Among new sockets (other threads open some too), those connected to the store's port."""
    found = set()
    for fd in fds:
        try:
            s = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            if s.type == socket.SOCK_STREAM and s.getpeername()[1] == store_port:
                found.add(fd)
        except OSError:
            pass
        finally:
            s.detach()
    return found


def _shutdown_peer_sockets(fds: set[int], keep_ports: set[int]) -> int:
    """Shut down connected sockets among `fds` (never listeners: gloo's accept loop dies on those)."""
    done = 0
    for fd in fds:
        try:
            s = socket.socket(fileno=fd)
        except OSError:
            continue  # closed already
        try:
            if s.type != socket.SOCK_STREAM:
                continue
            peer, local = s.getpeername(), s.getsockname()
            if peer[1] in keep_ports or local[1] in keep_ports:
                continue
            s.shutdown(socket.SHUT_RDWR)
            done += 1
        except OSError:
            pass  # not connected (a listener) or already shut
        finally:
            s.detach()  # the fd stays gloo's
    return done


class Comm:
    def __init__(self, backend: str, *, host: str = "127.0.0.1", timeout_s: float = 300.0, host_store: bool = True,
                 gloo_interface: str | None = None):
        """`gloo_interface`: the network interface gloo's connections use (None: gloo's own choice,
        the address of the hostname)."""
        self.backend = backend
        self.host = host
        if backend == "gloo" and gloo_interface:
            # Gloo takes its interface from the environment only (init_process_group passes it no
            # options), so the one chosen at the edge is handed on to it that way.
            os.environ["GLOO_SOCKET_IFNAME"] = gloo_interface
        self.timeout = timedelta(seconds=timeout_s)
        # Under a node agent the agent hosts the store (it outlives its ranks); alone, each process does.
        self.server = (dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=self.timeout)
                       if host_store else None)
        self.store_port = self.server.port if self.server is not None else 0
        self.spec: GroupSpec | None = None
        self._lock = threading.Lock()
        self._sockets: set[int] = set()
        self._abort_below = 0  # generations below this are to be aborted
        # The store connection of the last generation formed: the next generation on the same store
        # uses it again (its address, the client, its sockets). Every new connection costs c10d a
        # reverse-DNS lookup of the peer's address on each side (SocketImpl formats it with
        # getnameinfo), the store host's in its one event-loop thread: a lookup that goes unanswered
        # held every rank of the generation for the resolver's timeout (5 s), seen at 16 ranks.
        self._client: tuple[str, dist.Store, set[int]] | None = None
        self.store_s = 0.0  # of the last form(): connecting to the generation's store (0 when kept)
        self.barrier_s = 0.0  # of the last form(): connecting, then waiting for every rank to arrive
        self._forming: tuple[int, set[int]] | None = None  # generation being formed, its store connections
        self._connecting: int | None = None  # the attempt (a count) in the backend's connect now
        self._attempts = 0

    @property
    def formed(self) -> bool:
        return self.spec is not None

    def _store(self, spec: GroupSpec, abandoned: Callable[[], bool], started: float) -> tuple[dist.Store, set[int]]:
        """A client of the generation's store and its sockets (none for this process's own store):
        the previous generation's when the store is the same. Its host may have died (a node lost as
        the map was published): c10d's TCPStore constructor retries a refused connect for the whole
        timeout and nothing can cut it, so a cheap probe comes first and the constructor only gets
        short attempts; between them a newer generation abandons this one (Superseded)."""
        host, port = split_host_port(spec.store_address)
        if self.server is not None and port == self.store_port and host in (self.host, "127.0.0.1", "localhost"):
            return self.server, set()
        with self._lock:
            kept, self._client = self._client, None  # in use: kept again once this generation forms
        if kept is not None and kept[0] == spec.store_address:
            return kept[1], kept[2]
        del kept  # another store: the old connection closes
        before = _socket_fds()
        attempt_s, delay, error = CONNECT_ATTEMPT_S, 0.005, "no answer"
        while True:
            if abandoned():
                raise Superseded(f"generation {spec.generation} abandoned while connecting to its store")
            remaining = self.timeout.total_seconds() - (time.monotonic() - started)
            if remaining <= 0:
                raise dist.DistNetworkError(f"generation {spec.generation}: its store at {spec.store_address} did "
                                            f"not answer within {self.timeout.total_seconds():g}s ({error})")
            try:
                socket.create_connection((host, port), timeout=min(remaining, CONNECT_ATTEMPT_S)).close()
            except OSError as exc:  # refused (its host is gone) or no answer: look again, abandonable
                error = str(exc) or type(exc).__name__
                time.sleep(min(delay, remaining))
                delay = min(delay * 2, 0.1)
                continue
            try:
                client = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                       timeout=timedelta(seconds=min(remaining, attempt_s)))
            except RuntimeError as exc:  # it went between the probe and the connect, or answers slowly
                error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                attempt_s = min(attempt_s * 2, CONNECT_ATTEMPT_MAX_S)
                continue
            client.set_timeout(self.timeout)
            return client, _store_connections(_socket_fds() - before, port)

    def form(self, spec: GroupSpec, abandoned: Callable[[], bool]) -> float:
        """Join `spec`'s group; returns seconds spent. Raises Superseded when `abandoned()` turns true."""
        started = time.monotonic()
        client, connections = self._store(spec, abandoned, started)
        self.store_s = time.monotonic() - started
        with self._lock:  # this attempt's store connection: an abort cuts it, so no wait outlives a newer map
            if spec.generation < self._abort_below:  # aborted while connecting: nothing would cut the waits below
                raise Superseded(f"generation {spec.generation} abandoned while connecting to its store")
            self._forming = (spec.generation, connections)
        try:
            store = dist.PrefixStore(spec.store_prefix + "/", client)
            if store.add(f"arrived/{spec.rank}", 1) != 1:
                raise StoreKeyTaken(f"store key arrived/{spec.rank} was set before rank {spec.rank} arrived: planted "
                                    f"on the store of generation {spec.generation}, which is not formed")
            keys = [f"arrived/{r}" for r in range(spec.world_size)]
            delay = 0.001
            # A barrier that a newer generation can abandon; polled with check() (store.wait with a
            # short timeout logs a c10d warning on every miss).
            while not store.check(keys):
                if abandoned():
                    raise Superseded(f"generation {spec.generation} abandoned while forming")
                if time.monotonic() - started > self.timeout.total_seconds():
                    missing = [k for k in keys if not store.check([k])]
                    raise dist.DistStoreError(f"generation {spec.generation}: {len(missing)} rank(s) did not arrive "
                                              f"within {self.timeout.total_seconds():g}s ({', '.join(missing[:8])})")
                time.sleep(delay)
                delay = min(delay * 2, 0.01)
            self.barrier_s = time.monotonic() - started  # the rest of forming is the backend's connect
            before = _socket_fds()
            options = {}
            if self.backend == "nccl":
                options["device_id"] = torch.device("cuda", spec.local_rank)
            # A rank that dies between the barrier and publishing its address would hold every other
            # in the backend's store reads for the whole timeout: bound them (the host of the store
            # cannot cut its own connection).
            store.set_timeout(min(self.timeout, CONNECT_TIMEOUT))
            with self._lock:
                self._attempts += 1
                self._connecting = self._attempts
                if spec.generation < self._abort_below:  # abandoned between the barrier and here
                    self._watch_connect(spec.generation)
            try:
                dist.init_process_group(self.backend, store=store, rank=spec.rank, world_size=spec.world_size,
                                        timeout=self.timeout, **options)
            finally:
                with self._lock:
                    self._connecting = None
                store.set_timeout(self.timeout)
        finally:
            with self._lock:
                cut = self._forming is None  # an abort shut its store connection down
                self._forming = None  # its fds may be reused once the client goes
        with self._lock:
            self._sockets = _socket_fds() - before
            if client is not self.server and not cut:
                self._client = (spec.store_address, client, connections)
            self.spec = spec
            late_abort = spec.generation < self._abort_below
        if late_abort:
            self.abort(spec.generation + 1)
        return time.monotonic() - started

    def abort(self, below_generation: int) -> bool:
        """Make the current group's collectives fail now if its generation is below the given one.
        Safe from any thread; the training thread then sees an error and reforms."""
        with self._lock:
            self._abort_below = max(self._abort_below, below_generation)
            forming = self._forming
            if forming is not None and forming[0] < below_generation:
                self._forming = None
                _shutdown_peer_sockets(forming[1], set())  # the forming attempt's store reads fail now
                if self._connecting is not None:
                    self._watch_connect(forming[0])
            spec = self.spec
            if spec is None or spec.generation >= below_generation:
                return False
            if self.backend == "nccl":
                dist.distributed_c10d._abort_process_group()
                n = -1
            else:
                n = _shutdown_peer_sockets(self._sockets, {self.store_port, split_host_port(spec.store_address)[1]})
                self._sockets = set()
        log.info("group_aborted", generation=spec.generation, sockets=n)
        return True

    def _watch_connect(self, generation: int) -> None:
        """The backend's connect of an abandoned generation (under the lock). Gloo connecting to a
        peer that died after publishing its address waits out its own timeout (20-30 s and more
        seen), and no socket shutdown reaches it: the newer generation's group would wait as long
        for this rank. Given a few seconds to fail on its own, it ends the process instead."""
        attempt = self._connecting

        def check() -> None:
            with self._lock:
                stuck = self._connecting == attempt
            if stuck:
                exit_stuck(f"connecting the abandoned generation {generation}'s group", ABANDONED_CONNECT_EXIT_S)

        timer = threading.Timer(ABANDONED_CONNECT_EXIT_S, check)
        timer.daemon = True
        timer.start()

    def destroy(self) -> None:
        """Leave the current group (after an abort, or at a planned switch). Its store connection
        stays for the next generation on the same store."""
        with self._lock:
            self.spec = None
            self._sockets = set()
        if dist.is_initialized():
            dist.destroy_process_group()
