"""etcd adapter for the coordinator: leases, leader election and fenced job state.

This is the only module that imports etcd3; everything it raises is one of the
exceptions defined here, so callers never see gRPC or etcd3 types.
"""

from __future__ import annotations

import queue
import re
import threading
import time
import types
from dataclasses import dataclass
from typing import Any, Callable, Sequence, TypeVar

import etcd3
import etcd3.events
import etcd3.exceptions
import etcd3.watch
import grpc
import structlog

from muster.security import channel_credentials

log = structlog.get_logger(__name__)

Client = etcd3.MultiEndpointEtcd3Client

DEFAULT_PREFIX = "/muster/v1"
# After a failure an endpoint is skipped for this long; etcd3's default (300 s)
# would turn one blip of a single-member cluster into five minutes of outage. During
# an etcd leader election every member fails requests for a moment: all endpoints are
# marked failed at once, and a session must not miss its renew deadline waiting.
_ENDPOINT_RETRY_S = 0.5
# Upper bound on any blocking wait, so stop flags and session loss are seen promptly.
_POLL_S = 0.5

# python3-etcd3 0.13's watch thread calls six.itervalues() without importing
# six: when a watch stream breaks the thread dies with NameError and no callback
# hears about it. Supplying the one function it needs restores the error path.
if not hasattr(etcd3.watch, "six"):
    etcd3.watch.six = types.SimpleNamespace(itervalues=lambda d: iter(list(d.values())))


class EtcdError(Exception):
    """etcd rejected a request for a reason other than availability."""


class EtcdUnavailable(EtcdError):
    """No etcd endpoint answered in time (down, partitioned, or without a leader)."""


class _LeaseNotFound(EtcdError):
    """The lease a request referred to no longer exists in etcd."""


class Fenced(Exception):
    """A write was refused because the writer's leadership term is over."""


_UNAVAILABLE_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
# These etcd3 errors mean the endpoint was marked failed, so a retry goes to
# another member; NoServerAvailableError means every member is marked failed.
_FAILOVER_ERRORS = (
    etcd3.exceptions.ConnectionFailedError,
    etcd3.exceptions.ConnectionTimeoutError,
    etcd3.exceptions.InternalServerError,
)
_UNAVAILABLE_ERRORS = (
    *_FAILOVER_ERRORS,
    etcd3.exceptions.NoServerAvailableError,
    etcd3.exceptions.WatchTimedOut,
    etcd3.exceptions.RevisionCompactedError,
)

T = TypeVar("T")


def _translate(exc: BaseException, what: str) -> EtcdError:
    if isinstance(exc, _UNAVAILABLE_ERRORS):
        return EtcdUnavailable(f"{what}: {type(exc).__name__}: {exc}")
    if isinstance(exc, grpc.RpcError):
        code = exc.code() if callable(getattr(exc, "code", None)) else None
        details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
        if code in _UNAVAILABLE_CODES:
            return EtcdUnavailable(f"{what}: {code}: {details}")
        if code == grpc.StatusCode.NOT_FOUND and "lease" in (details or ""):
            return _LeaseNotFound(f"{what}: {details}")
        return EtcdError(f"{what}: {code}: {details}")
    return EtcdError(f"{what}: {type(exc).__name__}: {exc}")


def _call(client: Client, op: Callable[[], T], what: str) -> T:
    """Run op, failing over once per endpoint, and map errors to ours.

    etcd3 never retries: it marks the endpoint failed and raises, so the next
    call picks another member. Every op passed here is safe to repeat.
    """
    attempts = max(1, len(client.endpoints))
    last: BaseException | None = None
    for _ in range(attempts):
        try:
            return op()
        except _FAILOVER_ERRORS as exc:
            last = exc
        except (etcd3.exceptions.Etcd3Exception, grpc.RpcError) as exc:
            raise _translate(exc, what) from exc
    assert last is not None
    raise _translate(last, what) from last


_ENDPOINT_RE = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.\-]*[A-Za-z0-9])?):(?P<port>\d{1,5})$")


