"""The etcd `JobStorage`: job specs, fenced job state, and the watch that reports new jobs."""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable

import etcd3.events
import etcd3.exceptions
import etcd3.watch
import structlog

from muster.coordinator.etcd.client import DEFAULT_PREFIX, POLL_S, Client, EtcdError, call, check_job_name
from muster.coordinator.etcd.election import LeaderKey
from muster.coordinator.errors import Fenced

log = structlog.get_logger(__name__)


class JobStore:
    """Job specs (immutable, create-once) and job state (written only by the fenced leader)."""

    def __init__(self, client: Client, *, prefix: str = DEFAULT_PREFIX) -> None:
        self._client = client
        self._specs = f"{prefix}/specs/"
        self._states = f"{prefix}/state/"

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

    def watch_jobs(self, callback: Callable[[str], None]) -> Callable[[], None]:
        """callback(job) for each spec created after this call returns; returns cancel().

        Runs callbacks on a dedicated thread and re-arms the watch after etcd
        failures without missing or repeating creations.
        """
        return _JobWatch(self._client, self._specs, callback).cancel

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

    def __init__(self, client: Client, prefix: str, callback: Callable[[str], None]) -> None:
        self._client = client
        self._prefix = prefix
        self._callback = callback
        self._stop = threading.Event()
        self._queue: queue.Queue[Any] = queue.Queue()
        # Pin the starting revision now, so creations after watch_jobs() returns
        # are reported even though the watch itself is armed on another thread.
        response = call(client, lambda: client.get_prefix_response(prefix, count_only=True), "job watch start")
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
                if isinstance(event, etcd3.events.PutEvent) and event.create_revision == event.mod_revision:
                    self._emit(event.key.decode()[len(self._prefix):])
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
        for kv in sorted(response.kvs, key=lambda kv: kv.create_revision):
            if kv.create_revision >= self._next_revision:
                self._emit(kv.key.decode()[len(self._prefix):])
        self._next_revision = response.header.revision + 1

    def _emit(self, job: str) -> None:
        try:
            self._callback(job)
        except Exception:
            log.exception("job_watch_callback_failed", job=job)
