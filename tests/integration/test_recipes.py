"""The deployment recipes as far as one machine can try them: deploy/slurm/train.sbatch run under
an `srun` that does what Slurm's does with one task a node (the step once per node, in parallel,
with each node's SLURM_* variables), against a real coordinator: two agents wrap torchrun, form one
job and end it succeeded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FAKE_SRUN = """#!/usr/bin/env bash
# srun --ntasks-per-node=1 on one machine: the step once per "node", in parallel, as Slurm sets it up
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_NNODES; i++)); do
    SLURM_NODEID=$i SLURM_PROCID=$i SLURMD_NODENAME=node$i "$@" > "$SRUN_LOGS/node$i.log" 2>&1 &
    pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
exit $rc
"""


@pytest.mark.timeout(150)
def test_the_slurm_recipe_runs_one_agent_per_node_and_the_job_ends_succeeded(coordinators, tmp_path):
    (replica,) = coordinators(1)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MUSTER_", "SLURM"))}
    env.update(PATH=f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{env['PATH']}",
               MUSTER_COORDINATOR=replica.address, SLURM_JOB_ID="4242", SLURM_NNODES="2", SLURM_GPUS_ON_NODE="1",
               SRUN_LOGS=str(tmp_path))
    out = subprocess.run(["bash", str(ROOT / "deploy/slurm/train.sbatch"), "-m", "muster.examples.train_ddp",
                          "--steps", "30", "--step-sleep", "0.02"],
                         capture_output=True, text=True, timeout=140, env=env, cwd=tmp_path)
    logs = {n: (tmp_path / f"{n}.log").read_text() for n in ("node0", "node1") if (tmp_path / f"{n}.log").exists()}
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-2000:], {n: t[-3000:] for n, t in logs.items()})
    stopped = [json.loads(line) for t in logs.values() for line in t.splitlines() if '"agent_stopped"' in line]
    assert sorted((s["node"], s["job"], s["code"]) for s in stopped) == [("node0", "slurm-4242", 0),
                                                                         ("node1", "slurm-4242", 0)], stopped
    status = subprocess.run([sys.executable, "-m", "muster.cli", "status", "--coordinator", replica.address,
                             "--job", "slurm-4242", "--json"], capture_output=True, text=True, timeout=30, env=env)
    assert json.loads(status.stdout)["jobs"][0]["outcome"] == "succeeded", status.stdout[-2000:]


def test_the_slurm_recipe_says_what_it_needs():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MUSTER_")}
    out = subprocess.run(["bash", str(ROOT / "deploy/slurm/train.sbatch"), "train.py"], capture_output=True,
                         text=True, timeout=30, env=env)
    assert out.returncode != 0 and "set MUSTER_COORDINATOR" in out.stderr
