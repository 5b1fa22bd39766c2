"""Releasing an aborted NCCL group is prompt even when NCCL's watchdog saw the peer's death first.
Since torch 2.8 that watchdog then sleeps 4x TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC (a minute by
default) and releasing the group joins it: a survivor missed the next group's barrier and was
evicted as stalled (gpu-check, H200, 2026-11-26). Two raw NCCL ranks in the library's environment
(`Nccl.prepare`); rank 1 dies mid-run, rank 0 waits for its watchdog's report, then aborts and
releases the group with the library's own `Nccl.abort` (which hands it to the background teardown)
and `Nccl.release`, and the teardown ends. Skipped without CUDA."""

import json
import os
import queue
import subprocess
import sys
import threading

import pytest
import torch

from muster.net import free_port
from muster.worker.library.backends import Nccl

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="NCCL's watchdog: needs CUDA"),
              pytest.mark.timeout(120)]

WATCHDOG_SAW = ("failure detected by watchdog", "signal dumping")  # torch's log, before its sleep
RANK = """
import json, os, sys, time
import torch, torch.distributed as dist
from muster.worker.library.backends import Nccl
r, port = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=2,
                        device_id=torch.device("cuda", 0))
x = torch.ones(1024, device="cuda")
for _ in range(20):
    dist.all_reduce(x)
torch.cuda.synchronize()
if r == 1:
    os._exit(1)
dist.all_reduce(x, async_op=True)  # its peer is gone: never completes
print("in flight", flush=True)
sys.stdin.readline()  # the test saw the watchdog's report
nccl = Nccl()
started = time.monotonic()
nccl.abort({}, set(), 1)
aborted = time.monotonic()
nccl.release()
print(json.dumps({"abort_s": aborted - started, "released": nccl.teardown.idle(20),
                  "release_s": time.monotonic() - aborted}), flush=True)
os._exit(0)
"""


def test_an_aborted_group_is_released_at_once_after_its_watchdog_saw_the_peer_die():
    env = {**os.environ}
    Nccl().prepare(env)
    port = free_port()
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(port)], env={**env, "NCCL_HOSTID": f"h{r}"},
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in (0, 1)]
    try:
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in ranks[0].stdout], daemon=True).start()
        seen = []

        def next_line(what: str) -> str:
            try:
                line = lines.get(timeout=60)
            except queue.Empty:
                raise AssertionError(f"rank 0 printed nothing for 60 s waiting for {what}:\n{''.join(seen)[-3000:]}")
            seen.append(line)
            return line

        while not any(t in next_line("its watchdog's report of the dead peer") for t in WATCHDOG_SAW):
            pass
        ranks[0].stdin.write("\n")
        ranks[0].stdin.flush()
        while not (line := next_line("the release")).startswith("{"):
            pass
        result = json.loads(line)
        assert result["released"] and result["release_s"] < 2.0, result
    finally:
        for p in ranks:
            p.kill()
            p.wait(timeout=10)
