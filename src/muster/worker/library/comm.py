"""Process groups, one per generation: form, abort, destroy. The only module of the worker that
touches torch.distributed's process-group machinery.

Every process hosts a TCPStore from the start, so whichever process is rank 0 of a generation
already serves that generation's store (under a fresh prefix). Forming starts with an arrival
barrier polled without blocking, so a newer generation can abandon a half-formed one, or one whose
store does not answer (its host died as the map was published).
Abort: through the backend (src/muster/worker/library/backends.py): NCCL's `abort()` runs in the background
(src/muster/worker/library/teardown.py) once the groups are out of torch's registry; gloo has none, so the sockets the
generation's group opened are shut down (src/muster/worker/sockets.py), which makes a collective blocked on a
hung or dead peer fail at once.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import structlog
import torch.distributed as dist

from muster.net import split_host_port
from muster.worker.library.backends import Backend, backend_named
from muster.worker.sockets import new_sockets, shutdown_peer_sockets, socket_inodes, store_connections
from muster.worker.library.stuck import OnStuck, exit_stuck
from muster.worker.store import Seal, StoreKeyTaken, serve

log = structlog.get_logger(__name__)

CONNECT_TIMEOUT = timedelta(seconds=30)  # the backend's store reads while a group connects
CONNECT_ATTEMPT_S = 1.0  # first attempt of a store client's connect (doubled after each failure, up to the max)
CONNECT_ATTEMPT_MAX_S = 4.0
# Gloo's connect waits for every peer under the group's timeout, and nothing from outside cuts it:
# a peer that died after publishing its address (a second fault during a reform) held this rank,
# and the newer generation's group waiting for it, that long. So a gloo group connects under a
# short timeout of its own and gets the group's timeout once connected. Measured on torch 2.13:
# gloo reads the peers' addresses under that timeout, and a rank accepting a dead peer's
# connection waits 5 times it (a connecting one is refused at once). 1 s: every rank has passed
# the arrival barrier, so its address follows within milliseconds; a large group's full mesh
# gets 2 ms a rank more.
GLOO_CONNECT_MIN_S = 1.0
GLOO_CONNECT_PER_RANK_S = 0.002
GLOO_ACCEPT_WAITS = 5  # the accepting side's wait, in connect timeouts
ABANDONED_CONNECT_EXIT_S = 5.0  # an abandoned group's backend connect still running this long past its bound: exit
BARRIER_LATE_S = 1.0  # an arrival barrier waiting this long names the ranks not there yet (once)


class Superseded(Exception):
    """A newer generation arrived while this one was forming."""


class StepCut(RuntimeError):
    """The training thread's step stopped at a module or a gradient: its group was aborted."""


@dataclass(frozen=True)
class GroupSpec:
    generation: int
    rank: int
    world_size: int
    local_rank: int
    store_address: str  # host:port of rank 0's store
    store_prefix: str
    store_key: bytes = b""  # seals the values ranks steer by (src/muster/worker/store.py); from the assignment, never the store
    left_out: int = 0  # usable slots of the job outside this generation (Assignment.left_out)


def arrive(store: dist.Store, spec: GroupSpec, abandoned: Callable[[], bool], started: float,
           timeout_s: float) -> None:
    """The arrival barrier of `spec`'s generation on its store: this rank's arrival, then every
    rank's, abandonable by a newer generation (Superseded) and bounded by `timeout_s` from `started`."""
    if store.add(f"arrived/{spec.rank}", 1) != 1:
        raise StoreKeyTaken(f"store key arrived/{spec.rank} was set before rank {spec.rank} arrived: planted "
                            f"on the store of generation {spec.generation}, which is not formed")
    arrived = time.monotonic()
    named = False

    def name_late() -> None:
        # Every rank waits for the last to arrive: name it, so that its own log (its
        # group_formed: before_form_s, store_s) says where the time went. (A rank new
        # in a planned switch waits here for the others' switch step: expected.)
        nonlocal named
        if named or time.monotonic() - arrived <= BARRIER_LATE_S:
            return
        missing = [r for r in range(spec.world_size) if not store.check([f"arrived/{r}"])]
        named = bool(missing)  # (none: they all came since the last check)
        if named:
            log.info("barrier_waiting", generation=spec.generation, rank=spec.rank,
                     waited_s=round(time.monotonic() - arrived, 3), missing=missing[:16],
                     missing_count=len(missing))

    await_keys(store, spec, [f"arrived/{r}" for r in range(spec.world_size)], abandoned,
               started + timeout_s, "arrive", name_late)


