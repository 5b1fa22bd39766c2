"""Prometheus metrics of one replica, and its HTTP edge: /metrics, /healthz, /readyz.

Per-job gauges (leader flag, term, generation, live ranks, spares) are read at scrape time from
callables the replica registers, so nothing has to be kept in sync; counters and histograms are
fed by the leaders as things happen. Each replica owns its registry (tests run several in one
process). A leaf: plain values in, nothing of the coordinator imported.

The edge's guard (`Edge`): TLS, the Host names it answers to (DNS rebinding), a token on
/metrics; each connection has `IDLE_TIMEOUT_S` for its handshake and each request, and at most
`MAX_CONNECTIONS` are open at once (a thread each, in the process that serves gRPC and etcd's
calls).
"""

from __future__ import annotations

import ipaddress
import ssl
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import structlog
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from muster.net import join_host_port, split_host_port

log = structlog.get_logger(__name__)

# failure signal -> decision: exits take milliseconds, silence the heartbeat timeout
DETECTION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 3, 5, 10, 30, 60)
RECOVERY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)
WRITE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
# As Go servers' read-header and idle timeouts: a connection that sends no whole request (or
# handshake) within it is closed, so an idle one holds its thread no longer.
IDLE_TIMEOUT_S = 10.0
OUTCOMES = ("succeeded", "failed", "stopped")  # a run's (muster_runs_ended_total)
MAX_CONNECTIONS = 64  # open at once; a new one beyond is closed unanswered (browsers, scrapes, probes need few)


@dataclass(frozen=True)
class JobGauges:
    """One known job as a scrape sees it; the other fields count only where this replica leads it."""

    job: str
    led: bool
    term: int = 0
    generation: int = 0
    live_ranks: int = 0
    world_size: int = 0
    spares: int = 0
    stragglers: int = 0  # ranks named stragglers now
    steps_per_second: float = 0.0  # the job's median step time, inverted (0: none measured)


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.frames = Counter("muster_frames", "Node frames (heartbeats) received by the job's leader", ["job"],
                              registry=r)
        self.evictions = Counter("muster_evictions", "Nodes or ranks taken out of a job, by reason", ["job", "reason"],
                                 registry=r)
        self.generations = Counter("muster_generations", "Rank maps published", ["job"], registry=r)
        self.detection = Histogram("muster_detection_seconds", "A failure's first signal (exit report, last frame, "
                                   "last progress) to the leader's decision", ["job"], buckets=DETECTION_BUCKETS,
                                   registry=r)
        self.recovery = Histogram("muster_recovery_seconds", "A new generation's decision until every node of its "
                                  "map reported it and a step past the one at the decision", ["job"],
                                  buckets=RECOVERY_BUCKETS, registry=r)
        # By outcome only: a per-job label would grow with every job the deployment ever ran.
        self.runs_ended = Counter("muster_runs_ended", "Runs of jobs that ended, by outcome", ["outcome"], registry=r)
        for outcome in OUTCOMES:  # each at zero from the start
            self.runs_ended.labels(outcome)
        self.etcd_write = Histogram("muster_etcd_write_seconds", "Fenced job state writes to etcd",
                                    buckets=WRITE_BUCKETS, registry=r)

    def started(self, job: str, reasons: Iterable[str]) -> None:
        """The job's labelled series at zero from its leader's start, every eviction `reasons` too: a
        panel or a rate() over them reads 0 rather than "No data" until a first event."""
        for metric in (self.frames, self.generations, self.detection, self.recovery):
            metric.labels(job)
        for reason in reasons:
            self.evictions.labels(job, reason)

    def forget(self, job: str) -> None:
        """Drop the job's labelled series (its run ended): what a replica exports stays bounded."""
        for metric in (self.frames, self.generations, self.detection, self.recovery, self.evictions):
            metric.remove_by_labels({"job": job})

    def watch(self, gauges: Callable[[], Iterable[JobGauges]], ready: Callable[[], bool]) -> None:
        """Read `gauges()` (every known job) and `ready()` at each scrape."""
        self.registry.register(_GaugeCollector(gauges, ready))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _GaugeCollector:
    def __init__(self, gauges: Callable[[], Iterable[JobGauges]], ready: Callable[[], bool]):
        self.gauges = gauges
        self.ready = ready

    def collect(self):
        families = {
            "leader": GaugeMetricFamily("muster_leader", "1 where this replica leads the job", labels=["job"]),
            "term": GaugeMetricFamily("muster_term", "Term of the job's leadership held here", labels=["job"]),
            "generation": GaugeMetricFamily("muster_generation", "Current generation of the job", labels=["job"]),
            "live_ranks": GaugeMetricFamily("muster_live_ranks", "Ranks of the map on nodes heard from",
                                            labels=["job"]),
            "world_size": GaugeMetricFamily("muster_world_size", "Ranks in the current map", labels=["job"]),
            "spares": GaugeMetricFamily("muster_spare_nodes", "Member nodes the map does not use", labels=["job"]),
            "stragglers": GaugeMetricFamily("muster_stragglers", "Ranks whose compute is persistently above the "
                                            "job's median (--straggler-factor)", labels=["job"]),
            "steps_per_second": GaugeMetricFamily("muster_steps_per_second", "The job's training steps per second "
                                                  "(its median step time, inverted; 0 without steps measured)",
                                                  labels=["job"]),
        }
        for g in self.gauges():
            families["leader"].add_metric([g.job], 1 if g.led else 0)
            if not g.led:
                continue
            for name in ("term", "generation", "live_ranks", "world_size", "spares", "stragglers", "steps_per_second"):
                families[name].add_metric([g.job], getattr(g, name))
        ready = GaugeMetricFamily("muster_ready", "1 while this replica holds a live etcd session")
        ready.add_metric([], 1 if self.ready() else 0)
        yield from families.values()
        yield ready


