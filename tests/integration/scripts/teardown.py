"""A plain DDP script (env://, gloo, no Muster code) whose rank 0 (or the ranks named, RANK=KIND,...)
misbehaves in interpreter teardown once its steps are done, as torch/gloo destructors do under
Hugging Face's Trainer:
--teardown abort: a global object's __del__ calls os.abort() (SIGABRT) when the interpreter frees it;
--teardown hang: an atexit handler that never returns;
--teardown freeze: before its script returns, a C call that never returns with the GIL held, as gloo's
teardown deadlock does (a DDP wrapper freed as main() returns): no Python runs in the process again.
Every rank appends "STEP PID" to OUT/rank-R.steps after each step."""

import argparse
import atexit
import ctypes
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  before init_process_group: destroy_process_group() then frees it
from torch.nn.parallel import DistributedDataParallel


class AbortsWhenFreed:
    def __del__(self):
        os.abort()


def misbehaviours(text: str) -> dict[int, str]:
    """KIND (rank 0's), or RANK=KIND,...: each rank's way to misbehave."""
    pairs = [part.split("=") if "=" in part else ("0", part) for part in text.split(",")]
    if not all(kind in ("abort", "hang", "freeze") for _, kind in pairs):
        raise argparse.ArgumentTypeError(f"{text!r}: KIND or RANK=KIND,... (abort, hang, freeze)")
    return {int(rank): kind for rank, kind in pairs}


p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=5)
p.add_argument("--out", type=Path, required=True)
p.add_argument("--teardown", type=misbehaviours, required=True)
args = p.parse_args()
dist.init_process_group("gloo")
rank = dist.get_rank()
ddp = DistributedDataParallel(torch.nn.Linear(4, 1))
for step in range(1, args.steps + 1):
    ddp(torch.randn(2, 4)).sum().backward()
    with open(args.out / f"rank-{rank}.steps", "a") as f:
        f.write(f"{step} {os.getpid()}\n")
dist.barrier()
del ddp
dist.destroy_process_group()
misbehaviour = args.teardown.get(rank)
if misbehaviour == "abort":
    freed_in_teardown = AbortsWhenFreed()
elif misbehaviour == "hang":
    atexit.register(time.sleep, 3600)
elif misbehaviour == "freeze":
    ctypes.pythonapi.sleep(3600)  # (pythonapi: the GIL stays held)
