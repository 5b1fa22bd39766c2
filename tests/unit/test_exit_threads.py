"""A script that exits while the library's threads are busy ends with its own exit code.

CI saw a rank fenced out while its group formed die of SIGABRT ("terminate called without an active
exception") instead of exiting 3: the state's fingerprint, begun on a daemon thread at the reform's
start, was still inside torch when the interpreter finalized, and Python 3.11 ends such a thread with
pthread_exit, whose unwind through torch's noexcept code is std::terminate (6 exits in 10 before).
"""

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import sys, torch
    from muster.worker.library.state import ReplicatedState
    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(3000)))  # many small tensors: long in torch
    ReplicatedState(model, None, {}).card_ahead(1, torch.device("cpu"))
    sys.exit(3)
""")


@pytest.mark.timeout(120)
def test_a_script_exiting_during_card_ahead_exits_with_its_code():
    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
        assert done.returncode == 3, done.stderr[-2000:]
