"""Sessions and per-job elections as a replica needs them: the seam between `Replica` and etcd's
leases and election keys.

`Coordination` is what `Replica` calls; `etcd.election.EtcdCoordination` is the real one and
`MemoryCoordination` its in-memory twin, whose fault hooks (a lease that expires, etcd unreachable)
let replica failover run in-process with no etcd. One contract suite (tests/contract/) holds both
to the same behaviour, as it does the job stores.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Protocol

import structlog

from muster.coordinator.etcd.client import EtcdUnavailable, check_job_name
from muster.coordinator.etcd.election import LeaderKey

log = structlog.get_logger(__name__)

_POLL_S = 0.05  # a campaign's longest wait before it looks at its stop flag again


class LeaseSession(Protocol):
    """A lease kept alive until it is lost (for good) or closed; election keys live on it."""

    lost_reason: str | None

    def start(self) -> LeaseSession:
        """Grant the lease; raises EtcdUnavailable."""

    def alive(self, now: float | None = None) -> bool: ...

    def add_listener(self, fn: Callable[[], None]) -> None:
        """fn() once when the session is lost (at once if it is already); never after close()."""

    def close(self, revoke: bool = True) -> None:
        """Stop; revoke=True deletes the lease's keys at once (a standby leads without waiting)."""

    def revoke(self) -> bool:
        """Delete the lease and its keys now; False when the store did not answer. Repeatable."""


class JobElection(Protocol):
    """One replica's candidacy for one job: the lowest term (create revision) leads."""

    def campaign(self, stop: threading.Event) -> LeaderKey | None:
        """Block until this candidate leads; None once `stop` is set or the session is lost."""

    def resign(self) -> bool:
        """Delete the key this candidate led with, if it still holds; True if deleted."""

    def withdraw(self) -> None:
        """Delete this candidate's key, led with or not (the job ended: nobody campaigns for it)."""


class Coordination(Protocol):
    def session(self, ttl_s: int, *, renew_deadline_s: float | None = None) -> LeaseSession: ...

    def election(self, session: LeaseSession, job: str, address: str) -> JobElection: ...

    def current_leader(self, job: str) -> tuple[str, int] | None:
        """(address, term) of the job's leader, needing no session; raises EtcdUnavailable."""


class MemoryCoordination:
    """`Coordination` in memory. Terms come from one counter, as etcd's revisions; a session's keys
    go with it (expired, or closed with revoke). Sessions are lost only through `expire()`: nothing
    renews, so nothing lapses by itself, and a test decides when a lease is gone."""

    def __init__(self) -> None:
        self._changed = threading.Condition()  # notified on every key deleted
        self._revision = 0
        self._leases = itertools.count(1)
        # job -> lease -> (term, address, session): a candidate's key, as etcd's election keys
        self._keys: dict[str, dict[int, tuple[int, str, MemorySession]]] = {}
        self._unavailable = False

    # ---- fault hooks -----------------------------------------------------------------

    def expire(self, session: MemorySession, reason: str = "lease_expired") -> None:
        """The session's lease is gone: its keys are deleted and its listeners told."""
        session._lose(reason)

    def make_unavailable(self) -> None:
        """Every call raises EtcdUnavailable (campaigns wait) until make_available()."""
        with self._changed:
            self._unavailable = True

    def make_available(self) -> None:
        with self._changed:
            self._unavailable = False
            self._changed.notify_all()

    def leader_session(self, job: str) -> MemorySession | None:
        """The session whose key leads `job`: the one to expire to fail its leader over."""
        with self._changed:
            held = self._keys.get(job)
            return min(held.values(), key=lambda k: k[0])[2] if held else None

    # ---- Coordination ----------------------------------------------------------------

    def session(self, ttl_s: int, *, renew_deadline_s: float | None = None) -> MemorySession:
        return MemorySession(self)

    def election(self, session: MemorySession, job: str, address: str) -> MemoryElection:
        return MemoryElection(self, session, job, address)

    def current_leader(self, job: str) -> tuple[str, int] | None:
        with self._changed:
            self._check()
            held = self._keys.get(check_job_name(job))
            if not held:
                return None
            term, address, _ = min(held.values(), key=lambda k: k[0])
            return address, term

    def _check(self) -> None:
        if self._unavailable:
            raise EtcdUnavailable("memory coordination made unavailable")

    def _drop_keys(self, lease: int) -> None:
        with self._changed:
            for held in self._keys.values():
                held.pop(lease, None)
            self._changed.notify_all()


