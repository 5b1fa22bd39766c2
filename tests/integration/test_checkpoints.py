"""The durable tier under a real coordinator with real gloo ranks and real files (issue 55 items 1-3):
the library checkpoints the registered state itself and resumes from it where no rank holds a step
(every rank of a replicated job killed; a slot and its buddy killed together; HSDP's shard killed in
every replica under `muster run --checkpoint-dir`), bit-identical to an uninterrupted run, the data
position with it; replicas that disagree with no majority go back to the checkpoint instead of
training on either. The job's events say which tier restored which step and the steps lost."""

import os
import signal
import sys
from pathlib import Path

import pytest

from muster.local import final_digests, recovery_from, wait_until

SHARDED = str(Path(__file__).resolve().parents[2] / "examples" / "train_sharded.py")
HSDP = str(Path(__file__).resolve().parents[2] / "examples" / "train_hsdp.py")
EVERY = 4


def recovered(p) -> list[dict]:
    return p.records("recovered")




@pytest.mark.timeout(150)
def test_every_rank_of_a_replicated_job_killed_resumes_from_the_checkpoint(coordinators, training, tmp_path):
    (leader,) = coordinators(1, extra=["--heartbeat-timeout", "2.0"])
    steps, ckpt = 60, ("--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", str(EVERY))
    reference = training([leader.address], "ref", 2, steps=steps, min_nodes=2)
    first = training([leader.address], "all-lost", 2, steps=steps, min_nodes=2, args=ckpt)
    wait_until(lambda: all(p.last_step >= 2 * EVERY + 1 for p in first), 90, "both ranks past the second checkpoint")
    for p in first:
        p.signal(signal.SIGKILL)
    killed_at = max(p.last_step for p in first)
    for p in first:
        p.wait(30)
    again = training([leader.address], "all-lost", 2, steps=steps, min_nodes=2, step_sleep_s=0.1, args=ckpt)
    shown = recovery_from(leader.address, "all-lost", "checkpoint")  # what the job's events say of it
    for p in [*reference, *again]:
        assert p.wait(120) == 0, p.log_path.read_text()[-3000:]
    (back,) = {r["step"] for p in again for r in recovered(p)}
    assert all(r["tier"] == "checkpoint" for p in again for r in recovered(p))
    assert back % EVERY == 0 and killed_at - EVERY <= back <= killed_at, (back, killed_at)
    for p in again:
        assert p.steps()[0]["step"] == back + 1 and p.steps()[0]["position"] == back + 1, "the data position came back"
    print(f"\nevery rank killed at step {killed_at}: resumed from the checkpoint of step {back}, "
          f"{killed_at - back} steps lost")
    assert {p.steps()[-1]["digest"] for p in again} == {p.steps()[-1]["digest"] for p in reference}
    # (a run of its own: the first ended with every node lost; the steps lost are the first run's)
    assert shown["step"] == back and shown["steps_lost"] == 0, shown


