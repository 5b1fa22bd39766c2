"""FSDP2 on an HSDP mesh (2 replica groups x 2 shards by default) under the Muster worker library:
a lost rank's shard is taken from the other replica group, the job keeps training in place.
    MUSTER_COORDINATOR=127.0.0.1:7600 MUSTER_JOB=hsdp python examples/train_hsdp.py --steps 100
(run 4 ranks; a 5th waits as a spare. A replica group that loses a rank leaves the mesh, and the
other trains on, until a replacement or the spare fills the slot.) The model and optimizer are built
by `build(mesh)`, which the library calls on each generation's mesh: the loop takes `worker.model`
and `worker.optimizer` afresh every step, and its data by `worker.mesh_slot`. Each rank logs one
JSON line per completed step, with its mesh slot, the replica groups training, and the fingerprint
of its shards (equal across replicas).
"""

from __future__ import annotations

import argparse
import sys
import time

import structlog
import torch
from torch.distributed.fsdp import fully_shard

from muster import logs
from muster.worker import Replicas, RunEnded, Worker, WorkerConfig, WorkerError
from muster.worker.outcome import exit_code

WIDTH = 32


class DataPosition:
    """The data loader's position: part of the state, so a replacement resumes where the others are."""

    def __init__(self):
        self.epoch = 0

    def state_dict(self):
        return {"epoch": self.epoch}

    def load_state_dict(self, state):
        self.epoch = state["epoch"]


def build(mesh) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model sharded over `mesh` (seeded: every replica starts from the same weights)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def batch(step: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic per (step, mesh slot): a redone step, or a replacement in the slot, sees the same data."""
    g = torch.Generator().manual_seed(step * 1_000_003 + slot * 7919)
    x = torch.randn(16, WIDTH, generator=g)
    return x, x.sum(dim=1, keepdim=True)


def train_step(worker: Worker) -> torch.Tensor:
    # the slot: the mesh holds only the replica groups training now (batches are made on the CPU: the same bits anywhere)
    x, y = (t.to(worker.device) for t in batch(worker.step, worker.mesh_slot))
    loss = torch.nn.functional.mse_loss(worker.model(x), y)
    loss.backward()
    worker.optimizer.step()
    worker.optimizer.zero_grad()
    return loss


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds of simulated compute per step")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--shards", type=int, default=2)
    args = p.parse_args(argv)
    logs.configure("info", json=True)
    log = structlog.get_logger("train_hsdp")
    layout = Replicas(args.replicas, args.shards)
    data = DataPosition()
    try:
        worker = Worker(WorkerConfig.from_env()).register(build=build, layout=layout, data=data)
        worker.start()
        while worker.step < args.steps:
            with worker.step_scope() as step:
                time.sleep(args.step_sleep)
                loss = train_step(worker)
                data.epoch = worker.step + 1  # inside the scope: a reform or snapshot at its end takes it
            if not step.completed:
                continue  # discarded by a membership change: redone on the new mesh
            log.info("step", step=worker.step, rank=worker.rank, slot=worker.mesh_slot, replicas=worker.mesh.size(0),
                     world_size=worker.world_size, generation=worker.generation,
                     digest=worker.state.fingerprint(worker.device).hex(), loss=round(loss.item(), 6))
        worker.close()
    except RunEnded as exc:
        log.info("training_ended", step=worker.step, outcome=exc.outcome, reason=exc.reason)
        worker.close(leave=False)
        return exit_code(exc.outcome)
    except WorkerError as exc:
        log.error("training_stopped", error=str(exc))
        return 3
    log.info("training_finished", steps=worker.step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
