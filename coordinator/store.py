"""Job storage as a replica needs it: the seam between the coordinator and etcd.

`JobStorage` is what `Replica` calls; `etcd.store.JobStore` is the real one and
`MemoryJobStore` its in-memory twin, which can be told to fail the way etcd fails (a fenced
write, unavailability, lost data) so that leaders and replicas are tested in-process. One
contract suite (tests/contract/) holds both to the same behaviour.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol

import structlog

from muster.coordinator.errors import Fenced
from muster.coordinator.etcd.client import EtcdUnavailable
from muster.coordinator.etcd.election import LeaderKey

log = structlog.get_logger(__name__)


class JobStorage(Protocol):
    """Job specs (immutable, create-once) and job state (written only by the fenced leader).

    Unavailability raises EtcdUnavailable, a write by a term that is over raises Fenced.
    """

    def create_spec(self, job: str, spec: bytes) -> bytes:
        """Store spec unless one exists; return the stored spec either way."""

    def get_spec(self, job: str) -> bytes | None: ...

    def list_jobs(self) -> list[str]: ...

    def watch_jobs(self, callback: Callable[[str], None],
                   removed: Callable[[str], None] | None = None) -> Callable[[], None]:
        """callback(job) for each spec created after this call returns, removed(job) for each one
        deleted (the job's run ended); returns cancel()."""

    def load_state(self, job: str) -> bytes | None: ...

    def write_state(self, leader: LeaderKey, state: bytes, *, spec: bytes | None = None) -> int:
        """Write state (and a lost spec) iff the leader's term still holds; a revision."""

    def end_run(self, leader: LeaderKey, run: int, record: bytes, summary: bytes, retain_s: float) -> None:
        """Iff the leader's term holds: keep the run's record and summary for retain_s (none at 0),
        delete the job's spec, state and the leader's election key. Raises Fenced otherwise."""

    def runs(self, job: str = "") -> list[tuple[str, int, bytes]]:
        """(job, run, summary) of the retained finished runs, of `job` or of every job."""

    def last_run(self, job: str) -> int:
        """The highest retained run of `job` (0: none)."""

    def load_run(self, job: str, run: int) -> bytes | None: ...

    def delete_runs(self, job: str, run: int = 0) -> int:
        """Delete a finished run's record (every retained run of `job` at 0); how many."""


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

    # ---- fault hooks -----------------------------------------------------------------

    def fence_next_write(self, job: str | None = None) -> None:
        """The next write of `job`'s state (of any job's with None) is refused as fenced."""
        with self._lock:
            self._fence_next.add(job)

    def make_unavailable(self, *jobs: str) -> None:
        """Calls about `jobs` (with none: every call) raise EtcdUnavailable until make_available()."""
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
            raise EtcdUnavailable(f"memory store made unavailable (job {job!r})")

    @staticmethod
    def _emit(callback: Callable[[str], None], job: str) -> None:
        try:
            callback(job)
        except Exception:
            log.exception("job_watch_callback_failed", job=job)
