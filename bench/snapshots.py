"""Peer snapshots (issue 42 part 3): what they cost a sharded job without replicas, and what they buy.
examples/train_sharded.py (FSDP2 over a 1-D mesh of --shards ranks, standalone ranks against a real
etcd and coordinator) at each model size (square Linear layers + Adam, CPU, gloo). Per size:

  step_s            step time with snapshots every K steps (the default K) and without (a snapshot
                    only at the first formation), from the ranks' step records (the first steps
                    left out) of --rounds pairs of jobs, run with-without-without-with...: the
                    median, and the mean, which counts the 1 step in K that takes a snapshot;
                    overhead = with / without - 1 of each (the target: <= 0.02)
  take_s            the training thread's part of a snapshot: the copy into host memory and the
                    send posted (median), and per_step = take_s / K / step_s
  memory_mib        host memory a rank's snapshots take (two of its own, two of its predecessor's),
                    and its shard of the state (local parameters, Adam's state, extras)
  recovery          a rank SIGKILLed K / 2 steps past a snapshot, the spare taking its slot:
                    kill_to_step_s (kill -> every survivor has completed a step in the new
                    generation), steps_redone (the survivors' rollback), bytes the spare received

The timings come from a shared, noisy machine: the step time ratio moves by a few percent from run
to run, take_s's share is the steadier figure.

    python bench/snapshots.py [--sizes small,17M --steps 25 --rounds 2]
    python bench/snapshots.py --sizes tiny --steps 12 --rounds 1    (a quick check)
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from muster import logs
from muster.coordinator.etcd.server import EtcdServer
from muster.local import (CoordinatorProcess, TrainingProcess, end_on_sigterm, record_time,
                          spare_victim_survivors, wait_until)
from muster.worker.library.snapshots import EVERY

SCRIPT = str(Path(__file__).resolve().parents[1] / "examples" / "train_sharded.py")
SIZES = {"small": (512, 4), "17M": (2048, 4), "tiny": (32, 2)}  # (width, layers): 1.05M, 16.8M, 2k parameters
SKIP = 3  # first steps left out of the medians (the first formation, first allocations)


def parameters(width: int, layers: int) -> int:
    return layers * (width * width + width) + width + 1


class Jobs:
    """The jobs' ranks, against one coordinator; all of them stopped at the end, whatever happened."""

    def __init__(self, coordinator: str, workdir: Path):
        self.coordinator, self.workdir, self.started = coordinator, workdir, []

    def run(self, job: str, n: int, steps: int, args: tuple[str, ...]) -> list[TrainingProcess]:
        ranks = [TrainingProcess([self.coordinator], job, self.workdir / f"{job}-{i}.log", steps=steps, step_sleep_s=0.0,
                                 args=args, script=SCRIPT).start()
                 for i in range(n)]
        self.started.extend(ranks)
        return ranks

    def stop(self) -> None:
        for p in self.started:
            p.stop()


def finish(ranks: list[TrainingProcess], timeout_s: float) -> None:
    for p in ranks:
        code = p.wait(timeout_s)
        if code != 0:
            raise RuntimeError(f"{p.log_path.name} exited {code}: {p.log_path.read_text()[-2000:]}")


def step_times(ranks: list[TrainingProcess]) -> dict[str, float]:
    """The median step (what most steps take) and the mean (which counts the 1 in K that snapshots)."""
    times = [r["seconds"] for p in ranks for r in p.steps() if r["step"] > SKIP]
    return {"median": round(statistics.median(times), 4), "mean": round(statistics.fmean(times), 4)}


