"""A rank waiting for a place in a newer generation says what it waits for, and gives up at its
bounds with the reason (a rank that 'stopped silently' after reform_failed was waiting here)."""

import threading
import time
from types import SimpleNamespace

import pytest
import torch
from structlog.testing import capture_logs

from muster.v1 import muster_pb2 as pb
from muster.worker.library.reform import Progress, Reform, give_up_waiting, report_waiting
from muster.worker.errors import CoordinatorLost, HoldExpired


def link(silent_s: float, generation: int | None = 7):
    latest = pb.Assignment(generation=generation) if generation is not None else None
    return SimpleNamespace(latest=latest, silent_s=lambda: silent_s)


def test_a_waiting_rank_says_what_it_waits_for():
    now = time.monotonic()
    with capture_logs() as logs:
        report_waiting(link(1.5), 300, 7, "forming generation 7 failed: Connection reset", now - 12, now + 288)
        report_waiting(link(0.2, None), 300, 0, "", now - 10, now + 290)
    holding, joining = logs
    assert holding["event"] == "rank_waiting" and holding["after_generation"] == 7
    assert holding["cause"].startswith("forming generation 7 failed") and holding["waited_s"] >= 12
    assert holding["latest_generation"] == 7 and holding["coordinator_silent_s"] == 1.5
    assert 287 <= holding["gives_up_in_s"] <= 288
    assert joining["cause"] == "no place for this rank yet" and joining["gives_up_in_s"] == 299.8
    assert joining["gives_up_if"].startswith("the coordinator stays silent")
    assert joining["latest_generation"] is None


def test_a_holding_rank_gives_up_at_its_deadline_and_a_waiting_one_when_the_coordinator_is_silent():
    now = time.monotonic()
    give_up_waiting(link(500), 300, 7, "a collective failed", now + 10)  # holding: the deadline rules, not silence
    with pytest.raises(HoldExpired, match="held 300s for a new generation after a collective failed"):
        give_up_waiting(link(1), 300, 7, "a collective failed", now - 1)
    give_up_waiting(link(299), 300, 7, "", now - 1)  # not holding: the coordinator's silence rules
    with pytest.raises(CoordinatorLost, match="no word from the coordinator for 301s"):
        give_up_waiting(link(301), 300, 7, "", now + 100)


def test_a_wait_the_workers_error_or_a_drain_ends_returns_to_the_worker_to_raise_it():
    """The plan raises nothing of the worker's: it stops (None), and the worker raises why."""
    failed = []  # the worker's error, once it has one
    mailbox = SimpleNamespace(latest=pb.Assignment(generation=2), base=None, drain_after=5,
                              changed=threading.Event(), silent_s=lambda: 0.0)
    plan = Reform(None, mailbox, None, Progress(), slot=0, local_rank=0, device=torch.device("cpu"),
                  hold_timeout_s=300, failed=lambda: bool(failed), let_go=lambda: None)
    assert plan.wait_for_place(2, "", time.monotonic() + 60, step=5) is None  # drained past step 5
    mailbox.drain_after = None
    failed.append("the link failed")
    assert plan.wait_for_place(2, "", time.monotonic() + 60, step=5) is None
