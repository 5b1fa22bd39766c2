"""Prometheus metrics of one replica, and its HTTP edge: /metrics, /healthz, /readyz.

Per-job gauges (leader flag, term, generation, live ranks, spares) are read at scrape time from
callables the replica registers, so nothing has to be kept in sync; counters and histograms are
fed by the leaders as things happen. Each replica owns its registry (tests run several in one
process). A leaf: plain values in, nothing of the coordinator imported.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from muster.net import join_host_port, split_host_port

# failure signal -> decision: exits take milliseconds, silence the heartbeat timeout
DETECTION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 3, 5, 10, 30, 60)
RECOVERY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)
WRITE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


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
        self.etcd_write = Histogram("muster_etcd_write_seconds", "Fenced job state writes to etcd",
                                    buckets=WRITE_BUCKETS, registry=r)

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
        }
        for g in self.gauges():
            families["leader"].add_metric([g.job], 1 if g.led else 0)
            if not g.led:
                continue
            for name in ("term", "generation", "live_ranks", "world_size", "spares", "stragglers"):
                families[name].add_metric([g.job], getattr(g, name))
        ready = GaugeMetricFamily("muster_ready", "1 while this replica holds a live etcd session")
        ready.add_metric([], 1 if self.ready() else 0)
        yield from families.values()
        yield ready


# A path and the request's Authorization header -> (status, body, content type, headers), or None
# for a path it does not serve (the live page: coordinator/web.py).
Pages = Callable[[str, str], "tuple[int, bytes, str, dict[str, str]] | None"]


class HealthServer:
    """/metrics (Prometheus), /healthz (the process serves), /readyz (leader or healthy standby:
    a live etcd session), and with `pages` the live page's paths. Daemon threads; stopped with the
    replica."""

    def __init__(self, metrics: Metrics, ready: Callable[[], bool], listen: str, pages: Pages | None = None):
        host, port = split_host_port(listen)
        self.httpd = ThreadingHTTPServer((host, port), _handler(metrics, ready, pages))
        self.httpd.daemon_threads = True
        self.address = join_host_port(host, self.httpd.server_address[1])
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="muster-metrics", daemon=True)

    def start(self) -> HealthServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _handler(metrics: Metrics, ready: Callable[[], bool], pages: Pages | None):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's naming)
            page = pages(self.path, self.headers.get("Authorization", "")) if pages else None
            if page is not None:
                self._send(*page)
            elif self.path == "/metrics":
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
