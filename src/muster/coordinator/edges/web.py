"""The live page of `muster serve --http`, on the metrics port: the jobs, and a job's ranks,
health and history, refreshed by the browser every second.

The HTML, JS and CSS are static files of the package (src/muster/web/, no build step) and carry no
data: the script fetches `/api/jobs` and `/api/jobs/NAME` (the JSON of `muster jobs --json` and
of `muster status --json` with `muster events --json`) and shows every value as text, never as
markup; a Content-Security-Policy allows no inline script. With tokens on, the API asks the same
token as the gRPC API, checked the same way (an operator's for the jobs list, the job's for its
page). A replica that does not lead the job asks its leader for the live view, with the caller's
token; unreachable, it shows what etcd holds and where the leader is.

`http_edge` guards the whole port (`metrics.Edge`): HTTPS with the replica's certificate, the Host
names it answers to, and /metrics behind a scraper's or an operator's token.
"""

from __future__ import annotations

import asyncio
import json
import re
import ssl
from importlib.resources import files
from urllib.parse import parse_qs, unquote, urlsplit

import grpc
import structlog

from muster.coordinator import errors
from muster.coordinator.auth import Tokens
from muster.coordinator.metrics import Edge
from muster.coordinator.job.status_pages import Page
from muster.json_output import as_json, status_document
from muster.net import split_host_port
from muster.security import TOKEN_METADATA, ClientSecurity, TlsFiles
from muster.v1 import muster_pb2 as pb
from muster.v1 import muster_pb2_grpc as pb_grpc

log = structlog.get_logger(__name__)

STATIC = {"/web/app.js": ("app.js", "text/javascript; charset=utf-8"),
          "/web/style.css": ("style.css", "text/css; charset=utf-8")}
PAGE = re.compile(r"^/(?:jobs/[^/]+)?$")  # the jobs list, or a job's page: one HTML, the script routes
API_JOB = re.compile(r"^/api/jobs/([^/]+)$")
HEADERS = {  # the page's own files only; no framing; a JSON answer is never taken for HTML
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
HTTP_STATUS = {errors.InvalidArgument: 400, errors.Unauthenticated: 401, errors.PermissionDenied: 403,
               errors.NotFound: 404, errors.FailedPrecondition: 409, errors.Unavailable: 503,
               errors.NotLeader: 503, errors.DeadlineExceeded: 504}
ANSWER_WAIT_S = 5.0  # for the replica's answer, and the leader's: a page asks again a second later


def http_edge(listen: str, advertise: str, names: tuple[str, ...], tls: TlsFiles, tokens: Tokens | None,
              metrics_open: bool) -> Edge:
    """The metrics port's guard: HTTPS with the replica's certificate where it has one (the page
    takes tokens, operators' too, and /metrics may); Host names: the listen and advertised hosts
    and `names` (--http-host); /metrics asks a scraper's or an operator's token where tokens are
    on (it names every job), unless `metrics_open`."""
    context = None
    if tls.cert:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(tls.cert, tls.key)
    own = (split_host_port(listen)[0], split_host_port(advertise)[0], *names)
    hosts = frozenset(n.lower().rstrip(".") for n in own)
    return Edge(context, hosts, None if tokens is None or metrics_open else lambda header: _scrape(tokens, header))


def _scrape(tokens: Tokens, authorization: str) -> tuple[int, str] | None:
    try:
        tokens.check_scrape(((TOKEN_METADATA, authorization),) if authorization else ())
    except errors.MusterError as exc:
        return HTTP_STATUS[type(exc)], str(exc)
    return None


class Pages:
    """Answers the page's paths from the HTTP server's threads, asking the replica on its loop."""

    def __init__(self, replica, loop: asyncio.AbstractEventLoop, tokens: Tokens | None, peer_tls: TlsFiles):
        self.replica, self.loop, self.tokens, self.peer_tls = replica, loop, tokens, peer_tls
        self.static = {path: files("muster.web").joinpath(name).read_bytes() for path, (name, _) in STATIC.items()}
        self.html = files("muster.web").joinpath("index.html").read_bytes()

    def answer(self, target: str, authorization: str) -> tuple[int, bytes, str, dict[str, str]] | None:
        """(status, body, content type, headers) for a path of the page; None for any other path."""
        answer = self._answer(urlsplit(target), authorization)
        return None if answer is None else (*answer, HEADERS)

    def _answer(self, url, authorization: str) -> tuple[int, bytes, str] | None:
        if url.path in STATIC:
            return 200, self.static[url.path], STATIC[url.path][1]
        if PAGE.match(url.path):
            return 200, self.html, "text/html; charset=utf-8"
        if url.path != "/api/jobs" and not API_JOB.match(url.path):
            return None
        token = authorization.removeprefix("Bearer ").strip()
        try:
            if url.path == "/api/jobs":
                doc = self._jobs(token)
            else:
                run = parse_qs(url.query).get("run", ["0"])[0]
                if not (run.isdigit() and len(run) < 19):
                    raise errors.InvalidArgument(f"run must be a run's number, not {run[:20]!r}")
                doc = self._job(unquote(API_JOB.match(url.path)[1]), int(run), token)
        except errors.MusterError as exc:  # (a subclass too: RunEnded is a NotFound)
            return _error(next((code for kind, code in HTTP_STATUS.items() if isinstance(exc, kind)), 500), str(exc))
        except TimeoutError:
            return _error(504, f"this replica did not answer within {ANSWER_WAIT_S:g}s")
        except Exception as exc:  # etcd unavailable, ...: the page says so and asks again
            log.warning("web_answer_failed", path=url.path, error=f"{type(exc).__name__}: {exc}")
            return _error(500, f"{type(exc).__name__}: {exc}")
        return 200, json.dumps(doc).encode(), "application/json"

    def _check(self, token: str, job: str) -> None:
        if self.tokens is not None:
            self.tokens.check(((TOKEN_METADATA, f"Bearer {token}"),) if token else (), job)

    def _on_loop(self, coroutine):
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result(ANSWER_WAIT_S)
        except TimeoutError:
            future.cancel()  # nobody waits for it any more
            raise

    def _jobs(self, token: str) -> dict:
        self._check(token, "")
        return {"replica": self.replica.address, **as_json(self._on_loop(self.replica.list_jobs("")))}

    def _job(self, job: str, run: int, token: str) -> dict:
        self._check(token, job)
        status = self._on_loop(self.replica.status(job, page=Page(), run=run))
        (js,) = status.jobs
        if not js.live and js.leader and js.leader != self.replica.address:
            status = self._from_leader(js.leader, pb.StatusRequest(job=job, run=run), token) or status
        return {"status": status_document(status, job), "events": as_json(self._on_loop(self.replica.events(job, run)))}

    def _from_leader(self, leader: str, request: pb.StatusRequest, token: str) -> pb.StatusResponse | None:
        """The leader's live view (ranks, steps), asked with the caller's token; None if it does not answer."""
        security = ClientSecurity(token, self.peer_tls)
        try:
            with security.channel(leader) as channel:
                return pb_grpc.CoordinatorStub(channel).Status(request, timeout=ANSWER_WAIT_S,
                                                               metadata=security.metadata)
        except grpc.RpcError as exc:
            log.info("web_leader_unreachable", leader=leader, code=exc.code().name)
            return None


def _error(status: int, message: str) -> tuple[int, bytes, str]:
    return status, json.dumps({"error": message}).encode(), "application/json"
