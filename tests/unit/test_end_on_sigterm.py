"""A harness (a benchmark, `make bench-check`) ended by SIGTERM stops what it started, as after Ctrl-C:
its children run in sessions of their own, which the signal to its process group does not reach."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from muster.local import process_alive, wait_until

HARNESS = textwrap.dedent("""
    import subprocess, sys, time
    from muster.local import end_on_sigterm
    if sys.argv[1] == "on":
        end_on_sigterm()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        print(child.pid, flush=True)  # inside: a SIGTERM that comes at once finds the finally block set
        time.sleep(60)
    finally:
        child.kill()
        child.wait()
""")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("handled", [True, False], ids=["ended-on-sigterm", "python-default"])
def test_a_harness_ended_by_sigterm_stops_its_children(handled):
    harness = subprocess.Popen([sys.executable, "-c", HARNESS, "on" if handled else "off"], stdout=subprocess.PIPE,
                               text=True)
    child = int(harness.stdout.readline())
    try:
        harness.send_signal(signal.SIGTERM)
        assert harness.wait(10) == (128 + signal.SIGTERM if handled else -signal.SIGTERM)
        if handled:
            wait_until(lambda: not process_alive(child), 5, "the harness's child to be stopped")
        else:  # what end_on_sigterm is for: Python's default leaves it running
            assert process_alive(child)
    finally:
        if process_alive(child):
            os.kill(child, signal.SIGKILL)
        harness.stdout.close()