# A path and the request's Authorization header -> (status, body, content type, headers), or None
# for a path it does not serve (the live page: src/muster/coordinator/edges/web.py).
Pages = Callable[[str, str], "tuple[int, bytes, str, dict[str, str]] | None"]


@dataclass(frozen=True)
class Edge:
    """What the port asks of a connection and of a request before answering it."""

    tls: ssl.SSLContext | None = None  # HTTPS with it
    # Host names answered besides IP literals and localhost (a browser at either is at this
    # server's own origin): a page of another name reaching the port is DNS rebinding.
    hosts: frozenset[str] = frozenset()
    # /metrics: the Authorization header -> None (answer) or the refusal's (status, message)
    scrape: Callable[[str], tuple[int, str] | None] | None = None


class HealthServer:
    """/metrics (Prometheus), /healthz (the process serves), /readyz (leader or healthy standby:
    a live etcd session), and with `pages` the live page's paths, behind `edge`. Daemon threads;
    stopped with the replica."""

    def __init__(self, metrics: Metrics, ready: Callable[[], bool], listen: str, pages: Pages | None = None,
                 edge: Edge = Edge()):
        host, port = split_host_port(listen)
        self.httpd = _Server((host, port), _handler(metrics, ready, pages, edge), edge.tls)
        self.address = join_host_port(host, self.httpd.server_address[1])
        self.url = f"{'https' if edge.tls else 'http'}://{self.address}/"
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="muster-metrics", daemon=True)

    def start(self) -> HealthServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _Server(ThreadingHTTPServer):
    """A thread per connection, at most `MAX_CONNECTIONS` at once, TLS's handshake in it (never in
    the accepting thread, which one silent client would stop)."""

    daemon_threads = True
    # the listen backlog (socketserver's is 5): a burst of connects beyond it waits a SYN retransmit
    # (a second) where the accepting thread is a moment behind
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler, tls: ssl.SSLContext | None):
        super().__init__(address, handler)
        self.tls = tls
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.capped = False  # refusing now: logged once per spell

    def process_request(self, request, client_address):
        if not self.slots.acquire(blocking=False):
            if not self.capped:
                log.warning("http_connections_capped", limit=MAX_CONNECTIONS, client=client_address[0])
            self.capped = True
            self.shutdown_request(request)
            return
        self.capped = False
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()  # no thread started to release it
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def finish_request(self, request, client_address):
        request.settimeout(IDLE_TIMEOUT_S)  # the handshake's, then each request's (and the wait for one)
        if self.tls is None:
            super().finish_request(request, client_address)
            return
        with self.tls.wrap_socket(request, server_side=True, do_handshake_on_connect=False) as conn:
            try:
                conn.do_handshake()
            except OSError:  # no TLS client (plain HTTP, a port scan), or too slow: nothing to answer
                return
            super().finish_request(conn, client_address)


def _host_name(header: str) -> str:
    """The name of a Host header (`name`, `name:port`, `[v6]:port`), lower case."""
    name = header.strip().lower()
    if name.startswith("["):
        return name[1:].partition("]")[0]
    return name.partition(":")[0].rstrip(".")


def _answers_to(header: str | None, hosts: frozenset[str]) -> bool:
    if header is None:  # HTTP/1.0 probes; a browser always sends one, so no rebinding without it
        return True
    name = _host_name(header)
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return name == "localhost" or name in hosts


def _handler(metrics: Metrics, ready: Callable[[], bool], pages: Pages | None, edge: Edge):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's naming)
            if not _answers_to(self.headers.get("Host"), edge.hosts):
                self._send(421, b"this port does not answer to this Host name (muster serve --http-host adds one)\n")
                return
            page = pages(self.path, self.headers.get("Authorization", "")) if pages else None
            if page is not None:
                self._send(*page)
            elif self.path == "/metrics":
                refusal = edge.scrape(self.headers.get("Authorization", "")) if edge.scrape else None
                if refusal is not None:
                    code, message = refusal
                    challenge = {"WWW-Authenticate": "Bearer"} if code == 401 else None
                    self._send(code, f"{message}\n".encode(), headers=challenge)
                else:
                    self._send(200, metrics.exposition(), CONTENT_TYPE_LATEST)
            elif self.path == "/healthz":
                self._send(200, b"ok\n")
            elif self.path == "/readyz":
                ok = ready()
                self._send(200 if ok else 503, b"ready\n" if ok else b"no etcd session\n")
            else:
                self._send(404, b"not found: /metrics, /healthz, /readyz" + (b", /" if pages else b"") + b"\n")

        def _send(self, code: int, body: bytes, content_type: str = "text/plain; charset=utf-8",
                  headers: dict[str, str] | None = None):
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # scrapes are not worth a log line each
            pass

    return Handler
