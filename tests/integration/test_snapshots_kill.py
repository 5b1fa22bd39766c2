"""Sharding without replicas (examples/train_sharded.py: FSDP2 over a 1-D mesh of 4 ranks, and
ZeRO-1) under a real coordinator, with peer snapshots every 4 steps: a rank SIGKILLed mid-training
is replaced by the spare in its slot, which takes its shard from its buddy's snapshot; the survivors
roll back in place to the last complete snapshot (no restart) and the job ends with every slot
bit-identical to an uninterrupted run that saw the same batches (the mesh's group numbers its ranks
by slot, so reductions keep their order). Both a rank and its buddy lost ends the job, saying so.
Under `muster run` (2 nodes x 2 slots and a spare node) a whole node lost is refilled the same way,
even while a survivor exits stuck: it hands its snapshots to its slot's next process."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from muster.local import (TrainingProcess, final_digests, json_lines, kill_and_finish, resumed_at,
                          spare_victim_survivors, wait_until)

SCRIPT = str(Path(__file__).resolve().parents[2] / "examples" / "train_sharded.py")
STEPS, EVERY = 20, 4  # (steps enough that the kill lands mid-run on a loaded host)


@pytest.fixture
def sharded(training):
    """`training`'s ranks (ended afterwards) of examples/train_sharded.py."""
    def start(coordinator: str, job: str, n: int, zero: bool, steps: int = STEPS) -> list[TrainingProcess]:
        args = ("--every", str(EVERY), *(["--zero"] if zero else []))
        return training([coordinator], job, n, steps=steps, step_sleep_s=0.1, args=args, script=SCRIPT)
    return start


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["fsdp2", "zero1"])
def test_a_killed_rank_is_refilled_from_its_buddy_and_the_survivors_roll_back_in_place(coordinators, sharded, kind):
    (leader,) = coordinators(1, extra=["--heartbeat-timeout", "2.0"])
    zero = kind == "zero1"
    reference = sharded(leader.address, f"{kind}-ref", 4, zero)
    ranks = sharded(leader.address, f"{kind}-kill", 5, zero)  # 4 in the mesh, the 5th a spare
    wait_until(lambda: sum(p.last_step > 0 for p in ranks) == 4, 60, "4 ranks stepping")
    spare, victim, survivors = spare_victim_survivors(ranks, 1, leader.address, f"{kind}-kill")
    wait_until(lambda: victim.last_step >= EVERY + 2, 60, f"the victim past step {EVERY + 2}")
    assert victim.last_step < STEPS - 2, f"the job nearly ended before the kill (step {victim.last_step})"
    generation, killed_at = kill_and_finish(victim, reference + survivors + [spare], 60)
    resumed = resumed_at(survivors, generation)
    reformed = [[r for r in p.records("group_formed") if r["generation"] > generation][0] for p in survivors]
    back_to = {r["step"] for r in reformed}
    print(f"\n{kind}, a rank killed at step {victim.last_step}: every survivor stepping {resumed - killed_at:.2f} s "
          f"later, rolled back to step {back_to}, {max(r['steps_behind'] for r in reformed)} steps redone")

    (step,) = back_to
    assert step % EVERY == 0 and max(r["steps_behind"] for r in reformed) <= EVERY, reformed
    assert all(r["bytes_received"] == 0 for r in reformed), "survivors roll back from their own copies"
    took = [r for r in spare.records("group_formed") if r["generation"] > generation][0]
    assert took["state"] == "receiver" and took["bytes_received"] > 0 and took["step"] == step, took
    assert {r["slot"] for r in spare.steps()} == {1}, "the spare landed in the lost slot"
    assert sum(r["bytes_sent"] for r in reformed) == took["bytes_received"], "sent by the buddy alone"
    assert [r["step"] for r in spare.steps()][0] == step + 1, "the replayed steps start after the snapshot"
    assert final_digests(survivors + [spare], STEPS) == final_digests(reference, STEPS)


