"""A worker-library rank for the fault tests: a tiny model trained step by step, which either raises
the script's own error at step --fail-at on every rank, or shards its model with FSDP2's
fully_shard after register() took it as replicated (--shard-after-register), a plausible mistake,
or registers an FSDP2 model without a layout (--shard-before-register: ShardedStateRefused at
register). Each fault meets every restarted process again at the same step. --fail-on-node N: the
ranks of node N alone raise 2 steps after they first step, each process at another step (a bad
device). --wait-before-last FILE: every rank waits (a declared long phase) before the last step
until FILE exists."""

import argparse
import os
import time

import structlog
import torch

from muster import logs
from muster.worker import Worker, WorkerConfig

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=1000)
parser.add_argument("--fail-at", type=int, default=0)
parser.add_argument("--shard-after-register", action="store_true")
parser.add_argument("--shard-before-register", action="store_true")
parser.add_argument("--fail-on-node", default="")
parser.add_argument("--step-sleep", type=float, default=0.05)
parser.add_argument("--wait-before-last", default="")
args = parser.parse_args()
logs.configure("info", json=True)

torch.manual_seed(0)
model = torch.nn.Linear(8, 8)
if args.shard_before_register:  # on a group of its own: the library has formed none yet
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
worker = Worker(WorkerConfig.from_env()).register(model=model, optimizer=optimizer)
worker.start()
bad_device_at = worker.step + 2 if args.fail_on_node == os.environ.get("MUSTER_NODE_ID") else -1
if args.shard_after_register:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=init_device_mesh("cpu", (worker.world_size,)))
while worker.step < args.steps:
    if args.wait_before_last and worker.step == args.steps - 1:
        structlog.get_logger("repeat_fault").info("waiting_before_last_step", step=worker.step)
        with worker.long_phase("waiting for the test"):
            while not os.path.exists(args.wait_before_last):
                time.sleep(0.05)
    with worker.step_scope():
        if worker.step + 1 == args.fail_at:
            raise RuntimeError(f"the script's own bug at step {args.fail_at}")
        if worker.step == bad_device_at:
            raise RuntimeError(f"CUDA error: an illegal memory access was encountered (simulated, step {bad_device_at})")
        net = model if args.shard_after_register else worker.ddp(model)
        net(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        time.sleep(args.step_sleep)
worker.close()
