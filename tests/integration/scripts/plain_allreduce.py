"""A plain env:// gloo script (no Muster code) that dies at once when a peer goes: an all_reduce per
step, and os._exit(1) on its error, where a DDP script may hang in teardown first. Each step is a
JSON line on stdout, as examples/train_plain.py writes them."""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=100)
parser.add_argument("--step-sleep", type=float, default=0.05)
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
for step in range(1, args.steps + 1):
    try:
        dist.all_reduce(torch.ones(4))
    except RuntimeError as exc:
        sys.stderr.write(f"step {step}: {exc}\n")
        os._exit(1)
    sys.stdout.write(json.dumps({"event": "step", "step": step, "rank": rank, "world_size": world,
                                 "restart_count": int(os.environ["TORCHELASTIC_RESTART_COUNT"])}) + "\n")
    sys.stdout.flush()
    time.sleep(args.step_sleep)
dist.barrier()
dist.destroy_process_group()