def await_keys(store: dist.Store, spec: GroupSpec, keys: list[str], abandoned: Callable[[], bool],
               deadline: float, what: str, waiting: Callable[[], None] = lambda: None) -> None:
    """Until every key is on the generation's store: abandonable by a newer generation (Superseded),
    bounded by `deadline` (monotonic). Polled with check(): store.wait with a short timeout logs a
    c10d warning on every miss."""
    delay = 0.001
    while not store.check(keys):
        if abandoned():
            raise Superseded(f"generation {spec.generation} abandoned while waiting for its ranks to {what}")
        waiting()
        if time.monotonic() > deadline:
            missing = [k for k in keys if not store.check([k])]
            raise dist.DistStoreError(f"generation {spec.generation}: {len(missing)} rank(s) did not {what} "
                                      f"in time ({', '.join(missing[:8])})")
        time.sleep(delay)
        delay = min(delay * 2, 0.01)


class GroupChannel:
    """The formed group's store, for what its ranks tell each other besides collectives (the state
    transfer's cards, skeleton and verdicts: src/muster/worker/library/state.py's Channel). Every value is
    sealed with the generation's key and checked when read: one written by anyone else fails the
    generation (StoreTampered), whatever it says."""

    def __init__(self, store: dist.Store, spec: GroupSpec, abandoned: Callable[[], bool], timeout_s: float):
        self.store, self.spec, self.abandoned, self.timeout_s = store, spec, abandoned, timeout_s
        self.rank, self.world_size, self.left_out = spec.rank, spec.world_size, spec.left_out
        self.seal = Seal(spec.store_key, spec.store_prefix)

    def exchange(self, key: str, value: str | bytes) -> list[bytes]:
        self.publish(f"{key}/{self.rank}", value)
        keys = [f"{key}/{r}" for r in range(self.world_size)]
        await_keys(self.store, self.spec, keys, self.abandoned, time.monotonic() + self.timeout_s, f"publish {key}")
        return [self.seal.open(k, v) for k, v in zip(keys, self.store.multi_get(keys))]

    def publish(self, key: str, value: str | bytes) -> None:
        self.store.set(key, self.seal.seal(key, value))

    def fetch(self, key: str) -> bytes:
        await_keys(self.store, self.spec, [key], self.abandoned, time.monotonic() + self.timeout_s, f"publish {key}")
        return self.seal.open(key, self.store.get(key))