@pytest.mark.timeout(150)
def test_replicas_that_disagree_with_no_majority_go_back_to_the_checkpoint(coordinators, training, tmp_path):
    """3 ranks; one nudges its parameters after step 12 (after that step's checkpoint took its copy),
    a corruption of one replica; then a clean rank is killed: the 2 survivors at one step differ,
    neither is the reference, and both go back to the checkpoint of step 12 before their next step
    commits (the next checkpoint, at 24, is far: the kill comes at 14)."""
    (leader,) = coordinators(1, extra=["--heartbeat-timeout", "2.0"])
    ckpt = ("--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "12")
    job = {"steps": 30, "min_nodes": 2, "max_nodes": 3, "step_sleep_s": 0.2}  # (past 24, the next checkpoint)
    clean = training([leader.address], "split", 2, **job, args=ckpt)
    (odd,) = training([leader.address], "split", 1, **job, args=(*ckpt, "--perturb-at-step", "12"))
    wait_until(lambda: all(p.last_step >= 14 for p in [*clean, odd]), 90, "3 ranks past the corruption")
    victim, kept = clean
    victim.signal(signal.SIGKILL)
    for p in (kept, odd):
        assert p.wait(120) == 0, p.log_path.read_text()[-3000:]
    assert len({r["digest"] for p in (kept, odd) for r in p.steps() if r["step"] == 13 and r["world_size"] == 3}) == 2, \
        "corrupted"
    for p in (kept, odd):
        (r,) = [r for r in recovered(p) if r["tier"] == "checkpoint"]
        assert r["step"] == 12, r
    assert odd.steps()[-1]["digest"] == kept.steps()[-1]["digest"], "one state again, the checkpoint's"


@pytest.mark.timeout(150)
def test_a_slot_and_its_buddy_killed_together_resume_from_the_checkpoint(coordinators, training, tmp_path):
    (leader,) = coordinators(1, extra=["--heartbeat-timeout", "2.0"])
    steps = 24
    start = lambda job, n, args=(): training([leader.address], job, n, steps=steps, step_sleep_s=0.1,  # noqa: E731
                                             script=SHARDED, args=("--every", str(EVERY), *args))
    reference = start("both-ref", 4)
    ranks = start("both-lost", 6, ("--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", str(2 * EVERY)))
    wait_until(lambda: sum(p.last_step >= 2 * EVERY + 2 for p in ranks) == 4, 90, "4 ranks past the first checkpoint")
    by_slot = {p.steps()[-1]["slot"]: p for p in ranks if p.steps()}
    killed_at = max(p.last_step for p in by_slot.values())
    for slot in (1, 2):  # slot 2 holds slot 1's snapshot (standalone ranks: one node each, stride 1)
        by_slot[slot].signal(signal.SIGKILL)
    finishing = [p for p in ranks if p not in (by_slot[1], by_slot[2])]
    for p in [*reference, *finishing]:
        assert p.wait(120) == 0, p.log_path.read_text()[-3000:]
    lost = [r for p in finishing for r in recovered(p) if r["tier"] == "checkpoint"]
    (back,) = {r["step"] for r in lost}
    assert len(lost) == 4 and back % (2 * EVERY) == 0 and back <= killed_at, lost
    print(f"\na slot and its buddy killed at step {killed_at}: resumed from the checkpoint of step {back}, "
          f"{killed_at - back} steps lost")
    assert final_digests(finishing, steps) == final_digests(reference, steps)


@pytest.mark.timeout(180)
def test_muster_run_checkpoint_dir_gives_ranks_that_register_none_the_durable_tier(coordinators, agents, tmp_path):
    """`muster run --checkpoint-dir DIR --checkpoint-every N`: the example registers no checkpoint= of its
    own, the library takes the agent's (MUSTER_CHECKPOINT_DIR/EVERY); both ranks of the only node killed at
    once, the agent's fresh processes resume from the newest complete checkpoint, not from step 0."""
    (leader,) = coordinators(1, extra=["--heartbeat-timeout", "2.0"])
    ckpt = tmp_path / "ckpt"
    (node,) = agents([leader.address], "run-ckpt", ["a"], nodes="1:1", steps=60, step_sleep_s=0.1,
                     extra=["--checkpoint-dir", str(ckpt), "--checkpoint-every", str(EVERY)])
    wait_until(lambda: all(node.steps(s) and node.steps(s)[-1]["step"] >= 2 * EVERY + 1 for s in (0, 1)), 90,
               "both ranks past the second checkpoint")
    wait_until(lambda: all(node.rank_pids(s) for s in (0, 1)), 30, "the agent's word on its ranks' PIDs")
    killed = {s: node.rank_pids(s)[-1] for s in (0, 1)}
    logs = {s: len(node.rank_logs(s)) - 1 for s in (0, 1)}  # the victims' (a slot's latest may soon be its next process's)
    for pid in killed.values():
        os.kill(pid, signal.SIGKILL)
    killed_at = max(node.steps(s, logs[s])[-1]["step"] for s in (0, 1))
    shown = recovery_from(leader.address, "run-ckpt", "checkpoint")  # the same run: the steps past the checkpoint counted lost
    assert node.wait(150) == 0, node.log_path.read_text()[-3000:]
    assert sorted(p.name for p in ckpt.iterdir())[0].startswith("step-"), "the ranks wrote to the agent's directory"
    # The agent restarts each slot in its own time: the first fresh process back resumes from the checkpoint,
    # one that comes later may join it as a receiver of its state
    firsts = {s: node.rank_records(s, "recovered")[0] for s in (0, 1)}
    (back,) = {r["step"] for r in firsts.values() if r["tier"] == "checkpoint"}
    assert back % EVERY == 0 and 0 < back <= killed_at and {r["tier"] for r in firsts.values()} <= {"checkpoint", "replica"}
    for s in (0, 1):
        assert node.rank_pids(s)[-1] != killed[s] and node.steps(s)[0]["step"] == firsts[s]["step"] + 1, \
            "a fresh process went on from the step it was given"
        assert node.steps(s)[-1]["step"] == 60
    assert len({node.steps(s)[-1]["digest"] for s in (0, 1)}) == 1
    assert shown["step"] == back and killed_at - back - 1 <= shown["steps_lost"] <= killed_at - back, (shown, killed_at)


@pytest.mark.timeout(300)
def test_hsdp_with_the_guides_flags_losing_a_shard_in_every_replica_resumes_from_the_checkpoint(coordinators, agents,
                                                                                                  tmp_path):
    """examples/train_hsdp.py (Replicas(2, 2)) under `muster run` with the sharded guide's flags, one replica
    group per node (`--nodes 1:2 --world-size-multiple 2`), and `--checkpoint-dir`: shard 1 is killed in
    both replicas at once (mesh slots 1 and 3), so no rank holds it. Every rank goes back to the newest
    complete checkpoint, and the job's events say from which step and how many steps were lost."""
    (leader,) = coordinators(1, extra=["--heartbeat-timeout", "2.0"])
    steps, ckpt = 40, tmp_path / "ckpt"
    command = [sys.executable, HSDP, "--steps", str(steps), "--step-sleep", "0.1"]
    nodes = agents([leader.address], "hsdp-ckpt", ["a", "b"], nodes="1:2", command=command,
                   extra=["--world-size-multiple", "2", "--checkpoint-dir", str(ckpt), "--checkpoint-every", str(EVERY)])
    wait_until(lambda: all(n.steps(s) and n.steps(s)[-1]["step"] >= 2 * EVERY + 1 for n in nodes for s in (0, 1)), 150,
               "every rank past the second checkpoint")
    wait_until(lambda: all(n.rank_pids(s) for n in nodes for s in (0, 1)), 30, "the agents' word on their ranks' PIDs")
    victims = [(n, s) for n in nodes for s in (0, 1) if n.steps(s)[-1]["slot"] % 2 == 1]  # shard 1 of each replica
    assert len(victims) == 2
    for n, s in victims:
        os.kill(n.rank_pids(s)[-1], signal.SIGKILL)
    # (a victim's slot may already show its new start, with no step yet: the survivors say where the job was)
    # (read once per slot: a second read can find the new start's log)
    killed_at = max(done[-1]["step"] for n in nodes for s in (0, 1) if (done := n.steps(s)))
    shown = recovery_from(leader.address, "hsdp-ckpt", "checkpoint", 150)
    for n in nodes:
        assert n.wait(150) == 0, n.log_path.read_text()[-3000:]
    back = shown["step"]
    assert back % EVERY == 0 and 0 < back <= killed_at, (shown, killed_at)
    assert killed_at - back - 1 <= shown["steps_lost"] <= killed_at - back, (shown, killed_at)
    for n in nodes:
        for s in (0, 1):
            done = n.steps(s)
            assert done[-1]["step"] == steps, (n.node_id, s, done[-1])
            if (n, s) not in victims:  # a survivor went back to the checkpoint in place
                assert [r["step"] for r in n.rank_records(s, "recovered") if r["tier"] == "checkpoint"] == [back]
    print(f"\nHSDP 2x2, shard 1 killed in both replicas at step {killed_at}: every rank back at the checkpoint "
          f"of step {back}, {shown['steps_lost']} steps lost")
