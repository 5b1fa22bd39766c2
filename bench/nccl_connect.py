"""How soon a communicator for the survivors of a lost rank is ready, by the ways NCCL and torch
offer (issue 43): N raw ranks (no coordinator) on the visible GPU, one NCCL_HOSTID each as in the
GPU check; every rank warms the group (a bucket-sized all-reduce), the last one exits, and the
survivors make the new communicator and time its first collectives. Prints one JSON object, each
figure the slowest survivor's, seconds.

  fresh          a new group on a new store prefix (eager init, connections at the first collective:
                 the library's reform)
  connect-init   the same with NCCL_RUNTIME_CONNECT=0 (every connection made by the init)
  standby        a second communicator made and warmed beside the first before the loss, shrunk
                 after it with SHRINK_DEFAULT (it has no work in flight) under
                 NCCL_COMM_SPLIT_SHARE_RESOURCES=1: do its connections carry over? It is made on
                 its own, not split from the first: NCCL aborts a split child with its parent
                 (the children's abort flag), and the first is the one aborted

  init_s / shrink_s    making the new communicator
  first_small_s        its first all-reduce of one element (connections made here unless made above)
  first_big_s          then one of --bucket-mb (a DDP bucket's size)

The old group is aborted in a background thread, as the library does. A mode whose ranks do not
all report within --timeout is reported as such, its ranks killed.

    python bench/nccl_connect.py --ranks 8
    python bench/nccl_connect.py --backend gloo --modes fresh --ranks 3   # the harness on CPU
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta

MODES = {"fresh": {}, "connect-init": {"NCCL_RUNTIME_CONNECT": "0"},
         "standby": {"NCCL_COMM_SPLIT_SHARE_RESOURCES": "1"}}


def timed(call) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from muster.worker.library.backends import Nccl, take_groups

    if args.backend == "nccl":
        Nccl().prepare(os.environ)  # the library's watchdog settings
    device = torch.device("cuda", 0) if args.backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    options = {"device_id": device} if args.backend == "nccl" else {}
    r, n = args.rank, args.ranks
    store = dist.TCPStore("127.0.0.1", args.port, n, is_master=r == 0, timeout=timedelta(seconds=args.timeout))
    # (eager init binds the group to the device, and torch then splits new groups from it)
    dist.init_process_group(args.backend, store=dist.PrefixStore("old/", store), rank=r, world_size=n,
                            **(options if args.mode != "standby" else {}))
    standby = dist.new_group(list(range(n))) if args.mode == "standby" else None
    big = torch.ones(args.bucket_mb << 18, device=device)  # float32
    for group in (None, standby) if standby is not None else (None,):
        for _ in range(3):
            dist.all_reduce(big, group=group)
    if device.type == "cuda":
        torch.cuda.synchronize()
    store.add("warm", 1)
    while int(store.add("warm", 0)) < n:
        time.sleep(0.001)
    if r == n - 1:
        os._exit(0)  # the loss
    time.sleep(0.5)  # (its process gone)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    out: dict[str, float] = {}
    old = [dist.group.WORLD]
    if standby is None:
        old = take_groups()
        threading.Thread(target=lambda: [g.abort() for g in old], daemon=True).start()
        out["init_s"] = timed(lambda: dist.init_process_group(
            args.backend, store=dist.PrefixStore("new/", store), rank=r, world_size=n - 1, **options))
        group = None
    else:
        holder: list = []
        out["shrink_s"] = timed(lambda: holder.append(dist.shrink_group(
            [n - 1], group=standby, shrink_flags=dist.distributed_c10d.SHRINK_DEFAULT)))
        group = holder[0]
        threading.Thread(target=lambda: [g.abort() for g in old], daemon=True).start()
    small = torch.ones(1, device=device)
    out["first_small_s"] = timed(lambda: (dist.all_reduce(small, group=group), sync()))
    out["first_big_s"] = timed(lambda: (dist.all_reduce(big, group=group), sync()))
    print(json.dumps(out), flush=True)
    os._exit(0)  # (the aborted groups' teardown is not measured here)


def run_mode(args: argparse.Namespace, mode: str, port: int) -> dict:
    env = {**os.environ, **MODES[mode]}
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--port", str(port), "--mode", mode,
                               "--ranks", str(args.ranks), "--backend", args.backend,
                               "--bucket-mb", str(args.bucket_mb), "--timeout", str(args.timeout)],
                              env={**env, "NCCL_HOSTID": f"probe-{r}"}, stdout=subprocess.PIPE, text=True)
             for r in range(args.ranks)]
    reports, deadline = [], time.monotonic() + args.timeout
    try:
        for p in procs[:-1]:
            try:
                out, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                continue
            lines = [line for line in out.splitlines() if line.startswith("{")]
            if lines:
                reports.append(json.loads(lines[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    if len(reports) < args.ranks - 1:
        return {"error": f"{len(reports)} of {args.ranks - 1} survivors reported within {args.timeout:g} s"}
    return {k: round(max(rep[k] for rep in reports), 4) for k in reports[0]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    p.add_argument("--bucket-mb", type=int, default=25, help="the big all-reduce's size (DDP's bucket: 25)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a mode may take")
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank is not None:
        rank_main(args)
        return 0
    unknown = {m for m in args.modes.split(",") if m} - set(MODES)
    if unknown:
        p.error(f"--modes: unknown {', '.join(sorted(unknown))}")
    from muster.net import free_port

    result = {"benchmark": "nccl_connect", "backend": args.backend, "ranks": args.ranks,
              "bucket_mb": args.bucket_mb, "modes": {}}
    for mode in args.modes.split(","):
        if mode:
            result["modes"][mode] = run_mode(args, mode, free_port())
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
