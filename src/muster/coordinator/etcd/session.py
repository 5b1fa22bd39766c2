"""The lease session: one etcd lease kept alive, and lost for good once it lapses."""

from __future__ import annotations

import threading
import time
from typing import Callable

import etcd3
import grpc
import structlog

from muster.coordinator.etcd.client import Client, EtcdError, EtcdUnavailable, LeaseNotFound, call

log = structlog.get_logger(__name__)


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
        self._revoked = False
        self._stop = threading.Event()
        self._wake = threading.Event()  # set to renew at once, and by close()
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
        lease = call(self._client, lambda: self._client.lease(self.ttl_s), "lease grant")
        took = self._clock() - granted_at
        if took >= self.renew_deadline_s:
            # etcd answered after the deadline (it was frozen or overloaded as the grant was sent): the
            # session would be born lost. Refused, so the caller's retry gets a lease etcd grants promptly.
            try:
                call(self._client, lambda: self._client.revoke_lease(lease.id), "lease revoke")
            except EtcdError:
                pass  # it expires on its own
            raise EtcdUnavailable(f"lease grant answered after {took:.1f}s, past the renew deadline "
                                  f"({self.renew_deadline_s:g}s)")
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

    def renew_now(self) -> None:
        """Renew at once rather than at the next interval: a request found the lease gone, and
        only the renew thread, the session's one owner, may declare it lost."""
        self._wake.set()

    def close(self, revoke: bool = True) -> None:
        """Stop renewing; revoke=False leaves the lease to expire (a frozen process)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=(self._client.timeout or 5.0) + 1.0)
        revoked = revoke and self.revoke()
        log.info("session_closed", lease=hex(self._lease_id or 0), revoked=revoked)

    def revoke(self) -> bool:
        """Delete the lease, and so its keys, now. False: etcd did not answer (the lease dies on its
        own a TTL after etcd is back: etcd renews every lease when it restarts). Repeatable."""
        if self._lease_id is None or self._revoked:
            return True
        try:
            call(self._client, lambda: self._client.revoke_lease(self._lease_id), "lease revoke")
        except LeaseNotFound:
            pass  # expired already
        except EtcdError as exc:
            log.warning("session_revoke_failed", lease=hex(self._lease_id), error=str(exc))
            return False
        self._revoked = True
        return True

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
        while True:
            self._wake.wait(max(0.0, min(delay, self._remaining_s())))
            self._wake.clear()
            if self._stop.is_set():
                return
            if self._remaining_s() <= 0:
                self._mark_lost("renew_deadline")
                return
            sent_at = self._clock()
            try:
                ttl = self._keepalive(timeout_s=self._remaining_s())
            except LeaseNotFound:
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

        return call(client, once, "lease keepalive")

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