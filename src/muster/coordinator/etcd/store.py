"""The etcd `JobStorage`: job specs, fenced job state, and the watch that reports new jobs."""

from __future__ import annotations

import math
import queue
import threading
from typing import Any, Callable

import etcd3.events
import etcd3.exceptions
import etcd3.watch
import structlog

from muster.coordinator.coordination import LeaderKey
from muster.coordinator.errors import Fenced
from muster.coordinator.etcd.client import DEFAULT_PREFIX, POLL_S, Client, EtcdError, LeaseNotFound, call
from muster.names import check_job_name

log = structlog.get_logger(__name__)


class JobStore:
    """Job specs (immutable, create-once) and job state (written only by the fenced leader) of the
    running jobs; the records of finished runs, each on a lease of the retention period, so etcd
    itself deletes them when it ends (no sweeper; a deleted record's lease is revoked)."""

    def __init__(self, client: Client, *, prefix: str = DEFAULT_PREFIX) -> None:
        self._client = client
        self._specs = f"{prefix}/specs/"
        self._states = f"{prefix}/state/"
        self._runs = f"{prefix}/runs/"  # <job>/<run>: a finished run's summary (what `muster jobs` lists)
        self._records = f"{prefix}/finished/"  # <job>/<run>: its final state, history included

    def _spec_key(self, job: str) -> str:
        return self._specs + check_job_name(job)

    def _state_key(self, job: str) -> str:
        return self._states + check_job_name(job)

    def create_spec(self, job: str, spec: bytes) -> bytes:
        """Store spec unless one exists; return the stored spec either way."""
        key = self._spec_key(job)
        tx = self._client.transactions
        ok, responses = call(
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
        value, _ = call(self._client, lambda: self._client.get(key), "spec get")
        return value

    def list_jobs(self) -> list[str]:
        response = call(
            self._client,
            lambda: self._client.get_prefix_response(self._specs, keys_only=True),
            "job list",
        )
        return sorted(kv.key.decode()[len(self._specs):] for kv in response.kvs)

    def watch_jobs(self, callback: Callable[[str], None],
                   removed: Callable[[str], None] | None = None) -> Callable[[], None]:
        """callback(job) for each spec created after this call returns, removed(job) for each spec
        deleted (its run ended); returns cancel().

        Runs callbacks on a dedicated thread and re-arms the watch after etcd
        failures without missing or repeating creations.
        """
        return _JobWatch(self._client, self._specs, callback, removed).cancel

    def load_state(self, job: str) -> bytes | None:
        key = self._state_key(job)
        value, _ = call(self._client, lambda: self._client.get(key), "state get")
        return value

    def write_state(self, leader: LeaderKey, state: bytes, *, spec: bytes | None = None) -> int:
        """Write state iff our election key still has the term's create revision.

        The compare is the fencing token: once our lease expired (key deleted)
        or a new key was created, the write fails even if we still think we lead.
        `spec`, given when etcd lost it, is restored by the same fenced write.
        """
        key = self._state_key(leader.job)
        tx = self._client.transactions
        puts = [tx.put(key, state)] + ([tx.put(self._spec_key(leader.job), spec)] if spec is not None else [])
        ok, responses = call(
            self._client,
            lambda: self._client.transaction(
                compare=[tx.create(leader.key) == leader.term],
                success=puts,
                failure=[],
            ),
            "state write",
        )
        if not ok:
            log.warning("state_write_fenced", job=leader.job, term=leader.term)
            raise Fenced(f"job {leader.job!r}: leadership term {leader.term} is over; state not written")
        return responses[0].response_put.header.revision

    def end_run(self, leader: LeaderKey, run: int, record: bytes, summary: bytes, retain_s: float) -> None:
        """The run is over: iff the leader's term still holds, keep its record and summary for
        `retain_s` (none at 0) and delete the job's spec, state and the leader's election key, so that
        no replica campaigns for it any more and its name starts a new run."""
        tx = self._client.transactions
        job = leader.job
        lease = None
        if retain_s > 0:
            lease = call(self._client, lambda: self._client.lease(max(2, math.ceil(retain_s))), "lease grant")
        keep = [tx.put(key, value, lease=lease) for key, value in
                ((self._run_key(self._records, job, run), record), (self._run_key(self._runs, job, run), summary))
                ] if lease is not None else []
        ok, _ = call(
            self._client,
            lambda: self._client.transaction(
                compare=[tx.create(leader.key) == leader.term],
                success=keep + [tx.delete(self._spec_key(job)), tx.delete(self._state_key(job)), tx.delete(leader.key)],
                failure=[],
            ),
            "run end",
        )
        if not ok:
            if lease is not None:
                self._revoke(lease.id)
            log.warning("run_end_fenced", job=job, term=leader.term)
            raise Fenced(f"job {job!r}: leadership term {leader.term} is over; its run was not ended")
        log.info("run_ended", job=job, run=run, retain_s=retain_s)

    def runs(self, job: str = "") -> list[tuple[str, int, bytes]]:
        """(job, run, summary) of the retained finished runs (of `job`, or of every job)."""
        return [(name, run, kv.value) for name, run, kv in self._run_kvs(job)]

    def _run_kvs(self, job: str) -> list:
        prefix = self._runs + (f"{check_job_name(job)}/" if job else "")
        response = call(self._client, lambda: self._client.get_prefix_response(prefix), "run list")
        found = []
        for kv in response.kvs:
            name, _, run = kv.key.decode()[len(self._runs):].rpartition("/")
            found.append((name, int(run), kv))
        return found

    def last_run(self, job: str) -> int:
        """The highest run of `job` still retained (0: none)."""
        prefix = f"{self._runs}{check_job_name(job)}/"
        response = call(self._client, lambda: self._client.get_prefix_response(
            prefix, keys_only=True, sort_order="descend", sort_target="key", limit=1), "run last")
        return int(response.kvs[0].key.decode().rpartition("/")[2]) if response.kvs else 0

    def load_run(self, job: str, run: int) -> bytes | None:
        key = self._run_key(self._records, job, run)
        value, _ = call(self._client, lambda: self._client.get(key), "run get")
        return value

    def delete_runs(self, job: str, run: int = 0) -> int:
        """Delete a finished run's record now (every retained run of `job` at 0): its lease is
        revoked, which deletes its keys. How many were deleted."""
        deleted = 0
        for _, found, kv in self._run_kvs(job):
            if run and found != run:
                continue
            self._revoke(kv.lease)
            deleted += 1
        log.info("runs_deleted", job=job, run=run or "all", deleted=deleted)
        return deleted

    def _revoke(self, lease: int) -> None:
        try:
            call(self._client, lambda: self._client.revoke_lease(lease), "lease revoke")
        except LeaseNotFound:
            pass  # expired meanwhile: its keys are gone already

    def _run_key(self, prefix: str, job: str, run: int) -> str:
        return f"{prefix}{check_job_name(job)}/{run:012d}"  # sorted by run

    def delete_job(self, job: str) -> None:
        spec_key, state_key = self._spec_key(job), self._state_key(job)
        tx = self._client.transactions
        call(
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

    def __init__(self, client: Client, prefix: str, callback: Callable[[str], None],
                 removed: Callable[[str], None] | None = None) -> None:
        self._client = client
        self._prefix = prefix
        self._callback = callback
        self._removed = removed
        self._stop = threading.Event()
        self._queue: queue.Queue[Any] = queue.Queue()
        # Pin the starting revision now, so creations after watch_jobs() returns
        # are reported even though the watch itself is armed on another thread.
        response = call(client, lambda: client.get_prefix_response(prefix, keys_only=True), "job watch start")
        self._next_revision = response.header.revision + 1
        # The jobs that exist: a catch-up after compaction reports those gone meanwhile as removed.
        self._present = {kv.key.decode()[len(prefix):] for kv in response.kvs}
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
                watch_id = call(self._client, lambda: self._arm(responses), "job watch create")
            except EtcdError as exc:
                log.warning("job_watch_arm_failed", error=str(exc))
                self._stop.wait(POLL_S)
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
                item = responses.get(timeout=POLL_S)
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
                job = event.key.decode()[len(self._prefix):]
                if isinstance(event, etcd3.events.PutEvent) and event.create_revision == event.mod_revision:
                    self._present.add(job)
                    self._emit(self._callback, job)
                elif isinstance(event, etcd3.events.DeleteEvent):
                    self._present.discard(job)
                    self._emit(self._removed, job)
                self._next_revision = max(self._next_revision, event.mod_revision + 1)

    def _catch_up(self) -> None:
        """History we needed was compacted: report creations from a fresh listing."""
        try:
            response = call(
                self._client, lambda: self._client.get_prefix_response(self._prefix, keys_only=True), "job list"
            )
        except EtcdError as exc:
            log.warning("job_watch_catch_up_failed", error=str(exc))
            self._stop.wait(POLL_S)
            return
        listed = {kv.key.decode()[len(self._prefix):] for kv in response.kvs}
        for job in sorted(self._present - listed):
            self._emit(self._removed, job)
        for kv in sorted(response.kvs, key=lambda kv: kv.create_revision):
            if kv.create_revision >= self._next_revision:
                self._emit(self._callback, kv.key.decode()[len(self._prefix):])
        self._present = listed
        self._next_revision = response.header.revision + 1

    @staticmethod
    def _emit(callback: Callable[[str], None] | None, job: str) -> None:
        if callback is None:
            return
        try:
            callback(job)
        except Exception:
            log.exception("job_watch_callback_failed", job=job)
