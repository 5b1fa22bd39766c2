"""The link's rate as torch.distributed sees it: N processes, one `dist.broadcast` of a flat buffer
of the given size from rank 0 (after one warm-up), gloo on CPU or NCCL on the visible GPUs (ranks
share them, one NCCL_HOSTID each, as the recovery benchmark's ranks do). The floor a state
transfer is held against. Prints one JSON object.

    python bench/raw_broadcast.py --ranks 4 --mib 256
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from datetime import timedelta

REPS = 3


def rank_main(rank: int, world: int, port: int, nbytes: int, backend: str, out: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    os.environ["NCCL_HOSTID"] = f"raw-{os.getpid()}"
    device = torch.device("cuda", rank % torch.cuda.device_count()) if backend == "nccl" else torch.device("cpu")
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120),
                            **({"device_id": device} if backend == "nccl" else {}))
    try:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        times = []
        for _ in range(REPS + 1):
            dist.barrier()
            if backend == "nccl":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            dist.broadcast(buf, 0)
            if backend == "nccl":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        out.put((rank, times[1:]))
    finally:
        dist.destroy_process_group()


def measure(ranks: int, nbytes: int, backend: str) -> dict:
    """The median over REPS of the slowest rank's broadcast time, as a rate."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, ranks, store.port, nbytes, backend, out)) for r in range(ranks)]
    for p in procs:
        p.start()
    try:
        per_rank = dict(out.get(timeout=300) for _ in range(ranks))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    seconds = statistics.median(max(per_rank[r][i] for r in per_rank) for i in range(REPS))
    return {"ranks": ranks, "backend": backend, "bytes": nbytes, "seconds": round(seconds, 4),
            "mib_s": round(nbytes / seconds / (1 << 20), 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--mib", type=float, default=256.0)
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    args = p.parse_args()
    print(json.dumps(measure(args.ranks, int(args.mib * (1 << 20)), args.backend), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
