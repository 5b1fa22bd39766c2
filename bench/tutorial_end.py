"""Does every run of the pytorch/examples DDP tutorial end? `muster run … -- torchrun --nproc-per-node 2
multinode.py 4 2 --batch_size 4` (tests/integration/scripts/multinode.py: its DDP wrapper is alive at
destroy_process_group()), 2 nodes × 2 ranks, gloo, the agents' default flags; --runs runs, one after
the other, warm (the default) or --cold. A run that has not ended after --bound seconds never ends
(its agents are killed by PID). Prints one JSON object: per run its outcome, seconds, the ranks the
agent had to end (the exit timeout) and those that died in teardown after completing; exit 1 unless
every run ended succeeded with no rank ended by the exit timeout.

    python bench/tutorial_end.py --runs 20 [--cold]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from muster.client import Coordinators
from muster.coordinator.etcd.server import EtcdServer
from muster.local import AgentProcess, CoordinatorProcess, end_on_sigterm
from muster.v1 import muster_pb2 as pb

SCRIPT = Path(__file__).resolve().parents[1] / "tests" / "integration" / "scripts" / "multinode.py"


def one_run(coordinator: str, workdir: Path, job: str, cold: bool, bound_s: float) -> dict:
    command = [str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node", "2", str(SCRIPT), "4", "2",
               "--batch_size", "4"]
    agents = []
    for node_id in ("a", "b"):  # a directory each, as two hosts have: local rank 0 saves snapshot.pt there
        (workdir / node_id).mkdir(parents=True)
        agents.append(AgentProcess([coordinator], job, node_id, workdir / "logs", nodes="2:2", command=command,
                                   extra=["--no-warm-start"] if cold else [], cwd=workdir / node_id).start())
    started = time.monotonic()
    codes = []
    for agent in agents:
        try:
            codes.append(agent.wait(max(1.0, bound_s - (time.monotonic() - started))))
        except subprocess.TimeoutExpired:
            codes.append(None)
    seconds = round(time.monotonic() - started, 1)
    for agent in agents:
        agent.stop()
    with Coordinators([coordinator], timeout_s=5) as c:
        runs = list(c.call("Jobs", pb.JobsRequest(job=job)).jobs)
    return {"job": job, "codes": codes, "outcome": runs[-1].outcome if runs else None, "seconds": seconds,
            "ended_by_exit_timeout": [r["rank"] for a in agents for r in a.records("rank_exit_timeout")
                                      if r["sending"] == "terminate"],
            "frozen": [r["rank"] for a in agents for r in a.records("rank_frozen_after_its_work")],
            "died_in_teardown": [(r["rank"], r["code"]) for a in agents for r in a.records("rank_finished_then_died")
                                 if not r["hung"]]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--cold", action="store_true", help="--no-warm-start")
    p.add_argument("--bound", type=float, default=240.0, help="seconds after which a run never ends")
    args = p.parse_args()
    kind = "cold" if args.cold else "warm"
    with tempfile.TemporaryDirectory(prefix="tutorial-end-") as tmp:
        etcd = EtcdServer(Path(tmp) / "etcd")  # (a coordinator's own would live in the working directory)
        etcd.start()
        try:
            coordinator = CoordinatorProcess([etcd.endpoint], Path(tmp) / "coordinator.log").start()
            try:
                runs = [one_run(coordinator.address, Path(tmp) / f"run-{i}", f"tutorial-{kind}-{i}", args.cold,
                                args.bound) for i in range(args.runs)]
            finally:
                coordinator.stop()
        finally:
            etcd.stop()
    clean = [r for r in runs if r["outcome"] == "succeeded" and r["codes"] == [0, 0] and not r["ended_by_exit_timeout"]]
    seconds = sorted(r["seconds"] for r in runs)
    print(json.dumps({"kind": kind, "runs": len(runs), "succeeded": sum(r["outcome"] == "succeeded" for r in runs),
                      "succeeded_with_no_rank_ended_by_the_exit_timeout": len(clean),
                      "median_s": seconds[len(seconds) // 2], "max_s": seconds[-1], "each": runs}, indent=1))
    return 0 if len(clean) == len(runs) else 1


if __name__ == "__main__":
    end_on_sigterm()
    sys.exit(main())
