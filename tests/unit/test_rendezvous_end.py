"""The torchrun backend once the job ends, against a fake link: no new round, whatever asks for
one; torchrun ends with the outcome's status (SystemExit, which torch's launcher lets through)."""

import threading
from types import SimpleNamespace

import pytest

from muster.v1 import muster_pb2 as pb
from muster.worker.outcome import EXIT_FAILED, EXIT_STOPPED, EXIT_SUCCEEDED
from muster.worker.torchrun.rendezvous import MusterRendezvousHandler


def handler(*, finishing=False, ended=None, rounds=1, generation=3, latest=3):
    h = MusterRendezvousHandler.__new__(MusterRendezvousHandler)  # no coordinator, no store
    session = SimpleNamespace(finishing=finishing, exits=[], sent=[])
    h._link = SimpleNamespace(session=session, ended=ended, changed=threading.Event(),
                              send_now=lambda: (session.sent.extend(session.exits), session.exits.clear()),
                              latest=pb.Assignment(generation=latest, role=pb.ROLE_ACTIVE))
    h._job, h._closed, h._rounds, h._generation, h._workers_ended = "j", False, rounds, generation, False
    h._rejoin_after_s = h._join_timeout_s = 5.0
    return h


def ends_with(h) -> int:
    with pytest.raises(SystemExit) as raised:
        h.next_rendezvous()
    return raised.value.code


def test_workers_failing_once_the_job_is_finishing_end_torchrun_with_1_and_the_leader_hears_it():
    h = handler(finishing=True)
    assert h.num_nodes_waiting() == 0  # a newer map does not restart finishing workers
    assert ends_with(h) == EXIT_FAILED
    assert [(e.local_rank, e.exit_code, e.restarting) for e in h._link.session.sent] == [(0, EXIT_FAILED, False)]
    assert ends_with(handler(finishing=True, rounds=0)) == EXIT_SUCCEEDED  # never started: nothing failed


@pytest.mark.parametrize("outcome, code", [("succeeded", EXIT_SUCCEEDED), ("stopped", EXIT_STOPPED),
                                           ("failed", EXIT_FAILED)])
def test_the_end_of_the_run_stops_the_workers_and_ends_torchrun_with_its_outcome(outcome, code):
    h = handler(ended=pb.JobEnd(outcome=outcome, run=1))
    assert h.num_nodes_waiting() == 1  # torchrun stops its workers and asks for a round...
    assert ends_with(h) == code  # ...which ends it
    assert h._link.session.sent == []


def test_a_node_waiting_for_its_place_stops_waiting_when_the_job_starts_finishing():
    h = handler(rounds=0, generation=3, latest=3)  # no newer map: it waits for one
    threading.Timer(0.2, lambda: (setattr(h._link.session, "finishing", True), h._link.changed.set())).start()
    assert ends_with(h) == EXIT_SUCCEEDED
