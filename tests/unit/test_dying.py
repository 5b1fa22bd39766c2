"""A rank's death is read from /proc as its exit begins, before the kernel has freed its memory
and it can be reaped (the agent reports a killed library rank then: supervisor._heard_dying)."""

import os
import signal
import subprocess
import sys
import time

import pytest

from muster.worker.agent.slot import StatFiles, dying_signal, process_state

HOLDER = "import sys, time; b = bytearray(256 << 20); print('held', flush=True); time.sleep(60); sys.exit(3)"


def holding():
    p = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


@pytest.mark.timeout(30)
def test_a_killed_process_is_read_dying_of_its_signal_before_it_is_reaped_and_a_running_one_is_not():
    p = holding()
    try:
        assert dying_signal(p.pid) == 0 and process_state(p.pid) in ("S", "R")
        os.kill(p.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while not dying_signal(p.pid) and time.monotonic() < deadline:
            time.sleep(0.001)
        assert dying_signal(p.pid) == signal.SIGKILL  # (not reaped: no wait() yet)
    finally:
        p.kill()
        p.wait(10)
    assert p.returncode == -signal.SIGKILL
    assert dying_signal(p.pid) == 0 and process_state(p.pid) is None  # reaped: no such process


@pytest.mark.timeout(30)
def test_a_process_that_exits_by_itself_is_not_read_as_killed():
    p = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    deadline = time.monotonic() + 10
    while process_state(p.pid) != "Z" and time.monotonic() < deadline:  # exited, not reaped
        time.sleep(0.005)
    assert process_state(p.pid) == "Z" and dying_signal(p.pid) == 0
    assert p.wait(10) == 3


@pytest.mark.timeout(30)
def test_the_stat_files_kept_open_read_their_own_process_and_stay_bounded():
    """A kept descriptor reads the process it was opened for: reaped, it reads as gone and is
    closed (the pid is opened anew, as a path read would); no more than KEEP stay open."""
    files = StatFiles()
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert files.read(p.pid).split(b" ", 1)[0] == str(p.pid).encode()
        kept = len(os.listdir("/proc/self/fd"))
        assert files.read(p.pid) is not None and len(os.listdir("/proc/self/fd")) == kept  # (no new descriptor)
    finally:
        p.kill()
        p.wait(10)
    assert files.read(p.pid) is None and p.pid not in files._fds
    files.KEEP = 2
    for pid in (os.getpid(), os.getppid(), 1):
        assert files.read(pid) is not None
    assert list(files._fds) == [os.getppid(), 1]
