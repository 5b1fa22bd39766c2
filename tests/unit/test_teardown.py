"""The background teardown of aborted groups (src/muster/worker/library/teardown.py), with stand-in groups whose
abort and shutdown the test holds and releases: the order of its steps, one abort per group, its
bound, and no thread left per teardown. No timings: every wait is an event, bounded."""

import threading

import pytest

from muster.worker.library.teardown import Teardown

WAIT_S = 10.0  # a bound on every wait below, never a measurement


class Group:
    def __init__(self, log: list[str], name: str):
        self.log, self.name = log, name

    def shutdown(self) -> None:
        self.log.append(f"shutdown {self.name}")


class Backend:
    """The backend's abort of a generation's groups, held at `gate` (NCCL's join) until the test opens it."""

    def __init__(self):
        self.log: list[str] = []
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.stuck: list[str] = []

    def abort(self, groups: list[Group]) -> None:
        self.log.extend(f"abort {g.name}" for g in groups)
        self.entered.set()
        assert self.gate.wait(WAIT_S)


def teardown(backend: Backend, exit_s: float = 60.0) -> Teardown:
    return Teardown(backend.abort, lambda cause, waited_s: backend.stuck.append(cause), exit_s=exit_s)


@pytest.mark.timeout(30)
def test_the_submitter_waits_for_nothing_and_shutdown_follows_the_abort_and_the_release():
    b = Backend()
    t = teardown(b)
    a = Group(b.log, "a")
    t.submit(1, [a])  # returns while the abort is held
    assert b.entered.wait(WAIT_S) and not t.idle(0)
    t.release()  # the training thread let go: still no shutdown before the abort is done
    assert b.log == ["abort a"]
    b.gate.set()
    assert t.idle(WAIT_S)
    assert b.log == ["abort a", "shutdown a"]


@pytest.mark.timeout(30)
def test_an_aborted_group_waits_for_the_training_thread_before_its_shutdown():
    b = Backend()
    b.gate.set()
    t = teardown(b)
    t.submit(1, [Group(b.log, "a")])
    assert not t.idle(0.2)  # aborted, not released: held (its threads may still be the training thread's)
    assert b.log == ["abort a"]
    t.release()
    assert t.idle(WAIT_S) and b.log == ["abort a", "shutdown a"]


@pytest.mark.timeout(30)
def test_no_group_is_aborted_twice_and_generations_go_in_order():
    b = Backend()
    t = teardown(b)
    a, c = Group(b.log, "a"), Group(b.log, "c")
    t.submit(1, [a])
    assert b.entered.wait(WAIT_S)
    t.submit(1, [a])  # a second abort of the same group (two threads aborting one generation)
    t.submit(2, [a, c])
    b.gate.set()
    t.release()
    assert t.idle(WAIT_S)
    assert b.log.count("abort a") == 1 and b.log.count("shutdown a") == 1
    assert b.log.index("abort a") < b.log.index("abort c")


@pytest.mark.timeout(30)
def test_a_release_covers_the_groups_submitted_before_it_only():
    b = Backend()
    b.gate.set()
    t = teardown(b)
    t.submit(1, [Group(b.log, "a")])
    t.release()
    assert t.idle(WAIT_S)
    t.submit(2, [Group(b.log, "c")])  # the next generation's, which the training thread still holds
    assert not t.idle(0.2) and "shutdown c" not in b.log
    t.release()
    assert t.idle(WAIT_S) and b.log[-1] == "shutdown c"


@pytest.mark.timeout(30)
def test_an_abort_that_does_not_return_is_bounded():
    b = Backend()
    t = teardown(b, exit_s=0.05)
    t.submit(7, [Group(b.log, "a")])
    assert b.entered.wait(WAIT_S)
    done = threading.Event()
    threading.Thread(target=lambda: (t.idle(WAIT_S), done.set()), daemon=True).start()
    assert not done.wait(0.5)  # still in the abort
    b.gate.set()
    t.release()
    assert done.wait(WAIT_S)
    assert b.stuck == ["the abort of generation 7's aborted group"]  # in production: the process exits


@pytest.mark.timeout(30)
def test_a_failed_abort_still_ends_in_a_shutdown():
    log: list[str] = []

    def abort(groups):
        raise RuntimeError("NCCL error: invalid usage")

    t = Teardown(abort, lambda cause, waited_s: None)
    t.submit(1, [Group(log, "a")])
    t.release()
    assert t.idle(WAIT_S) and log == ["shutdown a"]


@pytest.mark.timeout(60)
def test_a_hundred_teardowns_leave_one_thread():
    b = Backend()
    b.gate.set()
    t = teardown(b)
    before = set(threading.enumerate())  # (the worker's other threads come and go: only new ones count)
    for generation in range(1, 101):
        t.submit(generation, [Group(b.log, str(generation))])
        t.release()
    assert t.idle(WAIT_S)
    made = set(threading.enumerate()) - before
    assert len(made) == 1, made  # the teardown's own thread, and no watch left behind
    assert b.log.count("abort 100") == 1 and len(b.log) == 200


@pytest.mark.timeout(60)
def test_a_process_that_exits_first_ends_its_pending_teardowns():
    """A rank that finishes its script while a group's abort runs: the exit waits for the abort and
    the shutdown (a daemon thread inside ncclCommAbort during CUDA's shutdown was std::terminate)."""
    import subprocess
    import sys

    script = (
        "import time\n"
        "from muster.worker.library.teardown import Teardown\n"
        "class G:\n"
        "    def shutdown(self): print('shutdown', flush=True)\n"
        "t = Teardown(lambda groups: (time.sleep(0.5), print('aborted', flush=True)), lambda *a: None)\n"
        "t.submit(1, [G()])\n"
        "print('exiting', flush=True)\n"  # no release: the training thread never let go
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=45)
    said = [line for line in out.stdout.splitlines() if line in ("exiting", "aborted", "shutdown")]
    assert out.returncode == 0 and said == ["exiting", "aborted", "shutdown"], out
