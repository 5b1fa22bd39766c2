"""Kill -9 one rank of N (repeatedly; a replacement joins in between) and measure, from the kill,
until every survivor has completed a step in the new group. Also: completed steps lost, and the
per-step cost of the worker API on the training thread. Prints one JSON object.

    python bench/recovery.py --ranks 8 --kills 8
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from muster import logs
from muster.coordinator.etcd_server import EtcdServer
from muster.testing import CoordinatorProcess, TrainingProcess, record_time, wait_until
from muster.worker import Worker, WorkerConfig


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def step_api_cost_us(iterations: int = 200_000, batches: int = 9) -> dict:
    """The training thread's cost of `with worker.step_scope():` (no network on this thread)."""
    worker = Worker(WorkerConfig(coordinators=("127.0.0.1:1",), job="bench", node_id="bench"))
    scope = worker.step_scope()
    samples = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(iterations):
            pass
        empty = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(iterations):
            with scope:
                pass
        samples.append((time.perf_counter() - t0 - empty) / iterations * 1e6)
    return {"median_us": round(statistics.median(samples), 3), "max_us": round(max(samples), 3),
            "iterations": iterations * batches}


def kill_cycles(workdir: Path, ranks: int, kills: int, step_sleep_s: float) -> dict:
    etcd = EtcdServer(workdir / "etcd").start()
    coordinator = CoordinatorProcess([etcd.endpoint], workdir / "coordinator.log", ["--heartbeat-timeout", "2.0"]).start()
    procs: list[TrainingProcess] = []

    def launch(n: int) -> list[TrainingProcess]:
        new = [TrainingProcess([coordinator.address], "bench", workdir / f"rank-{len(procs) + i}.log",
                               steps=10**9, step_sleep_s=step_sleep_s, min_nodes=ranks - 1, max_nodes=ranks).start()
               for i in range(n)]
        procs.extend(new)
        return new

    def alive() -> list[TrainingProcess]:
        return [p for p in procs if p.proc.poll() is None]

    def world(p: TrainingProcess) -> tuple[int, int]:
        s = p.steps()
        return (s[-1]["generation"], s[-1]["world_size"]) if s else (0, 0)

    recoveries, lost, reform_s = [], [], []
    fenced = 0  # survivors that did not make it into the new group (should be 0)
    try:
        launch(ranks)
        wait_until(lambda: all(world(p)[1] == ranks and p.last_step > 5 for p in alive()), 120, "all ranks stepping")
        for _ in range(kills):
            live = alive()
            victim = random.choice(live)
            survivors = [p for p in live if p is not victim]
            generation = max(world(p)[0] for p in live)
            completed_before = max(p.last_step for p in live)
            killed_at = time.time()
            victim.signal(signal.SIGKILL)
            victim.wait(10)

            def first_new_steps():
                firsts = []
                for p in survivors:
                    new = [r for r in p.steps() if r["generation"] > generation]
                    if new:
                        firsts.append(new[0])
                    elif p.proc.poll() is None:
                        return None  # still reforming
                return firsts

            firsts = wait_until(first_new_steps, 60, "survivors stepping in the new group")
            fenced += sum(1 for p in survivors if p.proc.poll() is not None)
            recoveries.append(max(record_time(r) for r in firsts) - killed_at)
            lost.append(max(0, completed_before - min(r["step"] for r in firsts) + 1))
            reform_s += [r["seconds"] for p in survivors for r in p.records("group_formed")
                         if r["generation"] > generation][: len(survivors)]
            launch(ranks - len(alive()))
            wait_until(lambda: len(alive()) == ranks and all(world(p)[1] == ranks for p in alive()),
                       120, "replacements joined")
        return {
            "ranks": ranks,
            "kills": kills,
            "kill_to_step_s": {"p50": round(statistics.median(recoveries), 4),
                               "p99": round(percentile(recoveries, 0.99), 4),
                               "max": round(max(recoveries), 4), "all": [round(r, 4) for r in recoveries]},
            "reform_s_median": round(statistics.median(reform_s), 4),
            "steps_lost": {"max": max(lost), "total": sum(lost)},
            "survivors_lost": fenced,
        }
    finally:
        for p in procs:
            p.stop()
        coordinator.stop()
        etcd.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--kills", type=int, default=8)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--workdir", type=Path, help="keep the logs here (default: a temporary directory)")
    args = p.parse_args()
    logs.configure("warning")
    with tempfile.TemporaryDirectory(prefix="muster-bench-") as d:
        workdir = args.workdir or Path(d)
        workdir.mkdir(parents=True, exist_ok=True)
        result = {"benchmark": "recovery", "step_api": step_api_cost_us(),
                  **kill_cycles(workdir, args.ranks, args.kills, args.step_sleep)}
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
