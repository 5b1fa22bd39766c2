"""Ctrl-C ends a live view (status --watch, events/logs --follow) within a bound, even when its main
thread does not get back to Python to end it: here the exit itself waits on a thread that never ends."""

import signal
import subprocess
import sys
import time

import pytest

from muster.cli import INTERRUPT_GRACE_S

pytestmark = pytest.mark.timeout(30)

STUCK_AFTER_CTRL_C = """
import threading, time
from muster.cli import _ended_by_ctrl_c
_ended_by_ctrl_c()
threading.Thread(target=time.sleep, args=(60,)).start()  # not a daemon: the interpreter's exit waits for it
print("ready", flush=True)
try:
    time.sleep(60)
except KeyboardInterrupt:
    pass
"""


def test_ctrl_c_ends_a_view_within_the_grace_whatever_holds_its_exit():
    proc = subprocess.Popen([sys.executable, "-c", STUCK_AFTER_CTRL_C], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout.readline() == b"ready\n"
        began = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(INTERRUPT_GRACE_S + 5) == 0
        assert INTERRUPT_GRACE_S - 0.5 < time.monotonic() - began < INTERRUPT_GRACE_S + 5
        assert b"Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
