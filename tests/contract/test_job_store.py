"""The contract of job storage (`muster.coordinator.store.JobStorage`), held against the in-memory
twin and against etcd's JobStore: what the in-process coordinator tests assume of the twin is what
etcd does. Every wait is bounded; the etcd started here is stopped and reaped by its fixture."""

from __future__ import annotations

import itertools
import queue
import threading

import pytest

from muster.coordinator.coordination import LeaderKey
from muster.coordinator.errors import Fenced
from muster.coordinator.etcd.client import DEFAULT_PREFIX
from muster.coordinator.etcd.election import Election
from muster.coordinator.etcd.session import Session
from muster.coordinator.etcd.store import JobStore
from muster.coordinator.store import JobStorage
from muster.coordinator.memory import MemoryJobStore

pytestmark = pytest.mark.timeout(20)


class MemoryBackend:
    """The twin: terms handed out in order, as etcd's revisions."""

    def __init__(self) -> None:
        self.store: JobStorage = MemoryJobStore()
        self._terms = itertools.count(1)

    def lead(self, job: str) -> LeaderKey:
        return LeaderKey(job, next(self._terms), f"memory/{job}", "replica")

    def depose(self, leadership: LeaderKey) -> None:
        """Nothing to do: the next term's write fences this one."""

    def lose(self) -> None:
        self.store.lose_everything()

    def close(self) -> None:
        pass


class EtcdBackend:
    """etcd's JobStore, a leadership won by a real election on its own session."""

    def __init__(self, client) -> None:
        self.store: JobStorage = JobStore(client)
        self._client = client
        self._held: dict[LeaderKey, tuple[Session, Election]] = {}

    def lead(self, job: str) -> LeaderKey:
        session = Session(self._client, 2).start()
        election = Election(self._client, session, job, f"replica-{len(self._held)}")
        leadership = election.campaign(threading.Event())
        assert leadership is not None
        self._held[leadership] = (session, election)
        return leadership

    def depose(self, leadership: LeaderKey) -> None:
        self._held[leadership][1].resign()

    def lose(self) -> None:
        self._client.delete_prefix(f"{DEFAULT_PREFIX}/")

    def close(self) -> None:
        for session, _ in self._held.values():
            session.close()


@pytest.fixture(params=["memory", "etcd"])
def backend(request):
    made = MemoryBackend() if request.param == "memory" else EtcdBackend(request.getfixturevalue("etcd_client"))
    yield made
    made.close()


def test_a_spec_is_created_once_and_read_back(backend):
    store = backend.store
    assert store.get_spec("job") is None
    assert store.create_spec("job", b"first") == b"first"
    assert store.get_spec("job") == b"first"


def test_a_second_create_keeps_and_returns_the_first_spec(backend):
    store = backend.store
    store.create_spec("job", b"first")
    assert store.create_spec("job", b"second") == b"first"
    assert store.get_spec("job") == b"first"


def test_jobs_are_listed_by_name(backend):
    store = backend.store
    assert store.list_jobs() == []
    for job in ("b", "a", "c"):
        store.create_spec(job, b"spec")
    assert store.list_jobs() == ["a", "b", "c"]


def test_a_watch_sees_each_new_job_once_and_nothing_after_cancel(backend):
    store = backend.store
    store.create_spec("existing", b"1")
    seen: queue.Queue[str] = queue.Queue()
    cancel = store.watch_jobs(seen.put)
    try:
        store.create_spec("new", b"2")
        assert seen.get(timeout=5) == "new"
        store.create_spec("new", b"again")  # not a new job
        store.create_spec("newer", b"3")
        assert seen.get(timeout=5) == "newer"
    finally:
        cancel()
    store.create_spec("after-cancel", b"4")
    with pytest.raises(queue.Empty):
        seen.get(timeout=0.5)


def test_state_round_trips_and_each_write_has_a_later_revision(backend):
    store = backend.store
    leadership = backend.lead("job")
    assert store.load_state("job") is None
    first = store.write_state(leadership, b"v1")
    assert store.load_state("job") == b"v1"
    assert store.write_state(leadership, b"v2") > first
    assert store.load_state("job") == b"v2"


def test_a_write_restores_a_lost_spec_with_the_state(backend):
    store = backend.store
    store.write_state(backend.lead("job"), b"state", spec=b"spec")
    assert (store.get_spec("job"), store.load_state("job")) == (b"spec", b"state")


def test_a_write_by_a_term_that_is_over_is_fenced(backend):
    store = backend.store
    old = backend.lead("job")
    store.write_state(old, b"from-old")
    backend.depose(old)
    new = backend.lead("job")
    assert new.term > old.term
    store.write_state(new, b"from-new")
    with pytest.raises(Fenced, match=rf"'job'.*term {old.term}"):
        store.write_state(old, b"stale")
    assert store.load_state("job") == b"from-new"


def test_nothing_is_left_after_the_store_lost_its_data(backend):
    store = backend.store
    store.create_spec("job", b"spec")
    store.write_state(backend.lead("job"), b"state")
    backend.lose()
    assert (store.get_spec("job"), store.load_state("job"), store.list_jobs()) == (None, None, [])


def test_ending_a_run_keeps_its_record_and_removes_the_job(backend):
    store = backend.store
    removed = queue.Queue()
    cancel = store.watch_jobs(lambda job: None, removed.put)
    try:
        store.create_spec("job", b"spec")
        leader = backend.lead("job")
        store.write_state(leader, b"state")
        assert store.last_run("job") == 0
        store.end_run(leader, 1, b"record", b'{"outcome": "succeeded"}', retain_s=60)
        assert removed.get(timeout=5) == "job"
        assert (store.get_spec("job"), store.load_state("job"), store.list_jobs()) == (None, None, [])
        assert store.runs() == [("job", 1, b'{"outcome": "succeeded"}')] == store.runs("job")
        assert store.last_run("job") == 1 and store.load_run("job", 1) == b"record"
        with pytest.raises(Fenced):  # its term is over with it
            store.write_state(leader, b"stale")
        assert store.delete_runs("job", 2) == 0 and store.delete_runs("job") == 1
        assert store.runs() == [] and store.load_run("job", 1) is None
    finally:
        cancel()


def test_a_deposed_leader_cannot_end_the_run(backend):
    store = backend.store
    store.create_spec("job", b"spec")
    old = backend.lead("job")
    store.write_state(old, b"old")
    backend.depose(old)
    new = backend.lead("job")
    store.write_state(new, b"new")
    with pytest.raises(Fenced):
        store.end_run(old, 1, b"record", b"{}", retain_s=60)
    assert store.get_spec("job") == b"spec" and store.runs() == []
