"""A DDP model trained with the Muster worker library: gloo on CPU (NCCL with CUDA). Tiny by
default; `--model 17M|50M|100M|134M|537M` trains square Linear layers with Adam, for real state sizes.

Each rank logs one JSON line per completed step (rank, step, generation, world size, pid, the
state's fingerprint) to stdout, which the chaos tests, the demo and the benchmarks read.
    MUSTER_COORDINATOR=127.0.0.1:7600 MUSTER_JOB=demo python -m muster.examples.train_ddp --steps 100
"""

from __future__ import annotations

import argparse
import sys
import time

import structlog
import torch

from muster import logs
from muster.worker import Checkpoints, Drained, RunEnded, Worker, WorkerConfig, WorkerError
from muster.worker.outcome import exit_code


class DataPosition:
    """The data loader's position: part of the state, so a joiner resumes where the others are."""

    def __init__(self):
        self.epoch = 0

    def state_dict(self):
        return {"epoch": self.epoch}

    def load_state_dict(self, state):
        self.epoch = state["epoch"]


COMPUTE_SLICE_S = 0.002


def simulated_compute(seconds: float) -> None:
    """Sleep in 2 ms slices: like real work, it takes longer when the process is slowed from outside
    (SIGSTOP on a duty cycle, `muster.local.Throttle`); one long sleep ends on time however long
    the process was stopped meanwhile."""
    slices = max(1, round(seconds / COMPUTE_SLICE_S)) if seconds > 0 else 0
    for _ in range(slices):
        time.sleep(seconds / slices)


# Square Linear layers (width, layers): 17M = 4 x 2048^2, 50M = 3 x 4096^2, 100M = 6 x 4096^2,
# 134M = 8 x 4096^2, 537M = 8 x 8192^2 parameters; with Adam, 12 bytes of state per parameter
# (weights and two moments).
MODELS = {"tiny": (32, 0), "17M": (2048, 4), "50M": (4096, 3), "100M": (4096, 6), "134M": (4096, 8),
          "537M": (8192, 8)}


def parameter_count(name: str) -> int:
    """The parameters `build(name)` makes, without making them."""
    width, layers = MODELS[name]
    return layers * (width * width + width) if layers else 32 * 64 + 64 + 64 + 1


def build(name: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    width, layers = MODELS[name]
    if not layers:
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
        return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    return model, torch.optim.Adam(model.parameters(), lr=1e-5)


def batch(step: int, rank: int, world_size: int, width: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic per (step, rank, world size): a redone step sees the same data."""
    g = torch.Generator().manual_seed(step * 1_000_003 + rank * 7919 + world_size)
    x = torch.randn(16, width, generator=g)
    return x, x.sum(dim=1, keepdim=True) if width == 32 else x


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds of simulated compute per step")
    p.add_argument("--grow-to", type=int, default=0, metavar="W",
                   help="train until the group has W ranks (a node joined), then --steps steps more; "
                        "every rank stops at the same step, the joiner too")
    p.add_argument("--model", choices=list(MODELS), default="tiny",
                   help="the model's size (default tiny): the others are square Linear layers with Adam")
    p.add_argument("--digest-every", type=int, default=1, metavar="N",
                   help="log the state's fingerprint every N steps (0: never; it reads all the state)")
    p.add_argument("--perturb-at-step", type=int, default=0,
                   help="fault injection: nudge this rank's parameters after that step (divergence detection)")
    p.add_argument("--checkpoint-dir", default="", help="the library checkpoints the state there (durable tier)")
    p.add_argument("--checkpoint-every", default="auto", help="steps between checkpoints, or auto")
    args = p.parse_args(argv)
    logs.configure("info", json=True)
    log = structlog.get_logger("train_ddp")
    every = args.checkpoint_every if args.checkpoint_every == "auto" else int(args.checkpoint_every)
    checkpoint = Checkpoints(args.checkpoint_dir, every=every) if args.checkpoint_dir else None

    torch.manual_seed(0)
    model, optimizer = build(args.model)
    width = MODELS[args.model][0]
    data = DataPosition()
    try:
        worker = Worker(WorkerConfig.from_env()).register(model=model, optimizer=optimizer, data=data,
                                                          checkpoint=checkpoint)
        model.to(worker.device)  # before start: NCCL exchanges the state as tensors on this rank's GPU
        worker.start()
        stop_at = None if args.grow_to else args.steps
        while stop_at is None or worker.step < stop_at:
            if stop_at is None and worker.world_size >= args.grow_to:
                stop_at = worker.step + args.steps  # the step the grown group formed at: the same on every rank
            with worker.step_scope() as step:
                simulated_compute(args.step_sleep)
                x, y = (t.to(worker.device) for t in batch(worker.step, worker.rank, worker.world_size, width))
                loss = torch.nn.functional.mse_loss(worker.ddp(model)(x), y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                data.epoch = worker.step + 1  # inside the scope: the state a checkpoint takes at its end has it
            if not step.completed:
                continue  # discarded by a membership change: redo it in the new group
            if worker.step == args.perturb_at_step:
                with torch.no_grad():
                    next(model.parameters()).add_(1e-3)
            digest = (worker.state.fingerprint(worker.device).hex()
                      if args.digest_every and worker.step % args.digest_every == 0 else None)
            log.info("step", step=worker.step, rank=worker.rank, world_size=worker.world_size,
                     generation=worker.generation, digest=digest, loss=round(loss.item(), 6), position=data.epoch)
        worker.close()
    except Drained as exc:  # this node leaves the job (graceful drain): a clean end here
        log.info("training_drained", step=worker.step, reason=str(exc))
        worker.close(leave=False)
        return 0
    except RunEnded as exc:  # the job's run ended (an operator stopped it, or it failed elsewhere)
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
