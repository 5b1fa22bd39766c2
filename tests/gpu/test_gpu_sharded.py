"""FSDP2 on an HSDP mesh (2 replicas x 2 shards, examples/train_hsdp.py) on the GPU path: 4 library
ranks and a spare sharing the visible GPUs on NCCL (each process its own NCCL_HOSTID), a rank
SIGKILLed mid-training. The spare takes the lost slot, receiving its shard from the other replica;
the survivors' shards never move; every slot ends equal to an uninterrupted run of the same
batches. Skipped without CUDA; MUSTER_GPU_TEST_BACKEND=gloo (or nccl-twin) runs it on CPU.
`make gpu-check` runs it with the other tests of tests/gpu."""

import os
from pathlib import Path

import pytest
import torch

from muster.local import (TrainingProcess, final_digests, kill_and_finish, rank_env, resumed_at, spare_victim_survivors,
                          wait_until)

BACKEND = os.environ.get("MUSTER_GPU_TEST_BACKEND", "nccl")
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_hsdp.py"
STEPS = 30

pytestmark = [
    pytest.mark.skipif(BACKEND == "nccl" and not torch.cuda.is_available(),
                       reason="needs CUDA (MUSTER_GPU_TEST_BACKEND=gloo or nccl-twin runs it on CPU)"),
    pytest.mark.timeout(300),
]


@pytest.fixture
def hsdp(training):
    """`training`'s ranks (ended afterwards) of examples/train_hsdp.py, each on `BACKEND`."""
    def start(coordinator: str, job: str, n: int) -> list[TrainingProcess]:
        return [training([coordinator], job, 1, steps=STEPS, step_sleep_s=0.2, env=rank_env(BACKEND),
                         script=EXAMPLE)[0] for _ in range(n)]
    return start


def test_hsdp_a_killed_rank_is_replaced_by_the_spare_from_the_other_replica(coordinators, hsdp):
    (leader,) = coordinators(1, extra=["--heartbeat-timeout", "2.0"])
    reference = hsdp(leader.address, "hsdp-ref", 4)
    ranks = hsdp(leader.address, "hsdp-kill", 5)  # 4 in the mesh, the 5th a spare
    wait_until(lambda: sum(p.last_step >= 3 for p in ranks) == 4, 180, "4 ranks past step 3", interval_s=0.1)
    spare, victim, survivors = spare_victim_survivors(ranks, 1, leader.address, "hsdp-kill")
    generation, killed_at = kill_and_finish(victim, reference + survivors + [spare], 200)
    print(f"\nHSDP 2x2 on {BACKEND}, a rank killed at step {victim.last_step}: training resumed "
          f"{resumed_at(survivors, generation) - killed_at:.2f} s later")
    took = [r for r in spare.records("group_formed") if r["generation"] > generation]
    assert took and took[0]["state"] == "receiver" and took[0]["bytes_received"] > 0, took
    reformed = [r for p in survivors for r in p.records("group_formed") if r["generation"] > generation]
    assert reformed and all(r["bytes_received"] == 0 for r in reformed), "survivors' shards never moved"
    assert final_digests(survivors + [spare], STEPS) == final_digests(reference, STEPS)
