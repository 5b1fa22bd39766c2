"""`muster serve`: assemble etcd (external or embedded), a replica and its gRPC server, and run
until SIGINT/SIGTERM, then resign (so a standby takes over at once) and stop what it started."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

from muster.coordinator.auth import Tokens, first_certificate, private_text
from muster.coordinator.etcd.client import EtcdAccess, auth_strangers, connect, enable_auth
from muster.coordinator.etcd.election import EtcdCoordination
from muster.coordinator.etcd.server import EtcdServer, EtcdStartError
from muster.coordinator.etcd.store import JobStore
from muster.coordinator.metrics import HealthServer
from muster.coordinator.replica.relay import PeerAccess
from muster.coordinator.replica.replica import Replica, ReplicaConfig
from muster.coordinator.edges.server import DEFAULT_MAX_MESSAGE_BYTES, create_server
from muster.coordinator.edges.web import Pages, http_edge
from muster.net import join_host_port, split_host_port
from muster.security import TlsFiles

log = structlog.get_logger(__name__)

TOKENS_POLL_S = 2.0  # a tokens file written in place (a mounted Secret updated) is read again this soon
ETCD_PASSWORD_FILE = "etcd-root-password"  # in --data-dir, beside the embedded etcd's data
# A dead embedded etcd is started again (its data kept) after 0.5, 1, 2 s; a fourth death within a minute
# ends `serve` (exit 1) saying so: etcd that dies over and over has a cause a restart will not fix.
ETCD_RESTARTS = 3
ETCD_RESTART_WINDOW_S = 60.0
ETCD_RESTART_BACKOFF_S = 0.5
ETCD_CHECK_S = 0.5  # how soon a death is seen


@dataclass(frozen=True)
class ServeConfig:
    listen: str = "127.0.0.1:7600"
    advertise: str | None = None  # default: the listen address (with the bound port)
    etcd: tuple[str, ...] = ()  # empty: start a private etcd
    data_dir: Path = Path(".muster")
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    metrics_listen: str = ""  # HOST:PORT of /metrics, /healthz, /readyz; empty: none
    http: bool = False  # the live page on the metrics port too (src/muster/coordinator/edges/web.py)
    http_hosts: tuple[str, ...] = ()  # Host names the metrics port answers to besides its own (`web.http_edge`)
    metrics_open: bool = False  # /metrics without a token though tokens are on
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
    """The embedded etcd, reachable only by its owner: its sockets are in its 0700 directory, and its
    auth is on before anyone is served (root's password made once into a 0600 file beside its data,
    `ETCD_PASSWORD_FILE`), with no user or role but root: one would mean someone got in before, through
    the loopback port an older release listened on."""
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
    access = EtcdAccess(user="root", password=password, local=True)
    client = connect([embedded.endpoint], access=access)
    try:
        strangers = auth_strangers(client)
    finally:
        client.close()
    if strangers:
        raise RuntimeError(f"the embedded etcd in {embedded.data_dir} has {', '.join(strangers)}, which muster "
                           f"never makes: someone reached it before its auth was on; remove {embedded.data_dir} "
                           "to start afresh")
    return access


async def _keep_alive(embedded: EtcdServer) -> None:
    """Start the embedded etcd again, with its data, whenever it dies; raise once it has died more than
    `ETCD_RESTARTS` times in `ETCD_RESTART_WINDOW_S` (the replica rides out the gap as any etcd outage)."""
    deaths: list[float] = []
    while True:
        await asyncio.sleep(ETCD_CHECK_S)
        if embedded.running():
            continue
        now = time.monotonic()
        deaths = [t for t in deaths if t > now - ETCD_RESTART_WINDOW_S] + [now]
        log.error("embedded_etcd_died", pid=embedded.pid, returncode=embedded.returncode, deaths=len(deaths),
                  window_s=ETCD_RESTART_WINDOW_S, log_file=str(embedded.log_path))
        if len(deaths) > ETCD_RESTARTS:
            raise RuntimeError(f"the embedded etcd died {len(deaths)} times within {ETCD_RESTART_WINDOW_S:.0f}s "
                               f"(last exit code {embedded.returncode}); its log is {embedded.log_path}")
        await asyncio.sleep(ETCD_RESTART_BACKOFF_S * 2 ** (len(deaths) - 1))
        try:
            await asyncio.to_thread(embedded.start)
        except EtcdStartError as exc:  # counted as the next death
            log.error("embedded_etcd_restart_failed", reason=str(exc).splitlines()[0])
            continue
        log.info("embedded_etcd_restarted", pid=embedded.pid, endpoint=embedded.endpoint)


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
        embedded = EtcdServer(config.data_dir / "etcd", private=True)
        await asyncio.to_thread(embedded.start)
        endpoints = [embedded.endpoint]
        log.info("embedded_etcd_started", endpoint=embedded.endpoint, pid=embedded.pid,
                 data_dir=str(config.data_dir / "etcd"))
    client = server = replica = health = watcher = pages = keeper = None
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
            edge = http_edge(config.metrics_listen, address, config.http_hosts, config.tls, tokens, config.metrics_open)
            health = HealthServer(replica.metrics, replica.ready, config.metrics_listen, pages, edge).start()
        log.info("coordinator_serving", listen=join_host_port(host, port), advertise=address, etcd=endpoints,
                 metrics=health.address if health else None, page=health.url if pages else None,
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
        stopping = asyncio.create_task(stop.wait())
        if embedded is not None:
            keeper = asyncio.create_task(_keep_alive(embedded))
        await asyncio.wait({stopping, keeper} - {None}, return_when=asyncio.FIRST_COMPLETED)
        if not stopping.done():  # the embedded etcd keeps dying: end with its reason
            stopping.cancel()
            keeper.result()
        log.info("coordinator_stopping")
    finally:
        if keeper is not None:
            keeper.cancel()
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