def _parse_endpoint(endpoint: str) -> tuple[str, int]:
    if not isinstance(endpoint, str):
        raise ValueError(f"etcd endpoint must be a 'host:port' string, got {endpoint!r}")
    match = _ENDPOINT_RE.match(endpoint.strip())
    port = int(match["port"]) if match else 0
    if not match or not 1 <= port <= 65535:
        raise ValueError(
            f"invalid etcd endpoint {endpoint!r}: expected 'host:port' with a port "
            "in 1..65535 and no scheme, e.g. '127.0.0.1:2379'"
        )
    return match["host"], port


@dataclass(frozen=True)
class EtcdAccess:
    """How to reach a secured etcd: TLS (a CA; a client certificate) and a user for its auth."""

    cacert: str = ""
    cert: str = ""
    key: str = ""
    user: str = ""
    password: str = ""

    def credentials(self) -> grpc.ChannelCredentials | None:
        return channel_credentials(self.cacert, self.cert, self.key)


def connect(endpoints: Sequence[str], *, timeout_s: float = 5.0, access: EtcdAccess = EtcdAccess()) -> Client:
    """Build a client over all endpoints; a dead member is skipped by failover.

    No request is made here: unreachable clusters surface as EtcdUnavailable
    from the first real call (with auth, the first authentication happens here).
    """
    if isinstance(endpoints, (str, bytes)):
        raise ValueError(f"endpoints must be a list of 'host:port' strings, got {endpoints!r}")
    parsed = [_parse_endpoint(e) for e in endpoints]
    if not parsed:
        raise ValueError("at least one etcd endpoint is required")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    creds = access.credentials()
    client = etcd3.MultiEndpointEtcd3Client(
        [etcd3.Endpoint(h, p, secure=creds is not None, creds=creds, time_retry=_ENDPOINT_RETRY_S) for h, p in parsed],
        timeout=timeout_s,
        failover=True,
        user=access.user or None,
        password=access.password or None,
    )
    log.info("etcd_client_created", endpoints=[f"{h}:{p}" for h, p in parsed], timeout_s=timeout_s,
             tls=creds is not None, user=access.user or None)
    return client


