"""The abort thread names a training thread that has not let go of the aborted group."""

import threading

from structlog.testing import capture_logs

from muster.worker.unwinding import Unwinding


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
