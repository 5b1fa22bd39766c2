"""Every rank of a forming generation waits in the arrival barrier for the last one to arrive. On a
GPU (8 NCCL ranks) every survivor sometimes waited about 3 s there for one late rank, and nobody
could tell which: a barrier waiting past BARRIER_LATE_S now names the ranks not there yet."""

from datetime import timedelta

import pytest
import structlog
import torch.distributed as dist

from muster.worker.library import comm as comm_module
from muster.worker.library.comm import Comm, GroupSpec, Superseded


@pytest.mark.timeout(60)
def test_a_barrier_waiting_for_a_late_rank_names_it(monkeypatch):
    monkeypatch.setattr(comm_module, "BARRIER_LATE_S", 0.1)
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    spec = GroupSpec(1, 0, 3, 0, f"127.0.0.1:{server.port}", "generation-1")
    dist.PrefixStore("generation-1/", server).add("arrived/1", 1)  # rank 1 is there; rank 2 is late
    comm = Comm("gloo", host_store=False, timeout_s=10)  # never named: the barrier's timeout, not Superseded
    with structlog.testing.capture_logs() as logs:
        # The barrier polls abandoned(): the attempt ends once the late rank was named.
        with pytest.raises(Superseded):
            comm.form(spec, abandoned=lambda: any(r["event"] == "barrier_waiting" for r in logs))
    (named,) = [r for r in logs if r["event"] == "barrier_waiting"]
    assert named["missing"] == [2] and named["missing_count"] == 1
    assert named["generation"] == 1 and named["rank"] == 0 and named["waited_s"] >= 0.1
