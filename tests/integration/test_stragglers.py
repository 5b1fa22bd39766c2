"""Stragglers on real processes: ranks of examples/train_ddp.py on gloo, a real coordinator and
etcd, one rank slowed from outside (SIGSTOP/SIGCONT on a duty cycle: `Throttle`). Its compute
(the simulated 50 ms of work, forward and backward) stretches while the others wait for it in the
all-reduce; the leader names it, and under `replace` a hot spare takes its node's place at a
planned step. The simulated work sleeps in 2 ms slices, so a throttle stretches it as it would
real work: stopped 60% of every 50 ms, ~2.4x the healthy ranks' ~65 ms here (a period longer than
a step would phase-lock the job to the throttle and put the stops in the all-reduce instead)."""

import sys
from pathlib import Path

import grpc
import pytest

from muster.client import Coordinators
from muster.local import Throttle, wait_until
from muster.v1 import muster_pb2 as pb

FAST_STRAGGLERS = ["--heartbeat-timeout", "2.0", "--straggler-min-steps", "10"]
PLAIN = Path(__file__).resolve().parents[2] / "examples" / "train_plain.py"  # no Muster code in it


def node_of(p) -> str:
    return wait_until(lambda: p.records("node_joined"), 30, "the rank's node_joined record")[0]["node"]


def ranks_status(address: str, job: str) -> list[pb.RankStatus] | None:
    """The job's ranks; None while it is not created yet or its leader not (re-)elected (the one
    replica's etcd session can lapse on a loaded machine: 2 s leases here)."""
    try:
        with Coordinators([address], timeout_s=5) as c:
            return list(c.call("Status", pb.StatusRequest(job=job)).jobs[0].ranks)
    except grpc.RpcError as exc:
        if exc.code() not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE):
            raise
        return None


def status_now(address: str, job: str) -> list[pb.RankStatus]:
    return wait_until(lambda: ranks_status(address, job), 30, f"{job}'s ranks from its leader")


def measured(address: str, job: str, world: int, state: str = "running") -> bool:
    ranks = ranks_status(address, job)
    return ranks is not None and len(ranks) == world and all(r.compute_us and r.state == state for r in ranks)


@pytest.mark.timeout(150)
def test_a_throttled_rank_is_named_with_its_node_and_cleared_once_it_runs_freely(coordinators, training):
    (leader,) = coordinators(1, extra=FAST_STRAGGLERS)
    ranks = training([leader.address], "slow", 4, steps=100_000, min_nodes=4, max_nodes=4)
    wait_until(lambda: measured(leader.address, "slow", 4), 60, "every rank reporting its compute")
    generation = max(r["generation"] for p in ranks for r in p.steps())
    victim = ranks[2]
    throttle = Throttle(victim.pid, stopped=0.6, period_s=0.05).start()
    try:
        named = wait_until(lambda: leader.find("straggler_named"), 60, "a straggler named")
        assert [r["node"] for r in named] == [node_of(victim)], named
        assert named[0]["factor"] >= 1.5 and named[0]["whole_node"] and 0 < named[0]["loss"] < 1
        factors = {r.node: r.straggler_factor for r in status_now(leader.address, "slow")}
        assert factors.pop(node_of(victim)) >= 1.5 and not any(factors.values()), factors
        def recorded():  # the leader logs the straggler as it decides; the event is the persisted decision's
            with Coordinators([leader.address], timeout_s=5, retry_for_s=5) as c:
                return [e for e in c.call("Events", pb.EventsRequest(job="slow")).events if e.kind == "straggler"]

        (event,) = wait_until(recorded, 10, "the straggler event recorded")
        assert list(event.nodes) == [node_of(victim)] and "the job's median" in event.reason
    finally:
        throttle.stop()
    wait_until(lambda: leader.find("straggler_cleared", node=node_of(victim)), 60, "the straggler cleared")
    assert len(leader.find("straggler_named")) == 1  # nobody else, then or since
    assert all(p.proc.poll() is None for p in ranks)  # reported only: nobody evicted, nothing re-formed
    assert max(r["generation"] for p in ranks for r in p.steps()) == generation


