"""Sessions and per-job elections as a replica needs them: the seam between `Replica` and etcd's
leases and election keys.

`Coordination` is what `Replica` calls; `etcd.election.EtcdCoordination` is the real one and
`memory.MemoryCoordination` its in-memory twin, whose fault hooks (a lease that expires, etcd
unreachable) let replica failover run in-process with no etcd. One contract suite (tests/contract/)
holds both to the same behaviour, as it does the job stores.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class LeaderKey:
    """The election key a leader won; its create revision (`term`) is the fencing token."""

    job: str
    term: int
    key: str
    address: str


class LeaseSession(Protocol):
    """A lease kept alive until it is lost (for good) or closed; election keys live on it."""

    lost_reason: str | None

    def start(self) -> LeaseSession:
        """Grant the lease; raises StoreUnavailable."""

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
        """(address, term) of the job's leader, needing no session; raises StoreUnavailable."""

    def watch_elections(self, job: str, changed: Callable[[], None]) -> Callable[[], None]:
        """changed(), on another thread, after the job's candidates change (a key created,
        resigned, withdrawn or gone with its lease), and once if the watch itself fails: read
        current_leader then. Returns cancel(). Raises StoreUnavailable."""
