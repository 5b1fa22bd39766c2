"""The background teardown on NCCL itself: 100 reforms of a one-rank NCCL group (eager init, a
collective, the library's abort, destroy) leave no more threads and file descriptors and no less
free GPU memory than ten did, and every reform forms without waiting for the previous abort. Skipped without CUDA;
`make gpu-check` runs it with tests/gpu."""

import gc
import os

import pytest
import torch
import torch.distributed as dist

from muster.worker.library.comm import Comm, GroupSpec

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and NCCL"),
              pytest.mark.timeout(240)]

WAIT_S = 60.0  # a bound on the teardown's backlog (~0.5 s an abort), never a measurement
GPU_SLACK = 64 << 20  # NCCL maps its buffers in granules: free memory moves a little without a leak


def resources() -> dict[str, int]:
    gc.collect()
    free, _ = torch.cuda.mem_get_info()  # NCCL's own buffers are outside torch's allocator
    return {"threads": len(os.listdir("/proc/self/task")), "fds": len(os.listdir("/proc/self/fd")),
            "gpu_free": free}


def test_a_hundred_nccl_reforms_leave_threads_descriptors_and_gpu_memory_flat():
    comm = Comm("nccl", timeout_s=60)
    address = f"127.0.0.1:{comm.store_port}"
    counts = {}
    for generation in range(1, 101):
        comm.form(GroupSpec(generation, 0, 1, 0, address, f"muster/teardown/g{generation}"), abandoned=lambda: False)
        t = torch.ones(4, device="cuda")
        dist.all_reduce(t)
        torch.cuda.synchronize()
        assert comm.abort(generation + 1)
        comm.destroy()
        assert not dist.is_initialized()
        if generation in (10, 100):
            assert comm.backend.teardown.idle(WAIT_S)
            counts[generation] = resources()
    before, after = counts[10], counts[100]
    assert after["threads"] <= before["threads"] and after["fds"] <= before["fds"], counts
    assert after["gpu_free"] >= before["gpu_free"] - GPU_SLACK, counts
