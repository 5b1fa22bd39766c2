"""A healthy rank is never taken for silent: a C++ call holding the GIL for seconds (NCCL init or
abort, a long kernel) stops the rank's Python threads, not its process. The agent judges its ranks
by their process state, so nobody is evicted for it (a deadlock still shows as a stall)."""

import os
import signal
import sys
from pathlib import Path

import pytest

from muster.local import wait_until

SCRIPT = Path(__file__).parent / "scripts" / "gil_hold.py"
EVICTIONS_OTHER_THAN_THE_KILL = {"node_silent", "rank_silent", "rank_stalled", "rank_not_formed", "process_exited"}


@pytest.mark.timeout(180)
def test_a_three_second_gil_hold_in_forming_and_in_abort_evicts_nobody(coordinators, agents, monkeypatch):
    monkeypatch.setenv("GIL_HOLD_S", "3")
    monkeypatch.setenv("GIL_HOLD_AT", "form,abort")
    (leader,) = coordinators(1, extra=["--heartbeat-timeout", "2.0"])
    command = [sys.executable, str(SCRIPT), "--steps", str(10**6), "--step-sleep", "0.05"]
    a, b = agents([leader.address], "gil", ["a", "b"], command=command)
    wait_until(lambda: all(n.steps(s) and n.steps(s)[-1]["step"] >= 10 for n in (a, b) for s in (0, 1)), 90,
               "every rank past step 10")
    survivors = {(n.node_id, s): n.rank_pids(s)[-1] for n in (a, b) for s in (0, 1) if (n, s) != (b, 1)}
    top = max(n.steps(s)[-1]["step"] for n in (a, b) for s in (0, 1))
    os.kill(b.rank_pids(1)[-1], signal.SIGKILL)  # a reform: every survivor aborts and forms again
    wait_until(lambda: all(n.steps(s) and n.steps(s)[-1]["step"] >= top + 10 and n.steps(s)[-1]["world_size"] == 4
                           for n in (a, b) for s in (0, 1)), 120, "all four ranks stepping again, the replacement in")
    for n in (a, b):
        for s in (0, 1):
            if (n.node_id, s) in survivors:
                assert n.rank_pids(s)[-1] == survivors[(n.node_id, s)], f"{n.node_id}/{s} lost its process"
    evicted = [(r["kind"], r["reason"]) for r in leader.find("membership_changed")
               if r["kind"] in EVICTIONS_OTHER_THAN_THE_KILL]
    assert not evicted, evicted
