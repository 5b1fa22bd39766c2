"""The in-memory twins of the seams (`store.JobStorage`, `coordination.Coordination`): they fail
the way etcd fails when told to (a fenced write, unavailability, lost data, a lease that expires),
so that leaders and replicas are tested in-process with no etcd. One contract suite
(tests/contract/) holds each twin and its etcd implementation to the same behaviour."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable

import structlog

from muster.coordinator.coordination import LeaderKey
from muster.coordinator.errors import Fenced, StoreUnavailable
from muster.names import check_job_name

log = structlog.get_logger(__name__)

_POLL_S = 0.05  # a campaign's longest wait before it looks at its stop flag again


class MemoryJobStore:
    """`JobStorage` in memory, with fault hooks (in the manner of torch elastic's
    FakeRendezvousBackend). A term is fenced once a later term of the same job has written, as
    an etcd election key is gone once a later one leads; watch callbacks run on the writer's
    thread, at once."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        # (job, run) -> (record, summary, expiry): a retained finished run, gone past its expiry
        self._runs: dict[tuple[str, int], tuple[bytes, bytes, float]] = {}
        self._specs: dict[str, bytes] = {}
        self._states: dict[str, bytes] = {}
        self._terms: dict[str, int] = {}  # job -> the latest term that wrote its state
        self._ended: dict[str, int] = {}  # job -> the term that ended its last run: it and older are fenced
        self._revision = 0
        self._watchers: list[tuple[Callable[[str], None], Callable[[str], None] | None]] = []
        self._fence_next: set[str | None] = set()
        self._unavailable: set[str | None] = set()
        self.refused = 0  # calls refused as unavailable: a test waits for some before it asserts

    # ---- fault hooks -----------------------------------------------------------------

    def fence_next_write(self, job: str | None = None) -> None:
        """The next write of `job`'s state (of any job's with None) is refused as fenced."""
        with self._lock:
            self._fence_next.add(job)

    def make_unavailable(self, *jobs: str) -> None:
        """Calls about `jobs` (with none: every call) raise StoreUnavailable until make_available()."""
        with self._lock:
            self._unavailable.update(jobs or (None,))

    def make_available(self) -> None:
        with self._lock:
            self._unavailable.clear()

    def lose_everything(self) -> None:
        """As etcd losing its data: no spec, no state, and terms start over."""
        with self._lock:
            self._specs.clear()
            self._states.clear()
            self._terms.clear()
            self._ended.clear()
            self._runs.clear()
        log.warning("memory_store_lost_everything")

    # ---- JobStorage ------------------------------------------------------------------

    def create_spec(self, job: str, spec: bytes) -> bytes:
        with self._lock:
            self._check(job)
            created = job not in self._specs
            stored = self._specs.setdefault(job, spec)
            watchers = [created_cb for created_cb, _ in self._watchers] if created else []
        for callback in watchers:
            self._emit(callback, job)
        return stored

    def get_spec(self, job: str) -> bytes | None:
        with self._lock:
            self._check(job)
            return self._specs.get(job)

    def list_jobs(self) -> list[str]:
        with self._lock:
            self._check(None)
            return sorted(self._specs)

    def watch_jobs(self, callback: Callable[[str], None],
                   removed: Callable[[str], None] | None = None) -> Callable[[], None]:
        watcher = (callback, removed)
        with self._lock:
            self._check(None)
            self._watchers.append(watcher)

        def cancel() -> None:
            with self._lock:
                if watcher in self._watchers:
                    self._watchers.remove(watcher)

        return cancel

    def load_state(self, job: str) -> bytes | None:
        with self._lock:
            self._check(job)
            return self._states.get(job)

    def write_state(self, leader: LeaderKey, state: bytes, *, spec: bytes | None = None) -> int:
        job = leader.job
        with self._lock:
            self._check(job)
            hooked = [j for j in (job, None) if j in self._fence_next][:1]
            if hooked or leader.term < self._terms.get(job, 0) or leader.term <= self._ended.get(job, 0):
                self._fence_next.difference_update(hooked)
                log.warning("state_write_fenced", job=job, term=leader.term)
                raise Fenced(f"job {job!r}: leadership term {leader.term} is over; state not written")
            self._terms[job] = leader.term
            self._states[job] = state
            created = spec is not None and job not in self._specs
            if spec is not None:
                self._specs[job] = spec
            self._revision += 1
            revision = self._revision
            watchers = [created_cb for created_cb, _ in self._watchers] if created else []
        for callback in watchers:
            self._emit(callback, job)
        return revision

    def end_run(self, leader: LeaderKey, run: int, record: bytes, summary: bytes, retain_s: float) -> None:
        job = leader.job
        with self._lock:
            self._check(job)
            if (leader.term < self._terms.get(job, 0) or leader.term <= self._ended.get(job, 0)
                    or job in self._fence_next or None in self._fence_next):
                self._fence_next.difference_update({job, None})
                raise Fenced(f"job {job!r}: leadership term {leader.term} is over; its run was not ended")
            if retain_s > 0:
                self._runs[(job, run)] = (record, summary, self._clock() + retain_s)
            self._specs.pop(job, None)
            self._states.pop(job, None)
            self._ended[job] = leader.term  # fenced from now on (in etcd, by its deleted election key)
            watchers = [removed for _, removed in self._watchers if removed is not None]
        for callback in watchers:
            self._emit(callback, job)

    def runs(self, job: str = "") -> list[tuple[str, int, bytes]]:
        with self._lock:
            self._check(job or None)
            self._expire()
            return sorted((j, r, summary) for (j, r), (_, summary, _) in self._runs.items() if not job or j == job)

    def last_run(self, job: str) -> int:
        return max((r for _, r, _ in self.runs(job)), default=0)

    def load_run(self, job: str, run: int) -> bytes | None:
        with self._lock:
            self._check(job)
            self._expire()
            found = self._runs.get((job, run))
            return found[0] if found else None

    def delete_runs(self, job: str, run: int = 0) -> int:
        with self._lock:
            self._check(job)
            doomed = [key for key in self._runs if key[0] == job and (not run or key[1] == run)]
            for key in doomed:
                del self._runs[key]
            return len(doomed)

    def _expire(self) -> None:
        now = self._clock()
        for key in [k for k, (_, _, until) in self._runs.items() if until <= now]:
            del self._runs[key]

    def _check(self, job: str | None) -> None:
        if None in self._unavailable or (job is not None and job in self._unavailable):
            self.refused += 1
            raise StoreUnavailable(f"memory store made unavailable (job {job!r})")

    @staticmethod
    def _emit(callback: Callable[[str], None], job: str) -> None:
        try:
            callback(job)
        except Exception:
            log.exception("job_watch_callback_failed", job=job)


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
        self.refused = 0  # calls refused as unavailable (session grants among them)
        self._watchers: dict[int, tuple[str, Callable[[], None]]] = {}  # watch_elections' callbacks
        self._watch_ids = itertools.count(1)

    # ---- fault hooks -----------------------------------------------------------------

    def expire(self, session: MemorySession, reason: str = "lease_expired") -> None:
        """The session's lease is gone: its keys are deleted and its listeners told."""
        session._lose(reason)

    def make_unavailable(self) -> None:
        """Every call raises StoreUnavailable (campaigns wait) until make_available()."""
        with self._changed:
            self._unavailable = True

    def make_available(self) -> None:
        with self._changed:
            self._unavailable = False
            self._changed.notify_all()

    def candidates(self, job: str) -> int:
        """How many sessions campaign for `job` (their keys, the leader's among them)."""
        with self._changed:
            return len(self._keys.get(job, {}))

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

    def watch_elections(self, job: str, changed: Callable[[], None]) -> Callable[[], None]:
        with self._changed:
            self._check()
            watch = next(self._watch_ids)
            self._watchers[watch] = (check_job_name(job), changed)

        def cancel() -> None:
            with self._changed:
                self._watchers.pop(watch, None)
        return cancel

    def _keys_changed(self, jobs: set[str]) -> None:
        """Under `_changed`: wake the campaigns and tell the watchers of `jobs`."""
        self._changed.notify_all()
        for job, changed in list(self._watchers.values()):
            if job in jobs:
                changed()

    def _check(self) -> None:
        if self._unavailable:
            self.refused += 1
            raise StoreUnavailable("memory coordination made unavailable")

    def _drop_keys(self, lease: int) -> None:
        with self._changed:
            dropped = {job for job, held in self._keys.items() if held.pop(lease, None) is not None}
            self._keys_changed(dropped)


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
                        c._keys_changed({self.job})
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
                c._keys_changed({self.job})
        log.info("leadership_resigned", job=self.job, term=term, deleted=deleted)
        return deleted

    def withdraw(self) -> None:
        c = self._coordination
        with c._changed:
            c._check()
            held = c._keys.get(self.job, {})
            if held.pop(self._session.lease_id, None) is not None:
                c._keys_changed({self.job})
            if not held:
                c._keys.pop(self.job, None)