class Session:
    """One etcd lease kept alive by one daemon thread (etcd Go's concurrency.Session).

    Loss is permanent: the lease was reported gone, or no renewal succeeded for
    renew_deadline_s. The local deadline matters because etcd may extend leases
    across its own leader changes, so the server-side expiry alone is no bound.
    """

    def __init__(
        self,
        client: Client,
        ttl_s: int,
        *,
        renew_deadline_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if int(ttl_s) != ttl_s or ttl_s < 1:
            raise ValueError(f"ttl_s must be a whole number of seconds >= 1, got {ttl_s}")
        deadline = ttl_s * 2 / 3 if renew_deadline_s is None else renew_deadline_s
        if not 0 < deadline < ttl_s:
            raise ValueError(f"renew_deadline_s must be in (0, ttl_s={ttl_s}), got {deadline}")
        self._client = client
        self.ttl_s = int(ttl_s)
        self.renew_deadline_s = float(deadline)
        self._interval_s = ttl_s / 3
        self._clock = clock
        self._lock = threading.Lock()
        self._lease_id: int | None = None
        self._last_renewed = 0.0
        self._closed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._listeners: list[Callable[[], None]] = []
        self.lost = threading.Event()
        self.lost_reason: str | None = None

    @property
    def lease_id(self) -> int:
        if self._lease_id is None:
            raise RuntimeError("session not started")
        return self._lease_id

    def start(self) -> "Session":
        if self._lease_id is not None:
            raise RuntimeError("session already started")
        # Timestamp before the grant: the lease cannot have started earlier.
        granted_at = self._clock()
        lease = _call(self._client, lambda: self._client.lease(self.ttl_s), "lease grant")
        with self._lock:
            self._lease_id = lease.id
            self._last_renewed = granted_at
        self._thread = threading.Thread(
            target=self._run, name=f"muster-session-{lease.id:x}", daemon=True
        )
        self._thread.start()
        log.info("session_started", lease=hex(lease.id), ttl_s=self.ttl_s, granted_ttl_s=lease.ttl)
        return self

    def alive(self, now: float | None = None) -> bool:
        """False once lost or closed, or as soon as the renew deadline has passed.

        Checks the clock itself, so a process resumed after SIGSTOP sees itself
        dead before its renew thread has run.
        """
        now = self._clock() if now is None else now
        with self._lock:
            if self._lease_id is None or self._closed or self.lost.is_set():
                return False
            return now - self._last_renewed < self.renew_deadline_s

    def add_listener(self, fn: Callable[[], None]) -> None:
        """fn() runs once, on the renew thread, just after `lost` is set.

        If the session is already lost, fn runs at once on the calling thread.
        Never called after close(): closing is not a loss.
        """
        with self._lock:
            if not self.lost.is_set():
                self._listeners.append(fn)
                return
        self._notify(fn)

    def close(self, revoke: bool = True) -> None:
        """Stop renewing; revoke=False leaves the lease to expire (a frozen process)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=(self._client.timeout or 5.0) + 1.0)
        if revoke and self._lease_id is not None:
            try:
                _call(self._client, lambda: self._client.revoke_lease(self._lease_id), "lease revoke")
            except EtcdError as exc:
                # Already expired or etcd unreachable: the lease dies on its own.
                log.warning("session_revoke_failed", lease=hex(self._lease_id), error=str(exc))
        log.info("session_closed", lease=hex(self._lease_id or 0), revoked=revoke)

    def __enter__(self) -> "Session":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _remaining_s(self) -> float:
        with self._lock:
            return self._last_renewed + self.renew_deadline_s - self._clock()

    def _run(self) -> None:
        delay = self._interval_s
        # Wake no later than the deadline so loss is declared on time.
        while not self._stop.wait(max(0.0, min(delay, self._remaining_s()))):
            if self._remaining_s() <= 0:
                self._mark_lost("renew_deadline")
                return
            sent_at = self._clock()
            try:
                ttl = self._keepalive(timeout_s=self._remaining_s())
            except _LeaseNotFound:
                self._mark_lost("lease_expired")
                return
            except EtcdError as exc:
                log.warning("session_renew_failed", lease=hex(self.lease_id), error=str(exc))
                delay = self._interval_s / 2
                continue
            if ttl <= 0:
                self._mark_lost("lease_expired")
                return
            with self._lock:
                if self._clock() - self._last_renewed >= self.renew_deadline_s:
                    late = True
                else:
                    late = False
                    self._last_renewed = sent_at
            if late:
                # alive() may already have answered False: loss stays permanent.
                self._mark_lost("renew_deadline")
                return
            delay = self._interval_s

    def _keepalive(self, timeout_s: float) -> int:
        """One LeaseKeepAlive round trip bounded by the time left to the deadline.

        etcd3's refresh_lease() is bounded only by the client-wide timeout,
        which may exceed the deadline, so the stub is called directly here.
        """
        client = self._client
        timeout = max(0.05, min(timeout_s, client.timeout or timeout_s))
        request = etcd3.etcdrpc.LeaseKeepAliveRequest(ID=self.lease_id)

        def once() -> int:
            try:
                responses = list(
                    client.leasestub.LeaseKeepAlive(
                        iter([request]),
                        timeout,
                        credentials=client.call_credentials,
                        metadata=client.metadata,
                    )
                )
            except grpc.RpcError as exc:
                # Marks the endpoint failed (so the retry fails over) and maps the error.
                client._manage_grpc_errors(exc)
                raise
            if not responses:
                raise EtcdUnavailable("lease keepalive stream closed without a response")
            return responses[0].TTL

        return _call(client, once, "lease keepalive")

    def _mark_lost(self, reason: str) -> None:
        with self._lock:
            if self.lost.is_set() or self._closed:
                return
            self.lost_reason = reason
            self.lost.set()
            listeners, self._listeners = self._listeners, []
        log.warning("session_lost", lease=hex(self.lease_id), reason=reason)
        for fn in listeners:
            self._notify(fn)

    def _notify(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:
            log.exception("session_listener_failed", lease=hex(self.lease_id))


@dataclass(frozen=True)
class Leadership:
    """Proof of leadership; term (our key's create revision) is the fencing token."""

    job: str
    term: int
    key: str
    address: str


def _check_job_name(job: str) -> str:
    # A '/' would let one job's prefix match another's keys ("a" vs "a/b").
    if not job or "/" in job:
        raise ValueError(f"job name must be non-empty and contain no '/', got {job!r}")
    return job


class _KeyWatch:
    """A watch on one key that wakes a waiter on any event or on stream failure."""

    def __init__(self, client: Client) -> None:
        self._client = client
        self._key: str | None = None
        self._watch_id: Any = None
        self._token: object | None = None
        self._broken = False
        self._fired = threading.Event()

    def follow(self, key: str, start_revision: int) -> None:
        if key == self._key and self._watch_id is not None and not self._broken:
            return
        self.cancel()
        token = self._token = object()

        def on_response(response: Any) -> None:
            if token is not self._token:
                return  # a late response from a watch we already replaced
            if isinstance(response, etcd3.watch.WatchResponse):
                if response.events:
                    self._fired.set()
            else:  # an exception, or None when the stream ended
                self._broken = True
                self._fired.set()

        self._watch_id = _call(
            self._client,
            lambda: self._client.add_watch_callback(key, on_response, start_revision=start_revision),
            "watch create",
        )
        self._key = key

    def wait(self, timeout_s: float) -> None:
        self._fired.wait(timeout_s)
        # Cleared before the caller re-lists, so a later event is never lost.
        self._fired.clear()

    def cancel(self) -> None:
        watch_id, self._watch_id = self._watch_id, None
        self._key, self._token, self._broken = None, None, False
        if watch_id is not None:
            try:
                self._client.cancel_watch(watch_id)
            except Exception as exc:  # best effort: the stream may be gone already
                log.debug("watch_cancel_failed", error=str(exc))


class Election:
    """Leader election for one job among coordinator replicas, one key per replica.

    The candidate whose key has the lowest create revision leads; others wait
    for the deletion of the key just ahead of theirs (no thundering herd).
    """

    def __init__(
        self,
        client: Client,
        session: Session,
        job: str,
        address: str,
        *,
        prefix: str = DEFAULT_PREFIX,
    ) -> None:
        self._client = client
        self._session = session
        self.job = _check_job_name(job)
        self.address = address
        self._prefix = f"{prefix}/election/{job}/"
        self._term: int | None = None

    @property
    def key(self) -> str:
        return f"{self._prefix}{self._session.lease_id:x}"

    def campaign(self, stop: threading.Event) -> Leadership | None:
        """Block until we lead; None if stop is set or the session is lost first."""
        watch = _KeyWatch(self._client)
        try:
            while not stop.is_set() and self._session.alive():
                try:
                    leadership = self._campaign_step(watch)
                except _LeaseNotFound:
                    self._session._mark_lost("lease_expired")
                    break
                except EtcdUnavailable as exc:
                    log.warning("campaign_retrying", job=self.job, error=str(exc))
                    stop.wait(_POLL_S)
                    continue
                if leadership is not None:
                    return leadership
                watch.wait(_POLL_S)
            log.info("campaign_abandoned", job=self.job, stopped=stop.is_set(),
                     session_lost=self._session.lost.is_set())
            return None
        finally:
            watch.cancel()

    def _campaign_step(self, watch: _KeyWatch) -> Leadership | None:
        key = self.key
        term = self._ensure_key(key)
        response = _call(
            self._client,
            lambda: self._client.get_prefix_response(self._prefix, sort_order="ascend", sort_target="create"),
            "election list",
        )
        ours = [kv for kv in response.kvs if kv.key.decode() == key and kv.create_revision == term]
        if not ours:
            return None  # our key vanished after we ensured it; the next step re-creates it
        ahead = [kv for kv in response.kvs if kv.create_revision < term]
        if not ahead:
            if not self._session.alive():
                return None
            self._term = term
            log.info("leadership_acquired", job=self.job, term=term, key=key, address=self.address)
            return Leadership(job=self.job, term=term, key=key, address=self.address)
        # Start just after the listing so a deletion in between is still delivered.
        watch.follow(ahead[-1].key.decode(), start_revision=response.header.revision + 1)
        return None

    def _ensure_key(self, key: str) -> int:
        """Create our candidate key on the session lease if absent; return its create revision."""
        tx = self._client.transactions
        ok, responses = _call(
            self._client,
            lambda: self._client.transaction(
                compare=[tx.create(key) == 0],
                success=[tx.put(key, self.address, lease=self._session.lease_id), tx.get(key)],
                failure=[tx.get(key)],
            ),
            "election key create",
        )
        kvs = responses[1] if ok else responses[0]
        if ok:
            log.info("candidate_registered", job=self.job, key=key)
        return kvs[0][1].create_revision

    def leader(self) -> tuple[str, int] | None:
        """(address, term) of the current leader, or None when nobody campaigns."""
        return current_leader(self._client, self.job, prefix=self._prefix.removesuffix(f"/election/{self.job}/"))

    def resign(self) -> bool:
        """Delete our key if it is still the one we led with; True if deleted."""
        term, self._term = self._term, None
        if term is None:
            return False
        key = self.key
        tx = self._client.transactions
        ok, _ = _call(
            self._client,
            lambda: self._client.transaction(
                compare=[tx.create(key) == term], success=[tx.delete(key)], failure=[]
            ),
            "election resign",
        )
        log.info("leadership_resigned", job=self.job, term=term, deleted=ok)
        return ok


def current_leader(client: Client, job: str, *, prefix: str = DEFAULT_PREFIX) -> tuple[str, int] | None:
    """(address, term) of a job's leader as etcd has it, needing no session or campaign of ours."""
    election_prefix = f"{prefix}/election/{_check_job_name(job)}/"
    response = _call(
        client,
        lambda: client.get_prefix_response(election_prefix, sort_order="ascend", sort_target="create", limit=1),
        "election leader",
    )
    if not response.kvs:
        return None
    kv = response.kvs[0]
    return kv.value.decode(), kv.create_revision


class JobStore:
    """Job specs (immutable, create-once) and job state (written only by the fenced leader)."""

    def __init__(self, client: Client, *, prefix: str = DEFAULT_PREFIX) -> None:
        self._client = client
        self._specs = f"{prefix}/specs/"
        self._states = f"{prefix}/state/"

    def _spec_key(self, job: str) -> str:
        return self._specs + _check_job_name(job)

    def _state_key(self, job: str) -> str:
        return self._states + _check_job_name(job)

    def create_spec(self, job: str, spec: bytes) -> bytes:
        """Store spec unless one exists; return the stored spec either way."""
        key = self._spec_key(job)
        tx = self._client.transactions
        ok, responses = _call(
            self._client,
            lambda: self._client.transaction(
                compare=[tx.create(key) == 0], success=[tx.put(key, spec)], failure=[tx.get(key)]
            ),
            "spec create",
        )
        if ok:
            log.info("job_spec_created", job=job, revision=responses[0].response_put.header.revision)
            return spec
        return responses[0][0][0]

    def get_spec(self, job: str) -> bytes | None:
        key = self._spec_key(job)
        value, _ = _call(self._client, lambda: self._client.get(key), "spec get")
        return value

    def list_jobs(self) -> list[str]:
        response = _call(
            self._client,
            lambda: self._client.get_prefix_response(self._specs, keys_only=True),
            "job list",
        )
        return sorted(kv.key.decode()[len(self._specs):] for kv in response.kvs)

    def watch_jobs(self, callback: Callable[[str], None]) -> Callable[[], None]:
        """callback(job) for each spec created after this call returns; returns cancel().

        Runs callbacks on a dedicated thread and re-arms the watch after etcd
        failures without missing or repeating creations.
        """
        return _JobWatch(self._client, self._specs, callback).cancel

    def load_state(self, job: str) -> bytes | None:
        key = self._state_key(job)
        value, _ = _call(self._client, lambda: self._client.get(key), "state get")
        return value

    def write_state(self, leadership: Leadership, state: bytes, *, spec: bytes | None = None) -> int:
        """Write state iff our election key still has the term's create revision.

        The compare is the fencing token: once our lease expired (key deleted)
        or a new key was created, the write fails even if we still think we lead.
        `spec`, given when etcd lost it, is restored by the same fenced write.
        """
        key = self._state_key(leadership.job)
        tx = self._client.transactions
        puts = [tx.put(key, state)] + ([tx.put(self._spec_key(leadership.job), spec)] if spec is not None else [])
        ok, responses = _call(
            self._client,
            lambda: self._client.transaction(
                compare=[tx.create(leadership.key) == leadership.term],
                success=puts,
                failure=[],
            ),
            "state write",
        )
        if not ok:
            log.warning("state_write_fenced", job=leadership.job, term=leadership.term)
            raise Fenced(f"job {leadership.job!r}: leadership term {leadership.term} is over; state not written")
        return responses[0].response_put.header.revision

    def delete_job(self, job: str) -> None:
        spec_key, state_key = self._spec_key(job), self._state_key(job)
        tx = self._client.transactions
        _call(
            self._client,
            lambda: self._client.transaction(
                compare=[], success=[tx.delete(spec_key), tx.delete(state_key)], failure=[]
            ),
            "job delete",
        )
        log.info("job_deleted", job=job)


_WAKE = object()


class _JobWatch:
    """Delivers new spec keys to a callback; survives watch stream failures."""

    def __init__(self, client: Client, prefix: str, callback: Callable[[str], None]) -> None:
        self._client = client
        self._prefix = prefix
        self._callback = callback
        self._stop = threading.Event()
        self._queue: queue.Queue[Any] = queue.Queue()
        # Pin the starting revision now, so creations after watch_jobs() returns
        # are reported even though the watch itself is armed on another thread.
        response = _call(client, lambda: client.get_prefix_response(prefix, count_only=True), "job watch start")
        self._next_revision = response.header.revision + 1
        self._thread = threading.Thread(target=self._run, name="muster-job-watch", daemon=True)
        self._thread.start()

    def cancel(self) -> None:
        self._stop.set()
        self._queue.put(_WAKE)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while not self._stop.is_set():
            # A fresh queue per watch: stragglers from a dead watch land in the old one.
            responses: queue.Queue[Any] = queue.Queue()
            self._queue = responses
            try:
                watch_id = _call(self._client, lambda: self._arm(responses), "job watch create")
            except EtcdError as exc:
                log.warning("job_watch_arm_failed", error=str(exc))
                self._stop.wait(_POLL_S)
                continue
            if watch_id is None:
                self._catch_up()
                continue
            try:
                self._pump(responses)
            finally:
                try:
                    self._client.cancel_watch(watch_id)
                except Exception as exc:  # best effort: the stream may be gone already
                    log.debug("watch_cancel_failed", error=str(exc))

    def _arm(self, responses: queue.Queue[Any]) -> Any:
        """Create the watch; None when its start revision was already compacted."""
        try:
            return self._client.add_watch_prefix_callback(
                self._prefix, responses.put, start_revision=self._next_revision
            )
        except etcd3.exceptions.RevisionCompactedError:
            return None

    def _pump(self, responses: queue.Queue[Any]) -> None:
        while not self._stop.is_set():
            try:
                item = responses.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if item is _WAKE:
                return
            if isinstance(item, etcd3.exceptions.RevisionCompactedError):
                self._catch_up()
                return
            if not isinstance(item, etcd3.watch.WatchResponse):
                log.warning("job_watch_interrupted", error=repr(item))
                return
            for event in item.events:
                # Specs are immutable, so a put whose create and mod revisions
                # match is a creation (also a re-creation after delete_job).
                if isinstance(event, etcd3.events.PutEvent) and event.create_revision == event.mod_revision:
                    self._emit(event.key.decode()[len(self._prefix):])
                self._next_revision = max(self._next_revision, event.mod_revision + 1)

    def _catch_up(self) -> None:
        """History we needed was compacted: report creations from a fresh listing."""
        try:
            response = _call(
                self._client, lambda: self._client.get_prefix_response(self._prefix, keys_only=True), "job list"
            )
        except EtcdError as exc:
            log.warning("job_watch_catch_up_failed", error=str(exc))
            self._stop.wait(_POLL_S)
            return
        for kv in sorted(response.kvs, key=lambda kv: kv.create_revision):
            if kv.create_revision >= self._next_revision:
                self._emit(kv.key.decode()[len(self._prefix):])
        self._next_revision = response.header.revision + 1

    def _emit(self, job: str) -> None:
        try:
            self._callback(job)
        except Exception:
            log.exception("job_watch_callback_failed", job=job)
