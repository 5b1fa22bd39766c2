"""A SIGKILLed agent cannot remove its socket directory: the next agent on the host does."""

import os
import subprocess
import sys
import tempfile

from muster.worker.agent.agent import SOCKET_DIR_PREFIX, _remove_stale_socket_dirs


def test_socket_dirs_of_dead_agents_are_removed_and_live_ones_kept():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    stale = tempfile.mkdtemp(prefix=f"{SOCKET_DIR_PREFIX}{dead}-")
    open(os.path.join(stale, "ranks.sock"), "w").close()
    live = tempfile.mkdtemp(prefix=f"{SOCKET_DIR_PREFIX}{os.getpid()}-")
    try:
        _remove_stale_socket_dirs()
        assert not os.path.exists(stale)
        assert os.path.isdir(live)
    finally:
        os.rmdir(live)
