"""Per-job leader election among coordinator replicas, on keys bound to their session leases."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import etcd3.watch
import structlog

from muster.coordinator.coordination import LeaderKey
from muster.coordinator.etcd.client import DEFAULT_PREFIX, POLL_S, Client, EtcdUnavailable, LeaseNotFound, call
from muster.coordinator.etcd.session import Session
from muster.names import check_job_name

log = structlog.get_logger(__name__)


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

        self._watch_id = call(
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
        self.job = check_job_name(job)
        self.address = address
        self._prefix = f"{prefix}/election/{job}/"
        self._term: int | None = None

    @property
    def key(self) -> str:
        return f"{self._prefix}{self._session.lease_id:x}"

    def campaign(self, stop: threading.Event) -> LeaderKey | None:
        """Block until we lead; None if stop is set or the session is lost first."""
        watch = _KeyWatch(self._client)
        try:
            while not stop.is_set() and self._session.alive():
                try:
                    leadership = self._campaign_step(watch)
                except LeaseNotFound:
                    # Only the session's renew thread declares it lost: it renews now, and fails.
                    self._session.renew_now()
                    stop.wait(POLL_S)
                    continue
                except EtcdUnavailable as exc:
                    log.warning("campaign_retrying", job=self.job, error=str(exc))
                    stop.wait(POLL_S)
                    continue
                if leadership is not None:
                    return leadership
                watch.wait(POLL_S)
            log.info("campaign_abandoned", job=self.job, stopped=stop.is_set(),
                     session_lost=self._session.lost.is_set())
            return None
        finally:
            watch.cancel()

    def _campaign_step(self, watch: _KeyWatch) -> LeaderKey | None:
        key = self.key
        term = self._ensure_key(key)
        response = call(
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
            return LeaderKey(job=self.job, term=term, key=key, address=self.address)
        # Start just after the listing so a deletion in between is still delivered.
        watch.follow(ahead[-1].key.decode(), start_revision=response.header.revision + 1)
        return None

    def _ensure_key(self, key: str) -> int:
        """Create our candidate key on the session lease if absent; return its create revision."""
        tx = self._client.transactions
        ok, responses = call(
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
        ok, _ = call(
            self._client,
            lambda: self._client.transaction(
                compare=[tx.create(key) == term], success=[tx.delete(key)], failure=[]
            ),
            "election resign",
        )
        log.info("leadership_resigned", job=self.job, term=term, deleted=ok)
        return ok

    def withdraw(self) -> None:
        """Delete our candidate key, led with or not: the job ended, nobody campaigns for it."""
        self._term = None
        key = self.key
        call(self._client, lambda: self._client.delete(key), "election withdraw")


def current_leader(client: Client, job: str, *, prefix: str = DEFAULT_PREFIX) -> tuple[str, int] | None:
    """(address, term) of a job's leader as etcd has it, needing no session or campaign of ours."""
    election_prefix = f"{prefix}/election/{check_job_name(job)}/"
    response = call(
        client,
        lambda: client.get_prefix_response(election_prefix, sort_order="ascend", sort_target="create", limit=1),
        "election leader",
    )
    if not response.kvs:
        return None
    kv = response.kvs[0]
    return kv.value.decode(), kv.create_revision


class EtcdCoordination:
    """Sessions and elections in `client`'s etcd: the real `coordinator.coordination.Coordination`."""

    def __init__(self, client: Client) -> None:
        self.client = client

    def session(self, ttl_s: int, *, renew_deadline_s: float | None = None) -> Session:
        return Session(self.client, ttl_s, renew_deadline_s=renew_deadline_s)

    def election(self, session: Session, job: str, address: str) -> Election:
        return Election(self.client, session, job, address)

    def current_leader(self, job: str) -> tuple[str, int] | None:
        return current_leader(self.client, job)

    def watch_elections(self, job: str, changed: Callable[[], None]) -> Callable[[], None]:
        def on_response(response: Any) -> None:
            if not isinstance(response, etcd3.watch.WatchResponse) or response.events:
                changed()  # (a failed stream too: the waiter reads etcd rather than wait for an event)

        prefix = f"{DEFAULT_PREFIX}/election/{check_job_name(job)}/"
        watch_id = call(self.client, lambda: self.client.add_watch_prefix_callback(prefix, on_response),
                        "election watch")

        def cancel() -> None:
            try:
                self.client.cancel_watch(watch_id)
            except Exception as exc:  # best effort: the stream may be gone already
                log.debug("watch_cancel_failed", error=str(exc))
        return cancel
