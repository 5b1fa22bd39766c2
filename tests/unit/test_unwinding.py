"""The abort thread names a training thread that has not let go of the aborted group."""

import threading

import pytest

from structlog.testing import capture_logs

from muster.worker.library import unwinding
from muster.worker.library.unwinding import Unwinding


def test_a_training_thread_that_left_the_group_is_not_named():
    u = Unwinding()
    u.began(3)
    with capture_logs() as logs:
        assert u.watch(3, aborted_by=4)
    assert logs == []


def test_the_watch_ends_when_the_training_thread_begins_to_leave():
    u = Unwinding()
    waiting = threading.Event()

    def abort_thread() -> None:
        waiting.set()
        results.append(u.watch(5, aborted_by=6))

    results: list[bool] = []
    t = threading.Thread(target=abort_thread)
    t.start()
    waiting.wait(5)
    u.began(5)
    t.join(5)
    assert results == [True]


def test_a_training_thread_elsewhere_is_named_with_where_it_is():
    u = Unwinding()
    release = threading.Event()

    def busy_in_the_script() -> None:
        u.training_thread = threading.get_ident()
        entered.set()
        release.wait(10)

    entered = threading.Event()
    t = threading.Thread(target=busy_in_the_script)
    t.start()
    try:
        entered.wait(5)
        with capture_logs() as logs:
            assert not u.watch(2, aborted_by=3)
    finally:
        release.set()
        t.join(5)
    [record] = logs
    assert record["event"] == "abort_not_yet_seen" and record["generation"] == 2 and record["aborted_by"] == 3
    assert any("busy_in_the_script" in frame for frame in record["training_thread_at"])


def stuck_rank(monkeypatch, steps: int, step_us: int, excused: bool = False):
    """An Unwinding whose training thread sits in a call until released, after `steps` steps of
    `step_us`; its stuck exit recorded rather than ending this process."""
    monkeypatch.setattr(unwinding, "UNWIND_LATE_S", 0.05)
    monkeypatch.setattr(unwinding, "UNWIND_EXIT_MIN_S", 0.3)
    exits: list[tuple[str, float]] = []
    u = Unwinding(excused=lambda: excused, on_stuck=lambda cause, waited_s: exits.append((cause, waited_s)))
    for _ in range(steps):
        u.stepped(step_us)
    release, entered = threading.Event(), threading.Event()

    def in_a_call_the_abort_missed() -> None:
        u.training_thread = threading.get_ident()
        entered.set()
        release.wait(10)

    t = threading.Thread(target=in_a_call_the_abort_missed)
    t.start()
    entered.wait(5)
    return u, exits, release, t


@pytest.mark.parametrize("steps", [2, 20])  # early in a job too (a partition at step 5 was met in CI)
def test_a_training_thread_still_in_the_aborted_group_after_a_few_of_its_steps_ends_the_process(monkeypatch, steps):
    u, exits, release, t = stuck_rank(monkeypatch, steps=steps, step_us=50_000)
    try:
        assert not u.watch(2, aborted_by=3)
    finally:
        release.set()
        t.join(5)
    [(cause, waited_s)] = exits
    assert waited_s == 0.3 and "has not left generation 2's group 0.3s after generation 3 aborted it" in cause
    assert "in_a_call_the_abort_missed" in cause


def test_the_bound_follows_the_longest_recent_step(monkeypatch):
    u, exits, release, t = stuck_rank(monkeypatch, steps=20, step_us=200_000)
    threading.Timer(0.4, u.began, args=(2,)).start()  # leaves after 0.4 s: within 3 steps of 0.2 s
    try:
        assert u.exit_after_s() > 0.55 and u.watch(2, aborted_by=3)
    finally:
        release.set()
        t.join(5)
    assert exits == []


def test_no_exit_before_enough_steps_nor_when_excused(monkeypatch):
    for steps, excused in ((1, False), (20, True)):  # only the first step measured; a long phase is declared
        u, exits, release, t = stuck_rank(monkeypatch, steps=steps, step_us=50_000, excused=excused)
        try:
            assert not u.watch(2, aborted_by=3)
        finally:
            release.set()
            t.join(5)
        assert exits == []
