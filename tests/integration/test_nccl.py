"""The NCCL path (abort, then reform on a fresh prefix) on a real GPU; skipped without CUDA."""

import pytest
import torch
import torch.distributed as dist

from muster.worker.library.comm import Comm, GroupSpec

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and NCCL")


@pytest.mark.timeout(120)
def test_nccl_group_forms_aborts_and_reforms_in_cycles():
    comm = Comm("nccl", timeout_s=60)
    address = f"127.0.0.1:{comm.store_port}"
    for generation in range(1, 6):
        comm.form(GroupSpec(generation, 0, 1, 0, address, f"muster/nccl/g{generation}"), abandoned=lambda: False)
        t = torch.ones(4, device="cuda")
        dist.all_reduce(t)
        torch.cuda.synchronize()
        assert t.tolist() == [1.0] * 4
        assert comm.abort(generation + 1)
        comm.destroy()
        assert not dist.is_initialized()
