"""What a leader holds of its job, as etcd's concurrency.Session.Done() gives it: one handle through
which a JobLeader learns that its leadership is over, and the only way it writes its job's state."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog

from muster.coordinator.core.state import JobState, encode, encode_spec, run_summary
from muster.coordinator.coordination import LeaderKey
from muster.coordinator.errors import PersistUnavailable, StoreError
from muster.coordinator.store import JobStorage

log = structlog.get_logger(__name__)


class Leadership:
    """One term of one job's leadership: `term` (the fencing token), `alive()`, `lost`, and the fenced
    `write_state()`.

    `lost` is set once, through `lose()`: by the replica that owns the session (it closes, or lost
    the session) or by the leader (a fenced write, a fault); the replica awaits it to campaign
    again. `alive()` also asks the session, whose own clock check sees a renew deadline passed (a
    process resumed after SIGSTOP) before its renew thread has run.
    """

    def __init__(self, key: LeaderKey, store: JobStorage, *, session_alive: Callable[[], bool] = lambda: True,
                 restore_spec: bool = False) -> None:
        self.key = key
        self.job, self.term = key.job, key.term
        self._store = store
        self._session_alive = session_alive
        self._restore_spec = restore_spec  # the store lost the job's spec: written with the next state
        self.lost = asyncio.Event()
        self.lost_reason: str | None = None

    def alive(self) -> bool:
        return self.lost_reason is None and self._session_alive()

    def lose(self, reason: str) -> bool:
        """End the leadership; True if this call ended it (a later reason is not kept)."""
        if self.lost_reason is not None:
            return False
        self.lost_reason = reason
        self.lost.set()
        return True

    async def write_state(self, state: JobState) -> int:
        """Write `state` iff this term still holds; the bytes written. Raises Fenced (the term is
        over) or PersistUnavailable (not written: the leader decides again on its next tick)."""
        spec = encode_spec(state.spec, state.run) if self._restore_spec else None

        def write() -> int:
            data = encode(state)
            self._store.write_state(self.key, data, spec=spec)
            return len(data) + len(spec or b"")

        try:
            # Encoding a large job's state takes a while: off the event loop, with the write.
            written = await asyncio.to_thread(write)
        except StoreError as exc:  # unreachable, or refused (e.g. over etcd's request size): not adopted, retried
            raise PersistUnavailable(str(exc)) from exc
        self._restore_spec = False
        return written

    async def end_run(self, state: JobState, retain_s: float, kept: int) -> None:
        """Record the ended run (`state`, its outcome set) for `retain_s` and remove the job, iff this
        term still holds; then the job's oldest records past `kept` are deleted (one name cycled through
        runs keeps `kept`, not all it made in `retain_s`). Raises Fenced or PersistUnavailable (the
        leader tries again next tick)."""
        try:
            await asyncio.to_thread(lambda: self._store.end_run(self.key, state.run, encode(state), run_summary(state),
                                                                retain_s))
        except StoreError as exc:
            raise PersistUnavailable(str(exc)) from exc
        try:
            await asyncio.to_thread(self._keep_runs, kept)
        except StoreError as exc:  # the next run's end deletes them
            log.warning("runs_not_pruned", job=self.job, error=str(exc))

    def _keep_runs(self, kept: int) -> None:
        for run in sorted(run for _, run, _ in self._store.runs(self.job))[:-kept]:
            self._store.delete_runs(self.job, run)