@pytest.mark.timeout(90)
def test_a_rank_lost_with_its_buddy_ends_the_job_saying_so(coordinators, sharded):
    (leader,) = coordinators(1, extra=["--heartbeat-timeout", "2.0"])
    ranks = sharded(leader.address, "both-lost", 6, False, steps=200)  # 4 in the mesh, 2 spares
    wait_until(lambda: sum(p.last_step > EVERY for p in ranks) == 4, 60, f"4 ranks past step {EVERY}")
    # `muster status` shows the snapshots' period and the host memory they take (K and its cost)
    def shown():  # (polled: on a loaded machine the leader may be re-elected meanwhile, its ranks "unknown")
        out = subprocess.run([sys.executable, "-m", "muster.cli", "status", "--coordinator", leader.address,
                              "--job", "both-lost", "--json"], capture_output=True, text=True, timeout=30)
        in_map = json.loads(out.stdout)["jobs"][0]["ranks"] if out.returncode == 0 else []
        return len(in_map) == 4 and all(r["snapshot_every"] == EVERY and r["snapshot_bytes"] > 0 for r in in_map)
    wait_until(shown, 60, "`muster status` showing every rank's snapshot period and bytes", interval_s=0.5)
    by_slot = {p.steps()[-1]["slot"]: p for p in ranks if p.steps()}
    for slot in (1, 2):  # slot 2 holds slot 1's snapshot (standalone ranks: one node each, stride 1)
        by_slot[slot].signal(signal.SIGKILL)
    for p in [by_slot[0], by_slot[3]]:
        assert p.wait(60) == 3, p.log_path.read_text()[-3000:]
        (stopped,) = p.records("training_stopped")
        assert stopped["kind"] == "ShardLost" and "slot 1 and its buddy slot 2" in stopped["error"], stopped


@pytest.mark.timeout(180)
def test_under_muster_run_a_lost_node_is_refilled_even_while_a_survivor_exits_stuck(coordinators, sharded, agents):
    """ZeRO-1 on 2 nodes x 2 slots under `muster run`, a third node a spare: a node is killed, agent
    and ranks. Its slots' buddies are on the other node (stride 2), so the spare node's ranks take
    both slots, each receiving its shard from its buddy, while the other node's ranks roll back in
    place; every slot ends bit-identical to an uninterrupted run of the same batches.

    And the kept node's slot 0 sits in its step when the node is lost: here a sleep, in stop 53's CI
    gloo's wait on a message the dead peer half sent, which the abort does not end. Slot 0 exits
    stuck, and it held the only copy of slot 2's shard (its predecessor's, on the lost node): the job
    would end in ShardLost. It leaves its snapshots to its slot's next process, which takes them over
    and rolls back from them with the others."""
    (leader,) = coordinators(1, extra=["--heartbeat-timeout", "2.0"])
    steps, stall = 30, 2 * EVERY + 2  # two snapshots taken before the stall
    reference = sharded(leader.address, "node-ref", 4, True, steps=steps)
    run = {"nodes": "2:2", "extra": ["--world-size-multiple", "4"],
           "command": [sys.executable, SCRIPT, "--zero", "--every", str(EVERY), "--steps", str(steps),
                       "--step-sleep", "0.1", "--stall-at-step", str(stall)]}
    nodes = agents([leader.address], "node-loss", ["a", "b", "c"], **run)

    def stalled():
        return next(((n, s) for n in nodes for s in (0, 1) if n.rank_records(s, "stalling")), None)
    kept, slot0 = wait_until(stalled, 120, f"mesh slot 0 stalling in step {stall}")
    (victim,) = [n for n in nodes if n is not kept and n.steps(0)]
    (spare,) = [n for n in nodes if n not in (kept, victim)]
    lost = {victim.steps(s)[-1]["slot"] for s in (0, 1)}
    generation = victim.steps(0)[-1]["generation"]
    victim.signal(signal.SIGKILL)
    for p in [*reference, kept, spare]:
        assert p.wait(120) == 0, p.log_path.read_text()[-3000:]

    (first, *later) = [json_lines(log) for log in kept.rank_logs(slot0)]
    assert [r["event"] for r in first if r["event"] in ("rank_exited_stuck", "snapshots_left_behind")] == \
        ["rank_exited_stuck", "snapshots_left_behind"]
    (left,) = [r for r in first if r["event"] == "snapshots_left_behind"]
    assert left["slot"] == 0 and left["own"] == [EVERY, 2 * EVERY] and left["held"], left
    (taken,) = [r for log in later for r in log if r["event"] == "snapshots_taken_over"]
    assert (taken["slot"], taken["own"], taken["held"]) == (0, left["own"], left["held"])
    assert {r["slot"] for s in (0, 1) for r in spare.steps(s)} == lost, "the spare node took the lost slots"
    for s in (0, 1):
        took = [r for r in spare.rank_records(s, "group_formed") if r["generation"] > generation][0]
        assert took["state"] == "receiver" and took["bytes_received"] > 0 and took["step"] in left["own"], took
        # in place, from its own copy (slot 0's next process: from the copies taken over)
        rolled = [r for r in kept.rank_records(s, "group_formed") if r["generation"] > generation][0]
        assert rolled["bytes_received"] == 0 and rolled["step"] == took["step"], rolled
    logs = [log for n in (kept, spare) for s in (0, 1) for log in n.rank_logs(s)]
    assert not [r for log in logs for r in json_lines(log, "training_stopped")], "no ShardLost, no restart from step 0"
    finals = {r["slot"]: r["digest"] for n in (kept, spare) for s in (0, 1) for r in n.steps(s)[-1:]}
    assert finals == final_digests(reference, steps)
