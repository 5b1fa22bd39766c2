"""Training state lost beyond every tier under `muster run` (issue 55 items 3, 6): ZeRO-1 with peer
snapshots on 2 nodes x 2 slots (examples/train_sharded.py; a slot's snapshot is held on the other
node) and no checkpoint; a slot and its buddy are SIGKILLed together, so one shard exists nowhere.
By default the run ends failed saying so; with `--on-state-lost restart` the ranks begin again at step
0, and the events, the recovery (tier none, every step lost) and the outcome say so."""

import os
import signal
import sys
from pathlib import Path

import pytest

from muster.client import Coordinators
from muster.local import recovery_from, wait_until
from muster.v1 import muster_pb2 as pb

SCRIPT = str(Path(__file__).resolve().parents[2] / "examples" / "train_sharded.py")
STEPS, EVERY = 24, 4


def lose_a_shard(leader, agents, job: str, policy: list[str]):
    """Start the job, kill mesh slots 0 and 2 (each holds the other's snapshot) at once once every rank
    stepped past the first snapshot; the agents and the step every rank had reached."""
    run = {"nodes": "2:2", "extra": ["--world-size-multiple", "4", *policy],
           "command": [sys.executable, SCRIPT, "--zero", "--every", str(EVERY), "--steps", str(STEPS),
                       "--step-sleep", "0.1"]}
    nodes = agents([leader.address], job, ["a", "b"], **run)
    wait_until(lambda: all(n.steps(s) and n.steps(s)[-1]["step"] >= EVERY + 1 for n in nodes for s in (0, 1)),
               200, "every rank past the first snapshot")
    wait_until(lambda: all(n.rank_pids(s) for n in nodes for s in (0, 1)), 30, "the agents' word on their ranks' PIDs")
    reached = max(n.steps(s)[-1]["step"] for n in nodes for s in (0, 1))
    for n in nodes:
        for s in (0, 1):
            if n.steps(s)[-1]["slot"] in (0, 2):
                os.kill(n.rank_pids(s)[-1], signal.SIGKILL)
    return nodes, reached


def ended(leader, job: str) -> tuple[pb.JobStatus, list[pb.Event]]:
    with Coordinators([leader.address], timeout_s=5, retry_for_s=5) as c:
        return (c.call("Status", pb.StatusRequest(job=job)).jobs[0],
                list(c.call("Events", pb.EventsRequest(job=job)).events))


@pytest.mark.timeout(360)
def test_a_shard_lost_in_every_copy_ends_the_run_failed_saying_so(coordinators, agents):
    (leader,) = coordinators(1, extra=["--heartbeat-timeout", "2.0"])
    nodes, _ = lose_a_shard(leader, agents, "lost-fail", [])
    for n in nodes:
        assert n.wait(120) != 0
    status, events = ended(leader, "lost-fail")
    assert status.outcome == "failed" and status.outcome_reason.startswith("training state lost beyond every tier"), \
        status.outcome_reason
    assert "ShardLost" in status.outcome_reason and not [e for e in events if e.kind == "state_lost"]


@pytest.mark.timeout(420)
def test_on_state_lost_restart_begins_again_at_step_0_and_the_run_says_so(coordinators, agents):
    (leader,) = coordinators(1, extra=["--heartbeat-timeout", "2.0"])
    nodes, reached = lose_a_shard(leader, agents, "lost-restart", ["--on-state-lost", "restart"])
    begun = recovery_from(leader.address, "lost-restart", "none", 150)
    assert begun["step"] == 0 and reached <= begun["steps_lost"], (begun, reached)
    for n in nodes:
        assert n.wait(150) == 0, n.log_path.read_text()[-3000:]
    for n in nodes:
        for s in (0, 1):
            steps = [r["step"] for r in n.steps(s)]
            assert steps[0] == 1 and steps[-1] == STEPS, f"{n.node_id}/{s} began again at step 0: {steps[:3]}"
    status, events = ended(leader, "lost-restart")
    said = [e for e in events if e.kind == "state_lost"]  # one a generation that found it lost (slots return one by one)
    assert said and all("ShardLost" in e.reason and "begin again at step 0" in e.reason for e in said), said
    assert status.outcome == "succeeded" and "begun again from step 0" in status.outcome_reason, status.outcome_reason


@pytest.mark.timeout(300)
@pytest.mark.parametrize("policy", ["fail", "restart"])
def test_every_rank_of_a_replicated_job_lost_without_a_checkpoint_is_said_lost(coordinators, agents, policy):
    """examples/train_ddp.py (replicated, no checkpoint) on 2 nodes x 2 slots; every rank SIGKILLed at
    once, so no rank holds the state. The agents restart them and they form at step 0 from `build`:
    only the leader knows the job had trained. By default the run ends failed saying so; with
    `--on-state-lost restart` it trains again from step 0 and the events, recovery and outcome say so."""
    (leader,) = coordinators(1, extra=["--heartbeat-timeout", "2.0"])
    job = f"replicated-lost-{policy}"
    nodes = agents([leader.address], job, ["a", "b"], steps=STEPS * 4,
                   extra=["--on-state-lost", "restart"] if policy == "restart" else [])
    wait_until(lambda: all(n.steps(s) and n.steps(s)[-1]["step"] >= 10 for n in nodes for s in (0, 1)), 90,
               "every rank past step 10")
    wait_until(lambda: all(n.rank_pids(s) for n in nodes for s in (0, 1)), 30, "the agents' word on their ranks' PIDs")
    for n in nodes:
        for s in (0, 1):
            os.kill(n.rank_pids(s)[-1], signal.SIGKILL)
    reached = max(done[-1]["step"] for n in nodes for s in (0, 1) if (done := n.steps(s, start=0)))
    if policy == "fail":
        for n in nodes:
            assert n.wait(120) != 0, n.log_path.read_text()[-3000:]
        status, _ = ended(leader, job)
        assert status.outcome == "failed" and status.outcome_reason.startswith("training state lost beyond every tier"), \
            status.outcome_reason
        assert "began again at step 0 with nothing restored" in status.outcome_reason, status.outcome_reason
        assert "(the last one lost: " in status.outcome_reason and "killed by signal 9" in status.outcome_reason, \
            status.outcome_reason
        return
    begun = recovery_from(leader.address, job, "none", 120)
    # (the steps the leader had heard of when it decided: up to the last reported)
    assert begun["step"] == 0 and 10 <= begun["steps_lost"] + 2 and begun["steps_lost"] <= reached, (begun, reached)
    for n in nodes:
        assert n.wait(150) == 0, n.log_path.read_text()[-3000:]
        assert all(n.steps(s)[-1]["step"] == STEPS * 4 for s in (0, 1))
    # (the first ranks back began again at step 0; a node whose ranks came back later joined them)
    assert min(n.steps(s)[0]["step"] for n in nodes for s in (0, 1)) == 1
    status, events = ended(leader, job)
    said = [e for e in events if e.kind == "state_lost"]
    assert said and all("began again at step 0" in e.reason for e in said), said
    assert status.outcome == "succeeded" and "begun again from step 0" in status.outcome_reason, status.outcome_reason
