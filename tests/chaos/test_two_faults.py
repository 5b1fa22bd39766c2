"""Chaos: two faults at once. A rank and the coordinator leader are SIGKILLed together, so the
rank's exit report dies with the leader; the new leader learns of the exit from the agent's
frames (the slot reported exited) during its grace period, and training goes on."""

import os
import signal

import pytest

from muster.testing import wait_until

STEPS = 300


@pytest.mark.timeout(180)
def test_a_rank_and_the_leader_killed_together(coordinators, agents):
    replicas = coordinators(2, extra=["--heartbeat-timeout", "2.0"])
    a, b = agents([r.address for r in replicas], "twofaults", ["a", "b"], steps=STEPS)
    wait_until(lambda: all(n.steps(s) and n.steps(s)[-1]["step"] > 20 and n.steps(s)[-1]["world_size"] == 4
                           for n in (a, b) for s in (0, 1)), 90, "both nodes training together")
    leader = next(r for r in replicas if r.find("leadership_acquired", job="twofaults"))
    standby = next(r for r in replicas if r is not leader)
    generation = b.steps(0)[-1]["generation"]
    victim = b.rank_pids(0)[-1]
    os.kill(victim, signal.SIGKILL)
    leader.kill()
    wait_until(lambda: any(r["world_size"] == 3 and r["generation"] > generation for r in a.steps(0)), 30,
               "survivors training without the killed rank")
    for n in (a, b):
        assert n.wait(120) == 0, n.log_path.read_text()[-3000:]
    for n, slot in ((a, 0), (a, 1), (b, 1)):
        steps = [r["step"] for r in n.steps(slot)]
        assert steps[-1] == STEPS and steps == list(range(steps[0], steps[0] + len(steps)))
    assert b.steps(0)[-1]["step"] == STEPS  # the replacement rejoined and finished
    kinds = [r["kind"] for r in standby.find("membership_changed")]
    assert "rank_exited" in kinds and "node_silent" not in kinds
