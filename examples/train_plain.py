"""A plain DDP script with no Muster code: env:// rendezvous (MASTER_ADDR, RANK, WORLD_SIZE, ...)
and a checkpoint every few steps. Under `muster run` it survives a failure by restart: the agent
restarts every rank with the new map, and the script resumes from its last checkpoint.
    muster run --coordinator HOST:PORT --job NAME --slots 2 -- python examples/train_plain.py --checkpoint-dir /tmp/ckpt
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  before init_process_group: see the end of main()
from torch.nn.parallel import DistributedDataParallel


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds of simulated compute per step")
    p.add_argument("--checkpoint-dir", type=Path, required=True)
    p.add_argument("--checkpoint-every", type=int, default=5)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    checkpoint = args.checkpoint_dir / "checkpoint.pt"
    start = 0
    if checkpoint.exists():
        state = torch.load(checkpoint)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
    ddp = DistributedDataParallel(model)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    slices = max(1, round(args.step_sleep / 0.002))
    for step in range(start + 1, args.steps + 1):
        for _ in range(slices if args.step_sleep > 0 else 0):
            time.sleep(args.step_sleep / slices)  # simulated compute: slowed as real work is by a throttled process
        g = torch.Generator().manual_seed(step * 1_000_003 + rank * 7919 + world)
        x = torch.randn(16, 32, generator=g)
        loss = torch.nn.functional.mse_loss(ddp(x), x.sum(dim=1, keepdim=True))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        # one write per record: ranks may share a stdout (torchrun), and print() may write twice
        sys.stdout.write(json.dumps({"event": "step", "step": step, "rank": rank, "world_size": world,
                                     "generation": restart, "resumed_from": start, "restart_count": restart,
                                     "master": f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                                     "pid": os.getpid(), "time": time.time()}) + "\n")
        sys.stdout.flush()
        if rank == 0 and step % args.checkpoint_every == 0:
            args.checkpoint_dir.mkdir(parents=True, exist_ok=True)
            tmp = checkpoint.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, tmp)
            tmp.replace(checkpoint)  # atomic: a kill mid-save leaves the previous checkpoint
    dist.barrier()
    # The group must be freed (its gloo threads joined) here, by destroy_process_group(): a gloo worker
    # may still be freeing the last allreduce of backward(), whose thread state holds a Python object,
    # so it needs the GIL. Freed by DDP's reducer when main() returns, the group joins that worker with
    # the GIL held (a hang); alive at exit, the worker is killed by the interpreter's finalization
    # (SIGABRT: terminate called without an active exception). Without `ddp`, and with
    # torch.distributed.nn imported before init_process_group (imported by DDP's constructor, its
    # functions' `group=group.WORLD` defaults would keep the group), destroy_process_group() frees it,
    # joining the workers with the GIL released.
    del ddp
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