@pytest.mark.timeout(180)
def test_replace_swaps_a_straggling_node_for_the_spare_at_a_planned_step(coordinators, training):
    """`replace` set by the job (its spec, from the rank that creates it), the deployment's being `report`."""
    (leader,) = coordinators(1, extra=["--heartbeat-timeout", "2.0"])
    ranks = training([leader.address], "swap", 4, steps=100_000, min_nodes=2, max_nodes=3,
                     env={"MUSTER_STRAGGLER_ACTION": "replace", "MUSTER_STRAGGLER_MIN_STEPS": "10"})
    wait_until(lambda: measured(leader.address, "swap", 3), 60, "three ranks reporting their compute, one spare")
    in_map = {r.node for r in status_now(leader.address, "swap")}
    spare = next(p for p in ranks if node_of(p) not in in_map)
    victim = next(p for p in ranks if p is not spare)
    throttle = Throttle(victim.pid, stopped=0.6, period_s=0.05).start()
    try:
        wait_until(lambda: leader.find("straggler_named", node=node_of(victim)), 60, "the straggler named")
        victim.wait(60)  # drained at the planned step, told why, it leaves
    finally:
        throttle.stop()
    left = wait_until(lambda: leader.find("membership_changed", kind="node_left"), 10, "the planned leave")
    assert left[0]["nodes"] == [node_of(victim)] and "straggler replaced" in left[0]["reason"]
    assert "graceful" in left[0]["reason"]  # at a step boundary: nothing aborted
    wait_until(lambda: node_of(spare) in {r.node for r in ranks_status(leader.address, "swap") or ()}, 30,
               "the spare in the map")
    wait_until(lambda: measured(leader.address, "swap", 3), 60, "three ranks stepping again")
    assert not leader.find("straggler_named", node=node_of(spare))
    assert "straggler replaced" in victim.log_path.read_text()


def plain_script(tmp_path) -> list[str]:
    return [sys.executable, str(PLAIN), "--steps", "100000", "--step-sleep", "0.05",
            "--checkpoint-dir", str(tmp_path / "checkpoints"), "--checkpoint-every", "50"]


@pytest.mark.timeout(150)
def test_an_unmodified_script_is_measured_by_its_probe_and_its_throttled_rank_named(coordinators, agents, tmp_path):
    """`muster run` of a script with no Muster code: the runner's step probe measures each rank's
    steps and compute; the leader shows them (the ranks are in state `script`: no stall verdicts) and
    names the rank slowed from outside, as it does a library rank."""
    (leader,) = coordinators(1, extra=FAST_STRAGGLERS)
    nodes = agents([leader.address], "plainslow", ["a", "b", "c"], slots=1, nodes="3:3",
                   command=plain_script(tmp_path))
    wait_until(lambda: measured(leader.address, "plainslow", 3, "script"), 90, "every rank's probe reporting")
    ranks = status_now(leader.address, "plainslow")
    assert all(r.step > 0 and 0 < r.compute_us for r in ranks), ranks
    victim = nodes[1]
    throttle = Throttle(victim.rank_pids(0)[-1], stopped=0.6, period_s=0.05).start()
    try:
        named = wait_until(lambda: leader.find("straggler_named"), 60, "a straggler named")
        assert [r["node"] for r in named] == ["b"] and named[0]["factor"] >= 1.5, named
    finally:
        throttle.stop()
    wait_until(lambda: leader.find("straggler_cleared", node="b"), 60, "the straggler cleared")
    assert len(leader.find("straggler_named")) == 1
    assert all(len(a.rank_pids(0)) == 1 for a in nodes)  # reported only: no rank restarted, no stall found
    assert {r["kind"] for r in leader.find("membership_changed")} == {"node_joined", "formed", "straggler"}


@pytest.mark.timeout(180)
def test_replace_swaps_an_unmodified_scripts_straggling_node_for_the_spare(coordinators, agents, tmp_path):
    """The job's `replace` policy set on `muster run`: the node of a throttled rank leaves at a planned
    step (its agent told why, exit 3), the spare takes its place, the script restarts from its checkpoint."""
    (leader,) = coordinators(1, extra=["--heartbeat-timeout", "2.0"])
    policy = ["--straggler-action", "replace", "--straggler-min-steps", "10"]
    nodes = agents([leader.address], "plainswap", ["a", "b", "c"], slots=1, nodes="2:2", extra=policy,
                   command=plain_script(tmp_path))
    wait_until(lambda: measured(leader.address, "plainswap", 2, "script"), 90, "two ranks measured, one spare")
    in_map = {r.node for r in status_now(leader.address, "plainswap")}
    (spare,) = [a for a in nodes if a.node_id not in in_map]
    victim = next(a for a in nodes if a.node_id in in_map)
    throttle = Throttle(victim.rank_pids(0)[-1], stopped=0.6, period_s=0.05).start()
    try:
        wait_until(lambda: leader.find("straggler_named", node=victim.node_id), 60, "the straggler named")
        assert victim.proc.wait(60) == 3  # drained: the coordinator's order
    finally:
        throttle.stop()
    left = wait_until(lambda: leader.find("membership_changed", kind="node_left"), 10, "the planned leave")
    assert left[0]["nodes"] == [victim.node_id] and "straggler replaced" in left[0]["reason"]
    wait_until(lambda: spare.node_id in {r.node for r in ranks_status(leader.address, "plainswap") or ()}, 30,
               "the spare in the map")
    wait_until(lambda: measured(leader.address, "plainswap", 2, "script"), 60, "both ranks stepping again")
    assert not leader.find("straggler_named", node=spare.node_id)
    assert "straggler replaced" in victim.log_path.read_text()