class MemorySession:
    """`LeaseSession` of the twin: alive from start() until expired (by the hook) or closed."""

    def __init__(self, coordination: MemoryCoordination) -> None:
        self._coordination = coordination
        self._lock = threading.Lock()
        self.lease_id: int | None = None
        self._closed = False
        self._listeners: list[Callable[[], None]] = []
        self.lost = threading.Event()
        self.lost_reason: str | None = None

    def start(self) -> MemorySession:
        with self._coordination._changed:
            self._coordination._check()
            self.lease_id = next(self._coordination._leases)
        return self

    def alive(self, now: float | None = None) -> bool:
        with self._lock:
            return self.lease_id is not None and not self._closed and not self.lost.is_set()

    def add_listener(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if not self.lost.is_set():
                self._listeners.append(fn)
                return
        fn()

    def close(self, revoke: bool = True) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if revoke:
            self.revoke()

    def revoke(self) -> bool:
        if self.lease_id is not None:
            with self._coordination._changed:
                if self._coordination._unavailable:
                    return False
            self._coordination._drop_keys(self.lease_id)
        return True

    def _lose(self, reason: str) -> None:
        with self._lock:
            if self.lost.is_set() or self._closed or self.lease_id is None:
                return
            self.lost_reason = reason
            self.lost.set()
            listeners, self._listeners = self._listeners, []
        self._coordination._drop_keys(self.lease_id)
        log.warning("session_lost", lease=hex(self.lease_id), reason=reason)
        for fn in listeners:
            try:
                fn()
            except Exception:  # as etcd's Session: one listener's fault does not keep the others from hearing
                log.exception("session_listener_failed", lease=hex(self.lease_id))


class MemoryElection:
    """`JobElection` of the twin: a campaign waits on the twin's key changes, a short poll at most."""

    def __init__(self, coordination: MemoryCoordination, session: MemorySession, job: str, address: str) -> None:
        self._coordination = coordination
        self._session = session
        self.job = check_job_name(job)
        self.address = address
        self._term: int | None = None

    def campaign(self, stop: threading.Event) -> LeaderKey | None:
        c = self._coordination
        while not stop.is_set() and self._session.alive():
            with c._changed:
                if not c._unavailable:
                    lease = self._session.lease_id
                    held = c._keys.setdefault(self.job, {})
                    if lease not in held:
                        c._revision += 1
                        held[lease] = (c._revision, self.address, self._session)
                    term = held[lease][0]
                    if term == min(k[0] for k in held.values()) and self._session.alive():
                        self._term = term
                        log.info("leadership_acquired", job=self.job, term=term, address=self.address)
                        return LeaderKey(job=self.job, term=term, key=f"memory/{self.job}/{lease:x}",
                                         address=self.address)
                c._changed.wait(_POLL_S)
        log.info("campaign_abandoned", job=self.job, stopped=stop.is_set(), session_lost=self._session.lost.is_set())
        return None

    def resign(self) -> bool:
        term, self._term = self._term, None
        if term is None:
            return False
        c = self._coordination
        with c._changed:
            c._check()
            held = c._keys.get(self.job, {})
            deleted = held.get(self._session.lease_id, (None,))[0] == term
            if deleted:
                del held[self._session.lease_id]
                c._changed.notify_all()
        log.info("leadership_resigned", job=self.job, term=term, deleted=deleted)
        return deleted

    def withdraw(self) -> None:
        c = self._coordination
        with c._changed:
            c._check()
            held = c._keys.get(self.job, {})
            if held.pop(self._session.lease_id, None) is not None:
                c._changed.notify_all()
            if not held:
                c._keys.pop(self.job, None)
