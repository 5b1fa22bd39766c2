"""A job ends once: a rank whose script completed and that then dies or hangs in interpreter
teardown (torch/gloo destructors under Hugging Face's Trainer) has finished. Nothing restarts it,
nothing re-forms the job, every agent exits 0 and the coordinator records one run, succeeded. An
operator's stop and drain end agents with the stopped code (3)."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from muster.client import Coordinators
from muster.local import record_time, wait_until
from muster.v1 import muster_pb2 as pb

SCRIPT = Path(__file__).parent / "scripts" / "teardown.py"
STEPS = 5


def steps_by_rank(out: Path) -> dict[int, list[tuple[int, int]]]:
    return {int(p.stem.split("-")[1]): [tuple(map(int, line.split())) for line in p.read_text().splitlines()]
            for p in out.glob("rank-*.steps")}


# How a job ends is what these jobs test, not how fast a silent node is found: a heartbeat timeout an
# agent starved by four ranks importing torch on a loaded 2-core host does not miss (FAST's 1 s
# evicted one in a fresh-clone run on a slow host: its slots then started twice).
TEARDOWN_TIMEOUTS = ["--heartbeat-timeout", "3.0"]


def run_job(coordinators, agents, tmp_path, job: str, teardown: str, warm: bool, exit_timeout_s: float = 30.0):
    (leader,) = coordinators(1, extra=TEARDOWN_TIMEOUTS)
    out = tmp_path / "steps"
    out.mkdir()
    command = [sys.executable, "-u", str(SCRIPT), "--steps", str(STEPS), "--out", str(out), "--teardown", teardown]
    extra = ["--exit-timeout", str(exit_timeout_s)] + ["--warm-start" if warm else "--no-warm-start"]
    nodes = agents([leader.address], job, ["a", "b"], nodes="2:2", command=command, extra=extra)
    for node in nodes:  # (bounded generously: four ranks importing torch on a loaded 2-core machine)
        try:
            code = node.wait(120)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"agent {node.node_id} still running after 120 s:\n"
                                 + node.log_path.read_text()[-3000:]) from None
        assert code == 0, node.log_path.read_text()[-3000:]
    # Every rank ran its steps exactly once, in one process; no slot was started twice.
    ranks = steps_by_rank(out)
    assert sorted(ranks) == [0, 1, 2, 3]
    for rank, lines in ranks.items():
        assert [s for s, _ in lines] == list(range(1, STEPS + 1)), f"rank {rank} ran {lines}"
        assert len({pid for _, pid in lines}) == 1
    for node in nodes:
        assert sorted(r["slot"] for r in node.records("rank_started")) == [0, 1]
        assert not node.records("rank_restart_scheduled")
    # the ranks named misbehave in teardown; a forked (warm) rank may also hang there on its own: each
    # is said, and none changes the outcome
    lines = [line for node in nodes for line in node.log_path.read_text().splitlines()
             if "finished its script, then" in line]
    said = {int(m[1]): line for line in lines if (m := re.match(r"muster run: rank (\d+) \(slot ", line))}
    misbehaving = {int(part.split("=")[0]) if "=" in part else 0 for part in teardown.split(",")}
    assert misbehaving <= set(said), lines
    # The coordinator recorded one run of the job, succeeded.
    (run,) = runs(leader.address, job)
    assert (run.run, run.outcome) == (1, "succeeded") and run.generation == 1, run
    return nodes, said


def runs(address: str, job: str) -> list[pb.JobRecord]:
    deadline = time.monotonic() + 10
    while True:
        with Coordinators([address], timeout_s=5, retry_for_s=5) as c:  # (UNAVAILABLE: an etcd blip under load)
            found = list(c.call("Jobs", pb.JobsRequest(job=job)).jobs)
        if found and all(r.outcome != "running" for r in found) or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "muster.cli", "--log-level", "warning", *args], capture_output=True,
                          text=True, timeout=30)


def stepping(nodes, at_least: int = 5) -> None:
    wait_until(lambda: all(n.steps(s) and n.steps(s)[-1]["step"] >= at_least for n in nodes for s in (0, 1)), 90,
               f"every rank past step {at_least}", interval_s=0.2)


@pytest.mark.timeout(150)
def test_an_operators_drain_and_stop_end_agents_with_the_stopped_code(coordinators, agents):
    (leader,) = coordinators(1)
    a, b, c = agents([leader.address], "ops", ["a", "b", "c"], nodes="1:3", steps=100_000)
    stepping([a, b, c])
    drained = cli("drain", "--coordinator", leader.address, "--job", "ops", "--node", "c", "--reason", "maintenance")
    assert drained.returncode == 0, drained.stderr
    assert c.wait(60) == 3, c.log_path.read_text()[-3000:]  # drained by an operator
    assert a.proc.poll() is None and b.proc.poll() is None
    stopped = cli("stop", "--coordinator", leader.address, "ops", "--reason", "end of the reservation")
    assert stopped.returncode == 0, stopped.stderr
    after = int(stopped.stdout.split("after step ")[1].split(",")[0])
    for n in (a, b):
        assert n.wait(60) == 3, n.log_path.read_text()[-3000:]
        for slot in (0, 1):  # every rank stopped at the one step of the stop, nothing aborted
            assert n.steps(slot)[-1]["step"] == after
    (run,) = runs(leader.address, "ops")
    assert (run.outcome, run.reason) == ("stopped", "end of the reservation")
    assert "stopped by an operator" in a.log_path.read_text()


@pytest.mark.timeout(150)
def test_a_drained_node_whose_ranks_are_slow_to_exit_still_ends_with_the_stopped_code(coordinators, agents):
    # Its ranks linger 8 s in teardown (a loaded machine took 7 s to end a torch process); meanwhile
    # the leader dies and the node, reconnecting, hears that it is no member: it left as ordered.
    replicas = coordinators(2)
    command = [sys.executable, "-u", str(SCRIPT.with_name("slow_exit.py")), "8", "--steps", "100000",
               "--step-sleep", "0.05"]
    a, b = agents([r.address for r in replicas], "linger", ["a", "b"], nodes="1:2", command=command)
    stepping([a, b])
    (leader,) = [r for r in replicas if r.leads("linger")]
    drained = cli("drain", "--coordinator", leader.address, "--job", "linger", "--node", "b")
    assert drained.returncode == 0, drained.stderr
    wait_until(lambda: len(b.records("rank_completed")) == 2, 30, "b's ranks through their last step")
    leader.kill()
    assert b.wait(60) == 3, b.log_path.read_text()[-3000:]
    assert b.records("drain_left") and not b.records("node_evicted")
    assert a.proc.poll() is None


ABORTED = "then died in interpreter teardown (killed by SIGABRT): counted as finished"
HUNG = "hung in interpreter teardown, ended after --exit-timeout 3s (killed by SIGTERM)"


def ended_after_the_exit_timeout(nodes, rank: int, exit_timeout_s: float = 3) -> None:
    """`rank`'s node ended it (on a loaded machine another rank's slow teardown may pass 3 s too: the
    same path) within --exit-timeout and a few seconds of its script's end."""
    (node,) = [n for n in nodes if any(r["rank"] == rank for r in n.records("rank_completed"))]
    assert node.records("rank_exit_timeout")
    completed = record_time(next(r for r in node.records("rank_completed") if r["rank"] == rank))
    stopped = record_time(node.records("agent_stopped")[-1])
    assert exit_timeout_s <= stopped - completed < exit_timeout_s + 5, "ended within --exit-timeout and a few seconds"


