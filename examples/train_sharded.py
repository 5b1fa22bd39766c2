"""Sharding without replicas under the Muster worker library: FSDP2 over a 1-D mesh of the whole job
(default) or ZeRO-1 (`--zero`: the model replicated under DDP, a ZeroRedundancyOptimizer whose state
is sharded). Each rank's shard is copied to a peer every `--every` steps; a lost rank's slot is
refilled from that copy and every rank rolls back to it, in place.
    MUSTER_COORDINATOR=127.0.0.1:7600 MUSTER_JOB=fsdp python examples/train_sharded.py --steps 100
(run `--shards` ranks, 4 by default; one more waits as a spare). The loop takes `worker.model` and
`worker.optimizer` afresh every step (a reform builds new ones) and indexes its data by mesh slot and
`worker.step`, which goes back after a rollback. Each rank logs one JSON line per completed step; the
last one carries the fingerprint of its shard.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import structlog
import torch

from muster import logs
from muster.examples.train_ddp import DataPosition  # (part of each snapshot: replayed steps see the same batches)
from muster.worker import Checkpoints, RunEnded, Snapshots, Worker, WorkerConfig, WorkerError
from muster.worker.outcome import exit_code


STALL_S = 60.0


def builder(width: int, layers: int, zero: bool, device: torch.device):
    """`build(mesh)` for the worker: seeded, so every rank starts from the same weights."""
    def build(mesh):
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.optim import ZeroRedundancyOptimizer

        torch.manual_seed(0)
        model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)), torch.nn.Linear(width, 1))
        if zero:  # the model replicated (DDP over the mesh's group), Adam's state sharded by mesh slot
            model.to(device)  # (fully_shard moves FSDP2's to the mesh's device itself)
            return model, ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam,
                                                  process_group=mesh.get_group(), lr=1e-3)
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)
    return build


def batch(step: int, slot: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic per (step, slot): a replayed step, or a replacement in the slot, sees the same data."""
    g = torch.Generator().manual_seed(step * 1_000_003 + slot * 7919)
    x = torch.randn(16, width, generator=g)
    return x, x.sum(dim=1, keepdim=True) / width


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds of simulated compute per step")
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--every", type=int, default=Snapshots(2).every, help="steps between peer snapshots")
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--zero", action="store_true", help="ZeRO-1 (ZeroRedundancyOptimizer) instead of FSDP2")
    p.add_argument("--stall-at-step", type=int, default=0, metavar="N",
                   help="tests: the first process in mesh slot 0 sleeps STALL_S inside step N, a rank stuck in a step")
    p.add_argument("--checkpoint-dir", default="", help="the library checkpoints the state there (durable tier)")
    p.add_argument("--checkpoint-every", type=int, default=8, help="steps between checkpoints")
    args = p.parse_args(argv)
    logs.configure("info", json=True)
    log = structlog.get_logger("train_sharded")
    data = DataPosition()
    first_process = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"  # of its slot, under `muster run`
    try:
        worker = Worker(WorkerConfig.from_env())
        worker.register(build=builder(args.width, args.layers, args.zero, worker.device),
                        layout=Snapshots(args.shards, args.every), data=data,
                        checkpoint=Checkpoints(args.checkpoint_dir, args.checkpoint_every) if args.checkpoint_dir else None)
        worker.start()
        while worker.step < args.steps:
            began = time.perf_counter()
            with worker.step_scope() as step:
                time.sleep(args.step_sleep)
                slot = worker.mesh_slot
                if slot == 0 and first_process and worker.step + 1 == args.stall_at_step:
                    log.info("stalling", step=worker.step + 1, seconds=STALL_S)
                    time.sleep(STALL_S)
                x, y = (t.to(worker.device) for t in batch(worker.step, slot, args.width))  # made on the CPU
                # (one gradient per DDP bucket: a DDP rebuilt after a reform starts from its initial bucket
                # layout, and on > 2 ranks another layout sums in another order, last bits apart)
                model = worker.ddp(worker.model, bucket_cap_mb_list=[1e-6]) if args.zero else worker.model
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                worker.optimizer.step()
                worker.optimizer.zero_grad()
                data.epoch = worker.step + 1  # inside the scope: a reform or snapshot at its end takes it
            if not step.completed:
                continue  # discarded by a membership change: redone (or rolled back) on the new mesh
            last = {"digest": worker.state.fingerprint(worker.device).hex()} if worker.step == args.steps else {}
            log.info("step", step=worker.step, rank=worker.rank, slot=slot, world_size=worker.world_size,
                     generation=worker.generation, loss=round(loss.item(), 6),
                     seconds=round(time.perf_counter() - began, 5), **last)
        worker.close()
    except RunEnded as exc:
        log.info("training_ended", step=worker.step, outcome=exc.outcome, reason=exc.reason)
        worker.close(leave=False)
        return exit_code(exc.outcome)
    except WorkerError as exc:
        log.error("training_stopped", error=str(exc), kind=type(exc).__name__)
        return 3
    log.info("training_finished", steps=worker.step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
