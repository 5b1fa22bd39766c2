"""Warm starts under stress: `muster run --warm-start` nodes of an unmodified script
(examples/train_plain.py), one worker SIGKILLed per cycle, hundreds of cycles; every restart of
every rank must reach its first step. Half the kills hit a stepping rank, half a rank just forked
by the restart before it (most likely) reached its first step, so restarts also meet restarts.

A cycle whose ranks are not all stepping again, from new processes, within --bound seconds is a
start that never reached its first step: the run records which ranks, the agents' last lines and
(with py-spy installed) the stuck processes' stacks, then ends, since the job is wedged. Prints one
JSON object; exit 1 when any start failed.

    python bench/warm_stress.py --cycles 200 [--nodes 2 --ranks 4]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from recovery import summary  # noqa: E402
from unmodified import TRAIN, Nodes, launcher_argv, muster_coordinator  # noqa: E402

from muster import logs  # noqa: E402
from muster.local import wait_until  # noqa: E402


def start_job(workdir: Path, coordinator: str, nodes: int, ranks: int, cycles: int) -> Nodes:
    tag = uuid.uuid4().hex
    env = {**os.environ, "MUSTER_BENCH_RUN": tag, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    script = [str(TRAIN), "--steps", str(10**9), "--step-sleep", "0.05",
              "--checkpoint-dir", str(workdir / "checkpoints"), "--checkpoint-every", "5"]
    # (a SIGKILLed rank starts no crash loop: restarted at once, however soon the kills come)
    return Nodes([launcher_argv("muster-run", i, nodes, ranks // nodes, 3 * cycles + 10, tag, coordinator, script)
                  for i in range(nodes)], env, workdir, "node", tag)


def stuck_report(job: Nodes, mark: list[int], old: set[int]) -> dict:
    """What the ranks that never reached their first step were doing."""
    stepped = {r["pid"] for r in job.records_since(mark)}
    stuck = sorted(job.workers() - old - stepped)
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    stacks = {}
    for pid in stuck[:8]:
        if os.path.exists(spy):
            done = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30)
            stacks[pid] = (done.stdout or done.stderr)[-3000:]
    tails = {a.index: a.log_path.read_text(errors="replace").splitlines()[-40:] for a in job.agents}
    return {"stuck_pids": stuck,
            "ranks_stepping": sorted({r["rank"] for r in job.records_since(mark) if r["pid"] not in old}),
            "stacks": stacks, "agent_log_tails": tails}


def cycles(job: Nodes, ranks: int, count: int, bound_s: float, result: dict) -> None:
    recoveries, starts = [], 0
    kinds = {"stepping": 0, "starting": 0}
    wait_until(job.stepping_from_new_processes([0] * len(job.agents), set(), ranks), 180, "the job's first steps")
    for i in range(count):
        old = job.workers()
        mark = job.marks()
        current = {r["rank"]: r["pid"] for r in job.records_since([0] * len(job.agents))}
        victim = current[random.randrange(ranks)]
        killed_at = time.time()
        os.kill(victim, signal.SIGKILL)
        kinds["stepping"] += 1
        if random.random() < 0.5:  # hit the restart itself: a rank forked after the kill, soon after
            fresh = wait_until(lambda: sorted(job.workers() - old) or None, bound_s, "a restarted rank", 0.005)
            time.sleep(random.uniform(0, 0.3))
            target = random.choice(fresh)
            try:
                os.kill(target, signal.SIGKILL)
                kinds["starting"] += 1
            except ProcessLookupError:
                pass
        try:
            firsts = wait_until(job.stepping_from_new_processes(mark, old, ranks), bound_s,
                                "every rank stepping from a new process")
        except AssertionError:
            result["no_first_step"] = {"cycle": i, **stuck_report(job, mark, old)}
            raise
        starts += len(firsts)
        recoveries.append(max(r["time"] for r in firsts.values()) - killed_at)
        result.update(cycles=i + 1, kills=kinds, rank_starts_reached_first_step=starts,
                      kill_to_step_s=summary(recoveries))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cycles", type=int, default=200)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--bound", type=float, default=60.0, help="seconds for every rank to step again after a kill")
    p.add_argument("--workdir", type=Path, help="keep the logs here (default: a temporary directory)")
    args = p.parse_args()
    logs.configure("warning")
    result: dict = {"benchmark": "warm_stress", "script": TRAIN.name, "nodes": args.nodes, "ranks": args.ranks,
                    "bound_s": args.bound, "cycles": 0, "host": {"cpus": os.cpu_count(),
                                                                 "loadavg_at_start": list(os.getloadavg())}}
    rc, began = 0, time.time()
    with tempfile.TemporaryDirectory(prefix="muster-bench-warm-") as d:
        workdir = args.workdir or Path(d)
        workdir.mkdir(parents=True, exist_ok=True)
        with muster_coordinator(workdir) as coordinator:
            job = start_job(workdir, coordinator, args.nodes, args.ranks, args.cycles)
            try:
                cycles(job, args.ranks, args.cycles, args.bound, result)
            except (RuntimeError, AssertionError) as exc:
                result["error"] = str(exc)
                rc = 1
            finally:
                result["workers_left_after_stop"] = job.stop()
    result["seconds"] = round(time.time() - began, 1)
    print(json.dumps(result, indent=2))
    return rc


if __name__ == "__main__":
    sys.exit(main())