class Comm:
    def __init__(self, backend: str | Backend, *, host: str = "127.0.0.1", timeout_s: float = 300.0, host_store: bool = True,
                 gloo_interface: str | None = None, on_stuck: OnStuck = exit_stuck):
        """`gloo_interface`: the network interface gloo's connections use (None: gloo's own choice,
        the address of the hostname). `on_stuck(cause, waited_s)`: the process's end where a connect
        is stuck (the Worker's: its state's hand-over, then the exit)."""
        self.on_stuck = on_stuck
        self.backend = backend_named(backend, on_stuck) if isinstance(backend, str) else backend
        self.backend.prepare(os.environ)
        self.host = host
        if self.backend.torch_backend == "gloo" and gloo_interface:
            # Gloo takes its interface from the environment only (init_process_group passes it no
            # options), so the one chosen at the edge is handed on to it that way.
            os.environ["GLOO_SOCKET_IFNAME"] = gloo_interface
        self.timeout = timedelta(seconds=timeout_s)
        # Under a node agent the agent hosts the store (it outlives its ranks); alone, each process does.
        self.server = serve(host, self.timeout) if host_store else None
        self.store_port = self.server.port if self.server is not None else 0
        self.spec: GroupSpec | None = None
        self._lock = threading.Lock()
        self._sockets: dict[int, str] = {}  # the group's: descriptor -> inode
        self._abort_below = 0  # generations below this are to be aborted
        self._aborted = False  # the current group's abort is done (NCCL's may not run twice: its registry is gone)
        # The store connection of the last generation formed: the next generation on the same store
        # uses it again (its address, the client, its sockets). Every new connection costs c10d a
        # reverse-DNS lookup of the peer's address on each side (SocketImpl formats it with
        # getnameinfo), the store host's in its one event-loop thread: a lookup that goes unanswered
        # held every rank of the generation for the resolver's timeout (5 s), seen at 16 ranks.
        self._client: tuple[str, dist.Store, dict[int, str]] | None = None
        # Where the last reform's time went, in seconds: the abort of the old group (on the abort
        # thread; on NCCL only its hand-off to the teardown, which logs its own), destroying it,
        # connecting to the new store (0 when kept), the arrival barrier (connecting included) and
        # the backend's init.
        self.phases = {"abort_s": 0.0, "destroy_s": 0.0, "store_s": 0.0, "barrier_s": 0.0, "init_s": 0.0}
        self._forming: tuple[int, dict[int, str]] | None = None  # generation being formed, its store connections
        self._connecting: int | None = None  # the attempt (a count) in the backend's connect now
        self._attempts = 0
        self._connect_s = 0.0  # its bound, seconds

    @property
    def formed(self) -> bool:
        return self.spec is not None

    def _store(self, spec: GroupSpec, abandoned: Callable[[], bool],
               started: float) -> tuple[dist.Store, dict[int, str]]:
        """A client of the generation's store and its sockets (none for this process's own store):
        the previous generation's when the store is the same. Its host may have died (a node lost as
        the map was published): c10d's TCPStore constructor retries a refused connect for the whole
        timeout and nothing can cut it, so a cheap probe comes first and the constructor only gets
        short attempts; between them a newer generation abandons this one (Superseded)."""
        host, port = split_host_port(spec.store_address)
        if self.server is not None and port == self.store_port and host in (self.host, "127.0.0.1", "localhost"):
            return self.server, {}
        with self._lock:
            kept, self._client = self._client, None  # in use: kept again once this generation forms
        if kept is not None and kept[0] == spec.store_address:
            return kept[1], kept[2]
        del kept  # another store: the old connection closes
        before = socket_inodes()
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
            return client, store_connections(new_sockets(before), port)

    def form(self, spec: GroupSpec, abandoned: Callable[[], bool]) -> GroupChannel:
        """Join `spec`'s group; returns its channel: the generation's store, bounded like the group's
        collectives and abandonable. Raises Superseded when `abandoned()` turns true."""
        started = time.monotonic()
        client, connections = self._store(spec, abandoned, started)
        self.phases["store_s"] = time.monotonic() - started
        with self._lock:  # this attempt's store connection: an abort cuts it, so no wait outlives a newer map
            if spec.generation < self._abort_below:  # aborted while connecting: nothing would cut the waits below
                raise Superseded(f"generation {spec.generation} abandoned while connecting to its store")
            self._forming = (spec.generation, connections)
        try:
            store = dist.PrefixStore(spec.store_prefix + "/", client)
            arrive(store, spec, abandoned, started, self.timeout.total_seconds())
            self.phases["barrier_s"] = time.monotonic() - started  # the rest of forming is the backend's connect
            before = socket_inodes()
            # A rank that dies between the barrier and publishing its address would hold every other
            # in the backend's store reads for the whole timeout: bound them (the host of the store
            # cannot cut its own connection).
            connect = self._connect_bound(spec.world_size)
            store.set_timeout(min(connect, CONNECT_TIMEOUT))
            with self._lock:
                self._attempts += 1
                self._connecting = self._attempts
                self._connect_s = connect.total_seconds()
                if spec.generation < self._abort_below:  # abandoned between the barrier and here
                    self._watch_connect(spec.generation)
            # torch names the group from a counter it raises before connecting, and the group's store
            # keys carry that name: an init that failed (a peer died as it connected) left this rank's
            # counter one ahead of the others', whose keys it would wait for in vain at every retry.
            # No group is left here, so the count starts again, as in a fresh process.
            dist.distributed_c10d._world.group_count = 0
            try:
                dist.init_process_group(self.backend.torch_backend, store=store, rank=spec.rank,
                                        world_size=spec.world_size, timeout=connect,
                                        **self.backend.init_options(self.backend.device(spec.local_rank)))
                if connect != self.timeout:
                    dist.distributed_c10d._set_pg_timeout(self.timeout)
            finally:
                with self._lock:
                    self._connecting = None
                store.set_timeout(self.timeout)
        finally:
            with self._lock:
                cut = self._forming is None  # an abort shut its store connection down
                self._forming = None  # its fds may be reused once the client goes
        with self._lock:
            self._sockets = new_sockets(before)
            if client is not self.server and not cut:
                self._client = (spec.store_address, client, connections)
            self.spec, self._aborted = spec, False
            late_abort = spec.generation < self._abort_below
        if late_abort:
            self.abort(spec.generation + 1)
        self.phases["init_s"] = time.monotonic() - started - self.phases["barrier_s"]
        return GroupChannel(store, spec, abandoned, self.timeout.total_seconds())

    def aborted(self) -> bool:
        """The current group was aborted (or is to be): its in-flight collectives may have been cut short."""
        with self._lock:
            return self.spec is None or self._aborted or self.spec.generation < self._abort_below

    @contextmanager
    def subgroups(self) -> Iterator[None]:
        """Groups made inside (a DeviceMesh's) are aborted with the current group: gloo's abort
        shuts down the sockets a group opened, and theirs are opened after it formed."""
        before = socket_inodes()
        yield
        with self._lock:
            self._sockets.update(new_sockets(before))

    def abort(self, below_generation: int) -> bool:
        """Make the current group's collectives fail now if its generation is below the given one.
        Safe from any thread; the training thread then sees an error and reforms."""
        with self._lock:
            self._abort_below = max(self._abort_below, below_generation)
            forming = self._forming
            if forming is not None and forming[0] < below_generation:
                self._forming = None
                shutdown_peer_sockets(forming[1], set())  # the forming attempt's store reads fail now
                if self._connecting is not None:
                    self._watch_connect(forming[0])
            spec = self.spec
            if spec is None or spec.generation >= below_generation or self._aborted:
                return False
            started = time.monotonic()
            n = self.backend.abort(self._sockets, {self.store_port, split_host_port(spec.store_address)[1]},
                                   spec.generation)
            self._sockets, self._aborted = {}, True
            self.phases["abort_s"] = time.monotonic() - started
        log.info("group_aborted", generation=spec.generation, backend=self.backend.name, sockets=n,
                 peers=spec.world_size - 1, seconds=round(self.phases["abort_s"], 4))
        return True

    def _connect_bound(self, world_size: int) -> timedelta:
        """The timeout a group of `world_size` connects under (GLOO_CONNECT_MIN_S)."""
        if not self.backend.bounded_connect:
            return self.timeout
        return min(self.timeout, timedelta(seconds=max(GLOO_CONNECT_MIN_S, GLOO_CONNECT_PER_RANK_S * world_size)))

    def _watch_connect(self, generation: int) -> None:
        """The backend's connect of an abandoned generation (under the lock). A gloo connect ends
        within its bound (then the rank goes on to the newer generation); one still running
        ABANDONED_CONNECT_EXIT_S past it (or NCCL's, which has none of ours) is stuck in a call
        nothing reaches, and the newer generation's group would wait as long for this rank: the
        process ends instead, for its agent to start a fresh one."""
        attempt = self._connecting
        waits = GLOO_ACCEPT_WAITS * self._connect_s if self.backend.bounded_connect else 0.0
        bound = waits + ABANDONED_CONNECT_EXIT_S

        def check() -> None:
            with self._lock:
                stuck = self._connecting == attempt
            if stuck:
                self.on_stuck(f"connecting the abandoned generation {generation}'s group", bound)

        timer = threading.Timer(bound, check)
        timer.daemon = True
        timer.start()

    def leave(self, abort_below: int = 0) -> None:
        """Leave the current group for the next generation's: aborted first where its generation is
        below `abort_below` (its collectives, and peers blocked on this rank, fail now), then destroyed."""
        if abort_below:
            self.abort(abort_below)
        self.destroy()

    def destroy(self) -> None:
        """Leave the current group (after an abort, or at a planned switch). Its store connection
        stays for the next generation on the same store."""
        started = time.monotonic()
        self.backend.release()
        with self._lock:
            self.spec = None
            self._sockets = {}
        if dist.is_initialized():  # (not after NCCL's abort, which cleared torch's registry)
            dist.destroy_process_group()
        self.phases["destroy_s"] = time.monotonic() - started
