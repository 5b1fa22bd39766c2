"""The durable tier under a real coordinator with real gloo ranks and real files (issue 55 items 1-3):
the library checkpoints the registered state itself and resumes from it where no rank holds a step
(every rank of a replicated job killed; a slot and its buddy killed together), bit-identical to an
uninterrupted run, the data position with it; replicas that disagree with no majority go back to the
checkpoint instead of training on either."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from muster.local import final_digests, wait_until

SHARDED = str(Path(__file__).resolve().parents[2] / "examples" / "train_sharded.py")
EVERY = 4


def recovered(p) -> list[dict]:
    return p.records("recovered")


def restores(leader, job: str) -> list[dict]:
    """The job's recoveries as `muster events --json` gives them, those that restored a state."""
    out = subprocess.run([sys.executable, "-m", "muster.cli", "events", job, "--coordinator", leader.address, "--json"],
                         capture_output=True, text=True, timeout=30, check=True)
    return [r for r in json.loads(out.stdout)["recoveries"] if r["tier"]]


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
    again = training([leader.address], "all-lost", 2, steps=steps, min_nodes=2, args=ckpt)
    # the outcome tells it (asked while the run lasts: a finished run's recoveries are not kept): the
    # recovery restored the checkpoint's step, the steps past it counted as lost
    wait_until(lambda: [r for r in restores(leader, "all-lost") if r["tier"] == "checkpoint"], 90,
               "the restore from the checkpoint in events")
    (shown,) = [r for r in restores(leader, "all-lost") if r["tier"] == "checkpoint"]
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
    assert shown["step"] == back and killed_at - back - 1 <= shown["steps_lost"] <= killed_at - back, shown


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
