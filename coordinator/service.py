"""`muster serve`: assemble etcd (external or embedded), a replica and its gRPC server, and run
until SIGINT/SIGTERM, then resign (so a standby takes over at once) and stop what it started."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
from dataclasses import dataclass
from pathlib import Path

import structlog

from muster.coordinator.auth import Tokens, first_certificate, private_text
from muster.coordinator.etcd.client import EtcdAccess, connect, enable_auth
from muster.coordinator.etcd.election import EtcdCoordination
from muster.coordinator.etcd.server import EtcdServer
from muster.coordinator.etcd.store import JobStore
from muster.coordinator.metrics import HealthServer
from muster.coordinator.relay import PeerAccess
from muster.coordinator.replica import Replica, ReplicaConfig
from muster.coordinator.server import DEFAULT_MAX_MESSAGE_BYTES, create_server
from muster.coordinator.web import Pages
from muster.net import join_host_port, split_host_port
from muster.security import TlsFiles

log = structlog.get_logger(__name__)

TOKENS_POLL_S = 2.0  # a tokens file written in place (a mounted Secret updated) is read again this soon
ETCD_PASSWORD_FILE = "etcd-root-password"  # in --data-dir, beside the embedded etcd's data


@dataclass(frozen=True)
class ServeConfig:
    listen: str = "127.0.0.1:7600"
    advertise: str | None = None  # default: the listen address (with the bound port)
    etcd: tuple[str, ...] = ()  # empty: start a private etcd
    data_dir: Path = Path(".muster")
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    metrics_listen: str = ""  # HOST:PORT of /metrics, /healthz, /readyz; empty: none
    http: bool = False  # the live page on the metrics port too (coordinator/web.py)
    tokens_file: str = ""  # per-job tokens required when set
    tls: TlsFiles = TlsFiles()  # served where it has a cert; its CA, if any, signs the clients' (mTLS)
    etcd_access: EtcdAccess = EtcdAccess()  # TLS and user of an external etcd
    peer_tls: TlsFiles = TlsFiles()  # a relay's TLS when it calls the leader
    replica: ReplicaConfig = ReplicaConfig()  # its address is set once the port is bound


def _replica_cert(config: ServeConfig) -> bytes | None:
    """Under mTLS, the certificate a Relay caller must present: the one replicas present to each
    other (b"": none given, so none may relay); None without mTLS."""
    if not (config.tls.cert and config.tls.ca):
        return None
    return first_certificate(Path(config.peer_tls.cert).read_bytes()) if config.peer_tls.cert else b""


def _owner_only(embedded: EtcdServer, data_dir: Path) -> EtcdAccess:
    """The embedded etcd, reachable only by its owner: every local user reaches its port, so its
    auth is on, root's password made once into a 0600 file beside its data (`ETCD_PASSWORD_FILE`)."""
    path = data_dir / ETCD_PASSWORD_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        password, made = private_text(path).strip(), False
    else:
        password, made = secrets.token_urlsafe(32), True
        with os.fdopen(fd, "w") as f:
            f.write(password + "\n")
    if enable_auth(embedded.endpoint, password):
        log.info("embedded_etcd_auth_enabled", password_file=str(path))
    elif made:  # auth on already, with a password this file never held
        path.unlink()
        raise RuntimeError(f"the embedded etcd in {embedded.data_dir} has auth on and its password file {path} is "
                           f"gone: restore it, or remove {embedded.data_dir} to start afresh")
    return EtcdAccess(user="root", password=password, local=True)


async def _watch(tokens: Tokens, stop: asyncio.Event) -> None:
    """Read the tokens file again whenever it changes (SIGHUP reads it at once)."""
    while not stop.is_set():
        await asyncio.sleep(TOKENS_POLL_S)
        if tokens.changed():
            tokens.reload()


async def serve(config: ServeConfig, *, ready: asyncio.Event | None = None) -> None:
    embedded = None
    endpoints = list(config.etcd)
    if not endpoints:
        embedded = EtcdServer(config.data_dir / "etcd")
        await asyncio.to_thread(embedded.start)
        endpoints = [embedded.endpoint]
        log.info("embedded_etcd_started", endpoint=embedded.endpoint, pid=embedded.pid,
                 data_dir=str(config.data_dir / "etcd"))
    client = server = replica = health = watcher = pages = None
    try:
        access = config.etcd_access if embedded is None else await asyncio.to_thread(_owner_only, embedded,
                                                                                      config.data_dir)
        client = connect(endpoints, access=access)
        tokens = Tokens.load(config.tokens_file) if config.tokens_file else None
        replica = Replica(JobStore(client), EtcdCoordination(client), config.replica,
                          peers=PeerAccess(config.peer_tls, tokens))
        credentials = config.tls.server_credentials() if config.tls.cert else None
        server, port = await create_server(replica, config.listen, max_message_bytes=config.max_message_bytes,
                                           tokens=tokens, credentials=credentials, replica_cert=_replica_cert(config))
        if tokens is not None and not tokens.relay_token():
            log.warning("relay_token_missing", tokens=config.tokens_file,
                        detail="no '@relay' or '*' entry: replicas cannot relay to each other, nodes go to leaders")
        host, _ = split_host_port(config.listen)
        address = config.advertise or join_host_port(host, port)
        replica.address = address  # known once bound (port 0 picks one)
        await server.start()
        await replica.start()
        if config.metrics_listen:
            pages = Pages(replica, asyncio.get_running_loop(), tokens, config.peer_tls).answer if config.http else None
            health = HealthServer(replica.metrics, replica.ready, config.metrics_listen, pages).start()
        log.info("coordinator_serving", listen=join_host_port(host, port), advertise=address, etcd=endpoints,
                 metrics=health.address if health else None, page=f"http://{health.address}/" if pages else None,
                 tls="mtls" if config.tls.cert and config.tls.ca else
                 "tls" if config.tls.cert else "off", tokens=tokens is not None)
        if ready is not None:
            ready.set()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        if tokens is not None:
            loop.add_signal_handler(signal.SIGHUP, tokens.reload)
            watcher = asyncio.create_task(_watch(tokens, stop))
        await stop.wait()
        log.info("coordinator_stopping")
    finally:
        if watcher is not None:
            watcher.cancel()
        if health is not None:
            health.stop()
        if replica is not None and replica.started:
            await replica.close()
        if server is not None:
            await server.stop(grace=1.0)
        if client is not None:
            client.close()
        if embedded is not None:
            await asyncio.to_thread(embedded.stop)
            log.info("embedded_etcd_stopped")