@pytest.mark.timeout(180)
def test_a_rank_aborting_in_teardown_after_its_script_completed_is_finished_not_restarted(
        coordinators, agents, tmp_path):
    _, said = run_job(coordinators, agents, tmp_path, "abort", "abort", warm=True)
    assert said[0].endswith(ABORTED)


@pytest.mark.timeout(180)
def test_a_rank_hanging_in_teardown_is_ended_after_the_exit_timeout_and_counted_finished(
        coordinators, agents, tmp_path):
    nodes, said = run_job(coordinators, agents, tmp_path, "hang", "hang", warm=True, exit_timeout_s=3)
    assert HUNG in said[0]
    ended_after_the_exit_timeout(nodes, 0)


@pytest.mark.timeout(180)
def test_cold_ranks_aborting_and_hanging_in_teardown_are_finished_as_forked_ones_are(coordinators, agents, tmp_path):
    """Started as `python SCRIPT` (--no-warm-start), each rank ends in the interpreter's own teardown,
    not `runner.end_forked`'s: rank 0 (node a) aborts there, rank 2 (node b) hangs there, and both
    count as finished. (One job for both: its four cold ranks import torch, ~30 s of CPU here.) A cold
    teardown frees all of torch before rank 0's abort: on a host at half speed (fresh-clone run Z)
    even well-behaved ranks took over 3 s, so these wait 10 s before they count as hung."""
    nodes, said = run_job(coordinators, agents, tmp_path, "cold", "0=abort,2=hang", warm=False, exit_timeout_s=10)
    assert said[0].endswith(ABORTED) and HUNG.replace(" 3s ", " 10s ") in said[2], said
    ended_after_the_exit_timeout(nodes, 2, exit_timeout_s=10)


