"""FSDP2 on an HSDP mesh (2 replicas x 2 shards) across a reform, between real gloo processes on a
real TCPStore, without a coordinator: the generations are made by hand as the coordinator would
(survivors keep their order, the replacement comes last). Survivors keep their slots and move
nothing; a replacement lands in the lost slot and receives only its shard from the other replica
(a lost rank, or a lost replica group: a node); every slot then ends bit-identical to an uninterrupted run that saw the same batches."""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from muster.worker.library.comm import GroupChannel, GroupSpec
from muster.worker.library.sharded import Replicas, ShardedState
from muster.testing import run_processes

pytestmark = pytest.mark.timeout(150)
CPU = torch.device("cpu")
LAYOUT = Replicas(2, 2)
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_hsdp.py"
# The processes lost (fresh ones in their place), and generation 2's rank of each process: survivors
# keep their order, replacements come last, as the coordinator's maps number them.
LOSSES = {"a rank": ({1}, {0: 0, 2: 1, 3: 2, 1: 3}),
          "a replica group": ({0, 1}, {2: 0, 3: 1, 0: 2, 1: 3})}  # (a node holding replica 0)


def example():
    spec = importlib.util.spec_from_file_location("train_hsdp", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def generation(store: dist.Store, name: str, rank: int) -> GroupChannel:
    prefix = dist.PrefixStore(f"{name}/", store)
    dist.init_process_group("gloo", store=dist.PrefixStore("pg/", prefix), rank=rank, world_size=LAYOUT.world_size,
                            timeout=timedelta(seconds=30))
    return GroupChannel(prefix, GroupSpec(1, rank, LAYOUT.world_size, 0, "", name), lambda: False, 30.0)


def train(ex, state: ShardedState, first: int, last: int) -> None:
    for step in range(first, last):
        replica, shard = state.mesh.get_coordinate()
        x, y = ex.batch(step, replica * LAYOUT.shards + shard)
        torch.nn.functional.mse_loss(state.model(x), y).backward()
        state.optimizer.step()
        state.optimizer.zero_grad()


def rank_main(process: int, port: int, reformed: dict[int, int], fresh: bool, out: mp.Queue) -> None:
    try:
        ex = example()
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
        # The uninterrupted run: 6 steps.
        reference = ShardedState(ex.build, LAYOUT)
        reference.sync(0, generation(store, "ref", process), CPU)
        train(ex, reference, 0, 6)
        expected = (reference.slot, reference.fingerprint(CPU).hex())
        reference.model = reference.optimizer = reference.mesh = None
        dist.destroy_process_group()
        # The same 6 steps, with `fresh` processes lost after step 3 and replaced.
        state = ShardedState(ex.build, LAYOUT)
        state.sync(0, generation(store, "g1", process), CPU)
        first_slot = state.slot
        train(ex, state, 0, 3)
        dist.destroy_process_group()
        if fresh:
            state = ShardedState(ex.build, LAYOUT)
        result = state.sync(0 if fresh else 3, generation(store, "g2", reformed[process]), CPU)
        train(ex, state, result.step, 6)
        out.put((process, "ok", {"expected": expected, "first_slot": first_slot, "slot": state.slot,
                                 "role": result.role, "received": result.received, "sent": result.sent,
                                 "step": result.step, "fingerprint": state.fingerprint(CPU).hex()}))
    except Exception:
        out.put((process, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize("lost", list(LOSSES))
def test_replacements_take_the_lost_slots_and_every_shard_ends_as_if_uninterrupted(lost):
    fresh, reformed = LOSSES[lost]
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    results = {process: (kind, value) for process, kind, value in run_processes(
        rank_main, [(p, store.port, reformed, p in fresh) for p in range(LAYOUT.world_size)], LAYOUT.world_size, 120)}
    assert all(kind == "ok" for kind, _ in results.values()), results
    r = {p: v for p, (_, v) in results.items()}
    assert all(v["slot"] == v["first_slot"] == p for p, v in r.items()), "every process kept (or retook) its slot"
    for p in fresh:  # its shard came from the same shard index in the other replica, slot p ^ 2
        assert r[p]["role"] == "receiver" and r[p]["step"] == 3 and r[p]["received"] > 0, r[p]
        assert r[p ^ 2]["role"] == "source" and r[p ^ 2]["sent"] == r[p]["received"], r
    assert all(r[p]["received"] == 0 for p in r if p not in fresh), "survivors' shards never moved"
    assert all(v["fingerprint"] == v["expected"][1] and v["slot"] == v["expected"][0] for v in r.values()), r
    assert r[0]["fingerprint"] == r[2]["fingerprint"] != r[1]["fingerprint"] == r[3]["fingerprint"], "by shard index"
