"""Unmodified torchrun with `--rdzv-backend=muster`: two torchrun nodes train together; a worker
is killed (one new round with every node), then a whole node (its process group), and the other
continues with plain restart semantics."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from muster.local import wait_until
from muster.names import job_name
from tests.conftest import behind_the_control_plane

PLAIN = Path(__file__).resolve().parents[2] / "examples" / "train_plain.py"
STEP_RECORD = re.compile(r'\{"event": "step"[^{}]*\}')  # ranks share torchrun's stdout: lines may interleave


class TorchrunNode:
    def __init__(self, coordinator: str, job: str, log_path, checkpoints, steps: int):
        self.log_path = log_path
        args = [sys.executable, "-m", "torch.distributed.run", "--rdzv-backend=muster",
                f"--rdzv-endpoint={coordinator}", f"--rdzv-id={job}", "--nnodes=1:2", "--nproc-per-node=2",
                "--max-restarts=5", "--monitor-interval=0.5", "--local-addr=127.0.0.1",
                str(PLAIN), "--steps", str(steps), "--step-sleep", "0.05", "--checkpoint-dir", str(checkpoints)]
        with open(log_path, "ab") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        # Nice 10, as the zygote's ranks (what torchrun forks inherits it): at 0 its four workers took a
        # quarter of a core each beside the coordinators of the tests running with it (fresh-clone run AA)
        behind_the_control_plane(self.proc.pid)

    def steps(self) -> list[dict]:
        return [json.loads(m) for m in STEP_RECORD.findall(self.log_path.read_text(errors="replace"))]

    def kill_node(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)  # the torchrun agent and its workers
        self.proc.wait(5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.kill_node()


@pytest.mark.timeout(270)  # above its three bounded waits together (90 + 60 + 100 s)
def test_torchrun_with_the_muster_backend_survives_the_loss_of_a_node(coordinators, tmp_path):
    (leader,) = coordinators(1, extra=["--heartbeat-timeout", "2.0"])
    # An id as torchrun takes it (uppercase): the backend maps it onto the coordinator's job names.
    nodes = [TorchrunNode(leader.address, "TRdzv", tmp_path / f"node-{i}.log", tmp_path / "ckpt", 250)
             for i in range(2)]
    try:
        wait_until(lambda: all(any(r["world_size"] == 4 and r["step"] > 30 for r in n.steps()) for n in nodes),
                   90, "both nodes training together")
        # One worker dies: its node asks for a new round at once, and the job re-forms once with
        # that node in its place (a world of 4 again, no leave and join). The other node's workers
        # may fail too (their collective lost a peer) and ask in the same tally: still one round.
        victim, survivor = nodes
        before = leader.find("membership_changed", job=job_name("TRdzv"))[-1]["generation"]
        first = [{r["pid"] for r in n.steps()} for n in nodes]
        os.kill(victim.steps()[-1]["pid"], signal.SIGKILL)
        wait_until(lambda: all(any(r["world_size"] == 4 and r["pid"] not in old for r in n.steps())
                               for n, old in zip(nodes, first)), 60, "both nodes training again after the kill")
        changes = [r for r in leader.find("membership_changed", job=job_name("TRdzv")) if r["generation"] > before]
        restarted = [r for r in changes if r["kind"] != "generation"]
        assert {r["kind"] for r in restarted} == {"rank_restarted"}, changes
        assert len({r["generation"] for r in changes}) == 1, changes
        assert any(n.endswith(f"-{victim.proc.pid}") for r in restarted for n in r["nodes"]), changes
        victim.kill_node()
        assert survivor.proc.wait(100) == 0, survivor.log_path.read_text()[-3000:]
        final = [r for r in survivor.steps() if r["step"] == 250]
        assert {r["world_size"] for r in final} == {2} and {r["rank"] for r in final} == {0, 1}
        resumed = [r for r in survivor.steps() if r["world_size"] == 2]
        assert resumed[0]["resumed_from"] > 0, "the restarted workers resumed from the checkpoint"
        kinds = [r["kind"] for r in leader.find("membership_changed", job=job_name("TRdzv"))]
        assert "node_silent" in kinds and job_name("TRdzv").startswith("trdzv-")
    finally:
        for n in nodes:
            n.stop()
