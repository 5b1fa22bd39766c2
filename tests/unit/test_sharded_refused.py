"""Sharded state is refused at register, never trained on as if each rank held all of it."""

import pytest
import torch
import torch.distributed as dist

from muster.worker import ShardedStateRefused, Worker, WorkerConfig


@pytest.fixture
def group():
    """A one-rank gloo group in this process (FSDP2 and ZeRO need one to be built)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def worker() -> Worker:
    return Worker(WorkerConfig(coordinators=("127.0.0.1:1",), job="j", node_id="n"))


def test_an_fsdp2_model_is_refused_naming_the_ways_to_recover_a_shard(group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    with pytest.raises(ShardedStateRefused, match="sharded by FSDP") as refused:
        worker().register(model=model, optimizer=torch.optim.Adam(model.parameters()))
    message = str(refused.value)
    assert "layout=Replicas(R, S)" in message and "layout=Snapshots(N)" in message and "not built" not in message


def test_zero_is_refused(group):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = torch.nn.Linear(4, 4)
    with pytest.raises(ShardedStateRefused, match="ZeroRedundancyOptimizer"):
        worker().register(model=model, optimizer=ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam))


def test_a_replicated_model_is_taken():
    model = torch.nn.Linear(4, 4)
    w = worker().register(model=model, optimizer=torch.optim.Adam(model.parameters()))
    assert w.state.model is model
