"""The pytorch/examples DDP tutorial (multinode.py) under `muster run … -- torchrun …`, as its users
run it: 2 nodes × 2 ranks, gloo, default flags. Its main() ends with destroy_process_group() while
its Trainer, and the DDP wrapper in it, is still alive: the wrapper frees the group as main()
returns, which deadlocked in gloo's teardown (group_end) in forked (warm) ranks, so the job never
ended. Every run must end once, succeeded, every rank completed in its first process."""

import subprocess
import sys
from pathlib import Path

import pytest

from muster.client import Coordinators
from muster.v1 import muster_pb2 as pb

SCRIPT = Path(__file__).parent / "scripts" / "multinode.py"
EPOCHS, SAVE_EVERY = 4, 2


def run_tutorial(coordinators, agents, tmp_path: Path, job: str, warm: bool, batch_size: int = 16,
                 exit_timeout_s: float = 30.0, wait_s: float = 150.0):
    (leader,) = coordinators(1)
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    command = [torchrun, "--nproc-per-node", "2", str(SCRIPT), str(EPOCHS), str(SAVE_EVERY), "--batch_size",
               str(batch_size)]
    extra = ["--exit-timeout", str(exit_timeout_s), "--warm-start" if warm else "--no-warm-start"]
    nodes = []
    for node_id in ("a", "b"):  # a directory each, as two hosts have: local rank 0 saves snapshot.pt there
        (tmp_path / node_id).mkdir()
        nodes += agents([leader.address], job, [node_id], nodes="2:2", command=command, extra=extra,
                        cwd=tmp_path / node_id)
    for node in nodes:
        try:
            code = node.wait(wait_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"agent {node.node_id} still running after {wait_s:g} s:\n"
                                 + node.log_path.read_text()[-3000:]) from None
        assert code == 0, node.log_path.read_text()[-3000:]
    with Coordinators([leader.address], timeout_s=5, retry_for_s=5) as c:
        (run,) = c.call("Jobs", pb.JobsRequest(job=job)).jobs
    assert (run.run, run.outcome) == (1, "succeeded"), run
    return nodes


@pytest.mark.timeout(200)
@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_the_ddp_tutorial_ends_succeeded_with_every_rank_completed(coordinators, agents, tmp_path, warm):
    nodes = run_tutorial(coordinators, agents, tmp_path, f"tutorial-{'warm' if warm else 'cold'}", warm)
    for node in nodes:
        # each rank ran once, through its last epoch, and returned from its script: none hung freeing its
        # group as main() returned (such a rank never completes; the agent would end it as frozen), none
        # restarted. (A slow teardown after that, on a loaded machine, is no part of it.)
        assert sorted(r["slot"] for r in node.records("rank_started")) == [0, 1]
        assert sorted(r["slot"] for r in node.records("rank_completed")) == [0, 1]
        assert not node.records("rank_frozen_after_its_work")
        for slot in (0, 1):
            (log,) = node.rank_logs(slot)
            assert f"Epoch {EPOCHS - 1} | Batchsize: 16" in log.read_text()
        assert (node.cwd / "snapshot.pt").exists()
