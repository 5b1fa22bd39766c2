"""A generation's TCPStore as both sides of a node use it (the agent and the library): where a store
listens, and how the values that steer a reform are written and read on it.

A TCPStore has no auth, and torch (2.13) answers `list_keys()` to any client: every key, the
generation's prefix included, is readable by whoever reaches the port. So nothing a rank acts on is
taken from the store on trust. The leader hands each generation a key in its assignment (over gRPC
and the agent's socket, never through the store); every value a reform steers by (state cards, the
state's skeleton, verdicts, the master address and port) is sealed with it: an HMAC over the key's
path and the value. A reader checks the seal and fails the generation (StoreTampered) on a value
that lacks it. What remains to a store writer is denial: a generation that does not form.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import hmac
import ipaddress
import socket
import threading
from datetime import timedelta

import structlog

log = structlog.get_logger(__name__)

SEAL_BYTES = 16  # HMAC-SHA256 truncated: 128 bits, each key's value sealed on its own


class StoreKeyTaken(RuntimeError):
    """A key only this process writes was already on the generation's store (which has no auth):
    planted there by someone who knew the prefix. Its value is never used: the generation fails."""


class StoreTampered(RuntimeError):
    """A value on the generation's store does not carry the generation's seal: it was written (or
    overwritten) by a process that did not hear the leader. It is never used: the generation fails."""


class Seal:
    """Seals and checks store values with a generation's key (the assignment's `store_key`).

    A coordinator older than the key sends none: values are then sealed with a key derived from the
    store prefix, which keeps a mixed-version job forming but protects nothing (the prefix is on
    the store for anyone to list), and the rank says so once."""

    _warned = False

    def __init__(self, key: bytes, prefix: str):
        if not key:
            if not Seal._warned:
                Seal._warned = True
                log.warning("store_values_unsealed",
                            why="the coordinator sent no store key (older than this worker): store values "
                                "are checked against the prefix only, which any store client can list")
            key = hashlib.sha256(b"muster-unkeyed\0" + prefix.encode()).digest()
        self._key = key
        self.prefix = prefix

    def _tag(self, key: str, value: bytes) -> bytes:
        path = f"{self.prefix}/{key}".encode()
        return hmac.digest(self._key, len(path).to_bytes(4, "big") + path + value, "sha256")[:SEAL_BYTES]

    def seal(self, key: str, value: str | bytes) -> bytes:
        value = value.encode() if isinstance(value, str) else value
        return self._tag(key, value) + value

    def open(self, key: str, sealed: bytes) -> bytes:
        """The value under `key`, once its seal is checked (StoreTampered otherwise)."""
        tag, value = sealed[:SEAL_BYTES], sealed[SEAL_BYTES:]
        if len(sealed) < SEAL_BYTES or not hmac.compare_digest(tag, self._tag(key, value)):
            raise StoreTampered(f"store key {key!r} under {self.prefix!r} holds a value without this generation's "
                                f"seal ({len(sealed)} bytes): written by a process that did not hear the leader, "
                                "so it is not used and this generation is not formed")
        return value


def publish(store, key: str, value: str | bytes, seal: Seal) -> None:
    """Write a sealed key that the other nodes read, the first write only: one already there is
    refused loudly, never shared silently with the readers that got to it first."""
    sealed = seal.seal(key, value)
    found = store.compare_set(key, b"", sealed)
    if found != sealed:
        raise StoreKeyTaken(f"store key {key!r} held {found[:64]!r} before this process published it: "
                            "planted on the generation's store, so this generation is not formed")


def serve(host: str, timeout: timedelta):
    """A TCPStore server on a free port, listening where the job's ranks reach this node: on `host`
    (the node's advertised address) rather than every interface, where that address is this
    host's own. A name that resolves to loopback here may be reached elsewhere by another address,
    and an address not on this host (behind NAT) cannot be bound: then every interface, said once."""
    return _store(host, timeout, _bound(host))


def _store(host: str, timeout: timedelta, listener: socket.socket | None):
    import torch.distributed as dist

    if listener is None:
        return dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
    # The store takes the descriptor over (and closes it with itself).
    return dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout,
                         master_listen_fd=listener.detach())


def serve_soon(host: str, timeout: timedelta) -> tuple[int, concurrent.futures.Future]:
    """`serve`'s store with its port known at once: the socket is bound and listening here, and
    the TCPStore that takes it over is made on a thread of its own, beside the node's Join; a rank
    that connects meanwhile waits in the listen backlog. Its `import torch` is done here, before the
    node joins: on that thread, libtorch's load held the GIL for seconds on a loaded host, the
    node's frames stopped, and a node was lost as it joined (fresh-clone run Z, the Slurm recipe's
    test). Where the store picks its own port (`serve`'s every-interface case) it is made here,
    before this returns."""
    import torch.distributed  # noqa: F401  (see above: not on the thread)

    made: concurrent.futures.Future = concurrent.futures.Future()
    listener = _bound(host)
    if listener is None:
        made.set_result(_store(host, timeout, None))
        return made.result().port, made

    def make() -> None:
        try:
            made.set_result(_store(host, timeout, listener))
        except BaseException as exc:  # raised where the store is first used (publishing a master port)
            listener.close()
            log.error("node_store_failed", host=host, error=f"{type(exc).__name__}: {exc}")
            made.set_exception(exc)

    port = listener.getsockname()[1]
    threading.Thread(target=make, name="muster-node-store").start()  # (an early exit waits for it: no import cut)
    return port, made


def _bound(host: str) -> socket.socket | None:
    try:
        literal = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        literal = None
    try:
        infos = socket.getaddrinfo(host.strip("[]"), 0, type=socket.SOCK_STREAM)
    except OSError as exc:
        log.warning("store_listens_everywhere", host=host, why=f"{host!r} does not resolve here: {exc}")
        return None
    family, _, _, _, address = infos[0]
    if literal is None and ipaddress.ip_address(address[0]).is_loopback and host != "localhost":
        log.info("store_listens_everywhere", host=host,
                 why=f"{host!r} resolves to loopback here; other hosts may reach it by another address")
        return None
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(address[:2] if family == socket.AF_INET else address)
        s.listen(socket.SOMAXCONN)
    except OSError as exc:
        s.close()
        log.warning("store_listens_everywhere", host=host, why=f"{host!r} is not an address of this host: {exc}")
        return None
    return s
