"""HSDP recovery with no spare (issue 42 parts 2 and 6): a 2 x 2 FSDP2 job (4 standalone ranks of
this file's rank loop, the worker library, gloo on CPU) against a real etcd and coordinator loses a
rank, later a whole replica group (a node's worth). The lost group leaves the mesh and the other
replica trains alone; replacements started later fill the slots and the group rejoins, healing from
the healthy replica. At each model size it prints, per loss:

  kill_to_training_s   the kill -> both healthy ranks have completed a step on the smaller mesh
  healthy_steps_lost   completed steps the healthy replica rolled back (0: only the step in flight
                       at the kill is discarded and redone, `in_flight_redone`)
  steps_alone          steps the healthy replica trained while the group was out
  join_to_rejoined_s   the last replacement joined the job -> every rank has completed a step on
                       the whole mesh again (its start, an interpreter and torch, is not counted)
  healthy_pause_s      the healthy ranks' longest gap between steps across the rejoin
  rejoin               the healthy ranks' reform at the rejoin (mesh, the model re-wrapped by
                       `build`, their own shards restored) and the bytes the stale ranks received

    python bench/hsdp.py [--sizes 1M,17M] [--out bench/results/hsdp.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from muster.coordinator.etcd.server import EtcdServer
from muster.local import CoordinatorProcess, TrainingProcess, end_on_sigterm, json_lines, record_time, wait_until

SIZES = {"1M": (512, 4), "17M": (2048, 4)}  # width, layers: layers x width^2 parameters
BATCH = 8
ALONE_STEPS = 8  # the healthy replica trains this many steps alone before the replacements start


def build_for(width: int, layers: int):
    def build(mesh):
        import torch
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.Adam(model.parameters(), lr=1e-4)
    return build


def rank_main(args: argparse.Namespace) -> int:
    """One rank: the worker library around an FSDP2 loop, one JSON line per completed step."""
    import torch

    from muster import logs
    from muster.worker import Replicas, RunEnded, Worker, WorkerConfig

    logs.configure("info", json=True)
    worker = Worker(WorkerConfig.from_env()).register(build=build_for(args.width, args.layers), layout=Replicas(2, 2))
    try:
        worker.start()
        while worker.step < args.steps:
            with worker.step_scope() as step:
                g = torch.Generator().manual_seed(worker.step * 1_000_003 + worker.mesh_slot)
                worker.model(torch.randn(BATCH, args.width, generator=g)).square().mean().backward()
                worker.optimizer.step()
                worker.optimizer.zero_grad()
            if step.completed:
                print(json.dumps({"event": "step", "step": worker.step, "slot": worker.mesh_slot,
                                  "replicas": worker.mesh.size(0), "generation": worker.generation,
                                  "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) +
                                  f".{int(time.time() % 1 * 1e6):06d}Z"}), flush=True)
        worker.close()
    except RunEnded:
        worker.close(leave=False)
    return 0


class Job:
    """etcd, one coordinator and the ranks of one HSDP job."""

    def __init__(self, workdir: Path, width: int, layers: int):
        self.workdir, self.width, self.layers = workdir, width, layers
        self.etcd = EtcdServer(workdir / "etcd").start()
        self.coordinator = CoordinatorProcess([self.etcd.endpoint], workdir / "coordinator.log",
                                              ["--heartbeat-timeout", "2.0"]).start()
        self.ranks: list[TrainingProcess] = []

    def start(self, n: int) -> list[TrainingProcess]:
        new = []
        for _ in range(n):
            p = TrainingProcess([self.coordinator.address], "hsdp", self.workdir / f"rank-{len(self.ranks)}.log",
                                steps=10**9, step_sleep_s=0.0, min_nodes=2, max_nodes=4,
                                args=("--rank", "--width", str(self.width), "--layers", str(self.layers)),
                                script=Path(__file__).resolve())
            self.ranks.append(p.start())
            new.append(p)
        return new

    def stop(self) -> None:
        for p in self.ranks:
            p.stop()
        self.coordinator.stop()
        self.etcd.stop()


def whole_mesh_after(ranks: list[TrainingProcess], t: float) -> bool:
    return all(any(r["replicas"] == 2 and record_time(r) > t for r in p.steps()[-3:]) for p in ranks)


def lose(job: Job, slots: list[int]) -> dict:
    """Kill the ranks in `slots` (one replica group's), let the other train alone, start their
    replacements and wait for the group to rejoin."""
    by_slot = {p.steps()[-1]["slot"]: p for p in job.ranks if p.proc.poll() is None and p.steps()}
    healthy = [by_slot[s] for s in (2, 3)]
    killed_at = time.time()
    for s in slots:
        by_slot[s].signal(signal.SIGKILL)
    alone = lambda p: [r for r in p.steps() if r["replicas"] == 1 and record_time(r) > killed_at]  # noqa: E731
    wait_until(lambda: all(len(alone(p)) >= ALONE_STEPS for p in healthy), 120, "the healthy replica alone")
    trained = max(record_time(alone(p)[0]) for p in healthy)
    replacements = job.start(len(slots))
    wait_until(lambda: all(json_lines(p.log_path, "node_joined") for p in replacements), 120, "the replacements")
    joined = max(record_time(json_lines(p.log_path, "node_joined")[0]) for p in replacements)
    live = [p for p in job.ranks if p.proc.poll() is None]
    wait_until(lambda: whole_mesh_after(live, joined), 120, "the group rejoined", interval_s=0.1)
    rejoined = max(min(record_time(r) for r in p.steps() if r["replicas"] == 2 and record_time(r) > joined)
                   for p in live)
    formed = [json_lines(p.log_path, "group_formed")[-1] for p in healthy]
    stale = [p for p in live if p not in healthy]
    steps = [[r for r in p.steps() if killed_at - 5 < record_time(r) < rejoined + 5] for p in healthy]
    return {
        "kill_to_training_s": round(trained - killed_at, 3),
        "healthy_steps_lost": max(r["steps_behind"] for p in healthy for r in json_lines(p.log_path, "group_formed")
                                  if record_time(r) > killed_at),
        "in_flight_redone": max(len([r for r in json_lines(p.log_path, "step_discarded") if record_time(r) > killed_at])
                                for p in healthy),
        "steps_alone": min(len(alone(p)) for p in healthy),
        "join_to_rejoined_s": round(rejoined - joined, 3),
        "healthy_pause_s": round(max(record_time(b) - record_time(a) for s in steps for a, b in zip(s, s[1:])
                                     if record_time(b) > joined), 3),
        "rejoin": {"healthy_reform_s": round(max(r["seconds"] for r in formed), 3),
                   "mesh_s": round(max(r["mesh_s"] for r in formed), 4),
                   "build_s": round(max(r["build_s"] for r in formed), 4),
                   "restore_s": round(max(r["restore_s"] for r in formed), 4),
                   "bytes_received_per_stale_rank": [json_lines(p.log_path, "group_formed")[-1]["bytes_received"]
                                                     for p in stale],
                   "healthy_bytes_received": sum(r["bytes_received"] for r in formed)},
    }


def run_size(name: str, workdir: Path) -> dict:
    width, layers = SIZES[name]
    job = Job(workdir, width, layers)
    try:
        job.start(4)
        wait_until(lambda: all(p.last_step >= 5 for p in job.ranks), 240, "4 ranks past step 5", interval_s=0.1)
        step_s = [record_time(b) - record_time(a) for a, b in zip(job.ranks[0].steps()[-4:], job.ranks[0].steps()[-3:])]
        return {"parameters": layers * width * width, "step_s": round(sorted(step_s)[len(step_s) // 2], 4),
                "a_rank": lose(job, [1]), "a_replica_group": lose(job, [0, 1])}
    finally:
        job.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1M,17M", help=f"comma-separated, of {', '.join(SIZES)}")
    p.add_argument("--out", type=Path, help="also write the JSON here")
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)  # (one rank of the job)
    p.add_argument("--width", type=int, default=512, help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, default=4, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=10**9, help=argparse.SUPPRESS)
    p.add_argument("--step-sleep", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank:
        return rank_main(args)
    sizes = args.sizes.split(",")
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        p.error(f"unknown size(s) {unknown}: choose from {', '.join(SIZES)}")
    result = {"benchmark": "hsdp", "layout": "2 replicas x 2 shards, standalone ranks, no spare",
              "host": {"cpus": os.cpu_count(), "loadavg_at_start": [round(x, 2) for x in os.getloadavg()]}}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="muster-hsdp-") as tmp:
        for name in sizes:
            result[name] = run_size(name, Path(tmp) / name)
    result["seconds"] = round(time.monotonic() - started)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    end_on_sigterm()
    sys.exit(main())