@pytest.mark.timeout(180)
def test_a_rank_frozen_after_destroying_its_group_is_ended_after_the_exit_timeout_and_counted_finished(
        coordinators, agents, tmp_path):
    # Frozen before its script returns, so the runner never marks it completed: what the agent knows is
    # that the script destroyed its process group and then ran no Python (gloo's teardown deadlock, met
    # by warm ranks; the agent's side is the same for cold ones).
    nodes, said = run_job(coordinators, agents, tmp_path, "freeze", "freeze", True, exit_timeout_s=3)
    assert said[0].endswith("then hung (no Python ran for --exit-timeout 3s after its destroy_process_group()), "
                            "ended (killed by SIGTERM): counted as finished"), said
    (node,) = [n for n in nodes if n.records("rank_frozen_after_its_work")]
    (frozen,) = node.records("rank_frozen_after_its_work")
    assert frozen["rank"] == 0


@pytest.mark.timeout(240)
def test_a_node_joining_as_the_job_finishes_does_not_hold_the_run(coordinators, agents, tmp_path):
    """Issue 55: a node placed by a planned switch after the job's last step waited out the library's
    300 s hold, then failed the run. Its ranks never trained: the run ends succeeded without them."""
    (leader,) = coordinators(1)
    release, steps = tmp_path / "release", 20
    command = [sys.executable, "-u", str(SCRIPT.with_name("repeat_fault.py")), "--steps", str(steps),
               "--wait-before-last", str(release)]
    run = {"slots": 1, "nodes": "2:3", "command": command}
    first = agents([leader.address], "late", ["a", "b"], **run)
    wait_until(lambda: all(n.rank_records(0, "waiting_before_last_step") for n in first), 120,
               "every rank before its last step", interval_s=0.2)
    (late,) = agents([leader.address], "late", ["c"], **run)
    placed = lambda: [r for r in late.rank_records(0, "assignment_received") if r["role"] == "ROLE_ACTIVE"]  # noqa: E731
    wait_until(placed, 120, "the late node placed", interval_s=0.2)
    assert placed()[0]["switch_at_step"] > steps, placed()  # the switch is past the job's last step
    release.touch()
    for node in [*first, late]:  # (the hold would be 300 s)
        try:
            code = node.wait(90)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"agent {node.node_id} still running:\n" + node.log_path.read_text()[-3000:]) from None
        assert code == 0, node.log_path.read_text()[-3000:]
    (run,) = runs(leader.address, "late")
    assert run.outcome == "succeeded", run
    assert "node(s) 'c' placed at generation" in run.reason and "never trained" in run.reason, run.reason


@pytest.mark.timeout(240)
def test_a_replacement_without_a_place_as_the_job_finishes_does_not_hold_the_run(coordinators, agents, tmp_path):
    """A rank killed before the last step: its survivors re-form without it and complete the job, while
    its replacement waits for a place (the leader places it only once they have re-formed, at a switch
    after the step they are at). Before: it held --hold-timeout (300 s), then exited 3 and the run
    ended failed. Its agent now ends it as the job finishes, and the run succeeds."""
    (leader,) = coordinators(1, extra=TEARDOWN_TIMEOUTS)
    release, steps = tmp_path / "release", 20
    command = [sys.executable, "-u", str(SCRIPT.with_name("repeat_fault.py")), "--steps", str(steps),
               "--wait-before-last", str(release)]
    a, b = agents([leader.address], "outrun", ["a", "b"], nodes="2:2", command=command)
    wait_until(lambda: all(n.rank_records(s, "waiting_before_last_step") for n in (a, b) for s in (0, 1)), 120,
               "every rank before its last step", interval_s=0.2)
    (victim,) = b.rank_pids(0)
    os.kill(victim, signal.SIGKILL)
    wait_until(lambda: len(b.rank_logs(0)) == 2 and b.rank_records(0, "assignment_received"), 60,
               "the replacement connected, with no place yet", interval_s=0.2)
    release.touch()
    for node in (a, b):  # (the hold would be 300 s)
        try:
            code = node.wait(90)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"agent {node.node_id} still running:\n" + node.log_path.read_text()[-3000:]) from None
        assert code == 0, node.log_path.read_text()[-3000:]
    (outrun,) = b.records("rank_outrun")
    assert outrun["slot"] == 0 and outrun["pid"] == b.rank_pids(0)[-1] != victim
    (run,) = runs(leader.address, "outrun")
    assert run.outcome == "succeeded", run
    # (the survivors' map, or one placing the replacement at a switch they never reached)
    assert "every rank of generation 2 completed its script (world size 3)" == run.reason or (
        "switch after step" in run.reason and "placed anew never trained" in run.reason), run.reason
    finished = [r["reason"] for r in leader.find("membership_changed", kind="node_finished")]
    assert any("replacement with no place yet as the job finished (slot(s) 0)" in r for r in finished), finished
