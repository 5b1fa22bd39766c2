"""A rank in gloo's connect for a generation a newer one abandoned, its peer dead after publishing
its address (the compound chaos sequence's second kill during a reform): gloo waits for the peer
for its timeout, no socket shutdown reaches it, and the newer generation's group waits for this
rank as long. The connect is bounded on its own (GLOO_CONNECT_MIN_S), so the rank fails it within
seconds and keeps its process for the newer generation."""

import subprocess
import sys
import textwrap
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from muster.worker.library.comm import GLOO_ACCEPT_WAITS, GLOO_CONNECT_MIN_S

PREFIX = "generation-1"

# Rank 1 of generation 1: arrives, then publishes its gloo address and waits for rank 0 (killed there).
PEER = textwrap.dedent("""
    import sys
    from datetime import timedelta
    import torch.distributed as dist
    client = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=30))
    store = dist.PrefixStore(sys.argv[2] + "/", client)
    store.add("arrived/1", 1)
    dist.init_process_group("gloo", store=store, rank=1, world_size=2, timeout=timedelta(seconds=60))
""")

# Rank 0 of generation 1 through Comm; generation 2 (an abort) arrives a second into its connect.
RANK = textwrap.dedent("""
    import sys, threading, time
    from muster.worker.library.comm import Comm, GroupSpec
    comm = Comm("gloo", host_store=False, timeout_s=300)
    spec = GroupSpec(1, 0, 2, 0, "127.0.0.1:" + sys.argv[1], sys.argv[2])
    threading.Timer(1.0, comm.abort, args=(2,)).start()
    started = time.monotonic()
    try:
        comm.form(spec, abandoned=lambda: False)
        print("formed", flush=True)
    except Exception as exc:
        print(f"failed after {time.monotonic() - started:.1f}s: {type(exc).__name__}", flush=True)
""")


@pytest.mark.timeout(90)
def test_a_rank_connecting_an_abandoned_generation_fails_it_within_its_bound_and_lives():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    before = server.num_keys()
    peer = subprocess.Popen([sys.executable, "-c", PEER, str(server.port), PREFIX])
    rank = None
    try:
        deadline = time.monotonic() + 30
        while server.num_keys() < before + 2:  # its arrival and its gloo address
            assert time.monotonic() < deadline, "the peer did not publish its gloo address within 30s"
            assert peer.poll() is None, "the peer exited"
            time.sleep(0.005)
        time.sleep(0.05)
        peer.kill()
        peer.wait(10)
        rank = subprocess.Popen([sys.executable, "-c", RANK, str(server.port), PREFIX],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = rank.communicate(timeout=60)
    finally:
        for proc in (peer, rank):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)
    assert rank.returncode == 0 and out.startswith("failed"), (rank.returncode, out, err[-2000:])
    assert "rank_exited_stuck" not in out + err
    # timed inside the rank, from its form on: its interpreter and torch import (15 s at a load of 10
    # here) are not the bound's
    failed_after = float(out.split("failed after ")[1].split("s:")[0])
    assert failed_after < 1.0 + GLOO_ACCEPT_WAITS * GLOO_CONNECT_MIN_S + 3, f"{out} {err[-2000:]}"