def cost(jobs: Jobs, name: str, shards: int, steps: int, size: tuple[str, ...], rounds: int) -> dict:
    """Step times with and without snapshots: jobs one after the other, with-without-without-with...
    (a drift in the machine's load weighs on both alike)."""
    runs: dict[str, list[TrainingProcess]] = {"with": [], "without": []}
    variants = [v for r in range(rounds) for v in (("with", "without"), ("without", "with"))[r % 2]]
    for i, variant in enumerate(variants):
        every = EVERY if variant == "with" else 10**9
        ranks = jobs.run(f"{name}-{variant}-{i}", shards, steps, (*size, "--every", str(every)))
        finish(ranks, 600)
        runs[variant].extend(ranks)
    with_, without = runs["with"], runs["without"]
    takes = [r for p in with_ for r in p.records("snapshot_taken") if r["step"] > 0]
    step_with, step_without = step_times(with_), step_times(without)
    take = statistics.median(r["seconds"] for r in takes)
    return {"step_s": {"with": step_with, "without": step_without,
                       "overhead": {k: round(step_with[k] / step_without[k] - 1, 4) for k in step_with}},
            "take_s": {"median": round(take, 5), "per_step": round(take / EVERY / step_with["median"], 5)},
            "memory_mib": {"snapshots": max(r["memory_mib"] for r in takes),
                           "shard": max(r["shard_mib"] for r in takes)}}


def recovery(jobs: Jobs, name: str, shards: int, size: tuple[str, ...]) -> dict:
    """A rank killed EVERY / 2 steps past the snapshot at EVERY; the spare takes its slot."""
    kill_at, steps = EVERY + EVERY // 2, 2 * EVERY + 2
    ranks = jobs.run(f"{name}-kill", shards + 1, steps, (*size, "--every", str(EVERY)))
    wait_until(lambda: sum(p.last_step >= kill_at for p in ranks) == shards, 600, f"{shards} ranks at step {kill_at}",
               interval_s=0.05)
    spare, victim, survivors = spare_victim_survivors(ranks, 1, jobs.coordinator, f"{name}-kill")
    generation = victim.steps()[-1]["generation"]
    killed_at = time.time()
    victim.signal(signal.SIGKILL)
    finish(survivors + [spare], 600)
    stepping = max(min(record_time(r) for r in p.steps() if r["generation"] > generation) for p in survivors)
    reformed = [r for p in survivors for r in p.records("group_formed") if r["generation"] > generation]
    took = [r for r in spare.records("group_formed") if r["generation"] > generation]
    return {"killed_at_step": victim.last_step, "kill_to_step_s": round(stepping - killed_at, 3),
            "steps_redone": max(r["steps_behind"] for r in reformed), "rolled_back_to": reformed[0]["step"],
            "spare_received_bytes": took[0]["bytes_received"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="small,17M", help=f"comma-separated, of {', '.join(SIZES)}")
    p.add_argument("--steps", type=int, default=25, help=f"steps of each cost job (more than K = {EVERY})")
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2, help="pairs of cost jobs (with and without snapshots)")
    args = p.parse_args(argv)
    unknown = set(args.sizes.split(",")) - set(SIZES)
    if args.rounds < 1:
        p.error("--rounds: at least 1")
    if args.steps <= EVERY:
        p.error(f"--steps: more than K = {EVERY}, so that a snapshot is taken while training")
    if unknown:
        p.error(f"--sizes: no size {sorted(unknown)[0]!r}; known: {', '.join(SIZES)}")
    logs.configure("warning")
    out: dict = {"every": EVERY, "shards": args.shards, "sizes": {}}
    with tempfile.TemporaryDirectory(prefix="muster-snapshots-") as tmp:
        workdir = Path(tmp)
        etcd = EtcdServer(workdir / "etcd").start()
        coordinator = CoordinatorProcess([etcd.endpoint], workdir / "coordinator.log",
                                         ["--heartbeat-timeout", "2.0"]).start()
        jobs = Jobs(coordinator.address, workdir)
        try:
            for name in args.sizes.split(","):
                width, layers = SIZES[name]
                size = ("--width", str(width), "--layers", str(layers))
                out["sizes"][name] = {"parameters": parameters(width, layers),
                                      **cost(jobs, name.lower(), args.shards, args.steps, size, args.rounds),
                                      "recovery": recovery(jobs, name.lower(), args.shards, size)}
                print(json.dumps({name: out["sizes"][name]}), file=sys.stderr)
        finally:
            jobs.stop()
            coordinator.stop()
            etcd.stop()
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    end_on_sigterm()
    sys.exit(main())
