"""Job storage as a replica needs it: the seam between the coordinator and etcd.

`JobStorage` is what `Replica` calls; `etcd.store.JobStore` is the real one and
`memory.MemoryJobStore` its in-memory twin, which can be told to fail the way etcd fails (a fenced
write, unavailability, lost data) so that leaders and replicas are tested in-process. One
contract suite (tests/contract/) holds both to the same behaviour.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from muster.coordinator.coordination import LeaderKey


class JobStorage(Protocol):
    """Job specs (immutable, create-once) and job state (written only by the fenced leader).

    Unavailability raises StoreUnavailable, a write by a term that is over raises Fenced.
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
