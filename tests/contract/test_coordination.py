"""The contract of sessions and elections (`muster.coordinator.coordination.Coordination`), held
against the in-memory twin and against etcd: what the in-process replica tests assume of the twin
(the lowest term leads, a lost or closed session takes its keys along, resigning hands over) is what
etcd does. Every wait is bounded; sessions are closed and the etcd is stopped by the fixtures."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from muster.coordinator.coordination import Coordination
from muster.coordinator.etcd.client import DEFAULT_PREFIX
from muster.coordinator.etcd.election import EtcdCoordination
from muster.coordinator.memory import MemoryCoordination
from muster.local import wait_until

pytestmark = pytest.mark.timeout(20)


class MemoryBackend:
    def __init__(self) -> None:
        self.coordination: Coordination = MemoryCoordination()

    def expire(self, session) -> None:
        self.coordination.expire(session)

    def candidates(self, job: str) -> int:
        return self.coordination.candidates(job)


class EtcdBackend:
    def __init__(self, client) -> None:
        self.coordination: Coordination = EtcdCoordination(client)
        self._client = client

    def expire(self, session) -> None:
        """Revoked behind the session's back, as a lease etcd let lapse: its renew thread finds out."""
        self._client.revoke_lease(session.lease_id)

    def candidates(self, job: str) -> int:
        """The election keys of `job`: one a candidate, written as it begins to campaign."""
        return len(list(self._client.get_prefix(f"{DEFAULT_PREFIX}/election/{job}/", keys_only=True)))


@pytest.fixture(params=["memory", "etcd"])
def backend(request):
    return MemoryBackend() if request.param == "memory" else EtcdBackend(request.getfixturevalue("etcd_client"))


@pytest.fixture
def sessions(backend):
    """Start sessions on the backend (TTL 2 s); each is closed afterwards."""
    started = []

    def start():
        started.append(backend.coordination.session(2).start())
        return started[-1]

    yield start
    for s in started:
        s.close()


@pytest.fixture
def pool():
    with ThreadPoolExecutor(4) as executor:
        yield executor


def campaign(pool, election, stop: threading.Event | None = None):
    return pool.submit(election.campaign, stop or threading.Event())


def test_nobody_leads_a_job_nobody_campaigns_for(backend):
    assert backend.coordination.current_leader("job") is None


def test_the_first_candidate_leads_and_is_named_with_its_term(backend, sessions, pool):
    c = backend.coordination
    key = campaign(pool, c.election(sessions(), "job", "a")).result(5)
    assert (key.job, key.address) == ("job", "a") and key.term > 0
    assert c.current_leader("job") == ("a", key.term)


def test_a_second_candidate_waits_until_the_leader_resigns_then_leads_with_a_later_term(backend, sessions, pool):
    c = backend.coordination
    first = c.election(sessions(), "job", "a")
    led = campaign(pool, first).result(5)
    waiting = campaign(pool, c.election(sessions(), "job", "b"))
    wait_until(lambda: backend.candidates("job") == 2, 5, "the second candidate's key written")  # it campaigns
    assert not waiting.done() and c.current_leader("job") == ("a", led.term)
    assert first.resign()
    second = waiting.result(5)
    assert second.address == "b" and second.term > led.term
    assert c.current_leader("job") == ("b", second.term)
    assert not first.resign()  # nothing held any more


def test_a_lost_session_tells_its_listener_and_takes_its_keys_so_the_standby_leads(backend, sessions, pool):
    c = backend.coordination
    leader_session = sessions()
    lost = threading.Event()
    leader_session.add_listener(lost.set)
    led = campaign(pool, c.election(leader_session, "job", "a")).result(5)
    waiting = campaign(pool, c.election(sessions(), "job", "b"))
    backend.expire(leader_session)
    assert lost.wait(5) and not leader_session.alive() and leader_session.lost_reason == "lease_expired"
    second = waiting.result(5)
    assert second.address == "b" and second.term > led.term
    heard_late = threading.Event()
    leader_session.add_listener(heard_late.set)  # already lost: told at once
    assert heard_late.is_set()


def test_a_closed_session_hands_over_at_once_and_is_no_loss(backend, sessions, pool):
    c = backend.coordination
    leader_session = sessions()
    lost = threading.Event()
    leader_session.add_listener(lost.set)
    campaign(pool, c.election(leader_session, "job", "a")).result(5)
    waiting = campaign(pool, c.election(sessions(), "job", "b"))
    leader_session.close(revoke=True)
    assert waiting.result(5).address == "b"
    assert not leader_session.alive() and not lost.is_set()


def test_a_stopped_campaign_returns_none(backend, sessions, pool):
    c = backend.coordination
    campaign(pool, c.election(sessions(), "job", "a")).result(5)
    stop = threading.Event()
    waiting = campaign(pool, c.election(sessions(), "job", "b"), stop)
    stop.set()
    assert waiting.result(5) is None


def test_elections_of_different_jobs_do_not_wait_on_each_other(backend, sessions, pool):
    c = backend.coordination
    session = sessions()
    a = campaign(pool, c.election(session, "one", "a")).result(5)
    b = campaign(pool, c.election(sessions(), "two", "b")).result(5)
    assert (c.current_leader("one"), c.current_leader("two")) == (("a", a.term), ("b", b.term))


def test_a_watch_of_a_jobs_elections_hears_each_change_of_its_candidates_and_nothing_after_cancel(
        backend, sessions, pool):
    c = backend.coordination
    heard, other = threading.Semaphore(0), threading.Event()
    cancel = c.watch_elections("job", heard.release)
    cancel_other = c.watch_elections("other", other.set)
    first = c.election(sessions(), "job", "a")
    campaign(pool, first).result(5)
    assert heard.acquire(timeout=5), "a candidate's key written"
    waiting = campaign(pool, c.election(sessions(), "job", "b"))
    assert heard.acquire(timeout=5), "a second candidate"
    first.resign()
    assert heard.acquire(timeout=5), "the leader resigned"
    assert waiting.result(5).address == "b"
    cancel()
    while heard.acquire(timeout=0.3):  # (what was told before the cancel)
        pass
    stop = threading.Event()
    campaign(pool, c.election(sessions(), "job", "c"), stop)
    wait_until(lambda: backend.candidates("job") == 2, 5, "a third candidate's key written after the cancel")
    stop.set()
    assert not heard.acquire(timeout=0.5) and not other.is_set()
    cancel_other()
