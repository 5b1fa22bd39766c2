"""The contract of the state seam (`muster.worker.library.state.StateTransfer`), held against every
implementation: the replicated state, replica groups of shards (FSDP2 on an HSDP mesh) and shards with
peer snapshots (FSDP2 on a 1-D mesh), as torchft's checkpoint transports share one recovery test.

Four real processes on gloo and a real TCPStore, started once for the module, run the same story on
each layout, using only the Protocol's members, the generations made by hand as the coordinator would:
a first formation, 3 steps, a reform every rank survives, a step, a reform with process 1 replaced by
a fresh one, a step begun and discarded, then (where the layout shards) a reform that lost every copy
of a shard. The tests read what each rank saw."""

from __future__ import annotations

import multiprocessing as mp
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from muster.worker.library.comm import GroupChannel, GroupSpec
from muster.worker.errors import StateLost
from muster.worker.library.sharded import Replicas, ShardedState
from muster.worker.library.snapshots import Snapshots, SnapshotState
from muster.worker.library.state import ReplicatedState, StateTransfer
from muster.testing import run_processes

pytestmark = pytest.mark.timeout(240)
CPU = torch.device("cpu")
WORLD = 4
REPLACED = 1  # the process lost after step 4, a fresh one in its place


class Position:
    """A data position, registered as an extra: it moves with the state."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def build(mesh) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """FSDP2 over `mesh`: HSDP on a 2-D one, plain sharding on a 1-D one."""
    from torch.distributed.fsdp import fully_shard

    m = model(0)
    for layer in (m[0], m[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m, torch.optim.Adam(m.parameters(), lr=1e-2)


def replicated(process: int) -> StateTransfer:
    m = model(100 + process)  # a fresh process's own initialisation: the first formation takes rank 0's
    return ReplicatedState.of(m, torch.optim.Adam(m.parameters(), lr=1e-2), {"data": Position()})


# Each layout: a fresh process's state; which slots must hold identical state (their key); the
# processes that lose every copy of one shard at once (None: the layout does not shard).
LAYOUTS = {
    "replicated": (replicated, lambda slot: 0, None),
    "sharded": (lambda process: ShardedState(build, Replicas(2, 2), {"data": Position()}),
                lambda slot: slot % 2, {0, 2}),  # shard 0's two replicas
    "snapshots": (lambda process: SnapshotState(build, Snapshots(WORLD, every=1), {"data": Position()}, node="n"),
                  lambda slot: slot, {0, 1}),  # slot 0 and its buddy (one node: the next slot)
}


def train(state: StateTransfer, first: int, last: int, history: dict[int, tuple[int, str]]) -> None:
    """Steps `first`..`last` - 1, each batch by step and slot, noting this rank's fingerprint after each."""
    for step in range(first, last):
        loss(state, step).backward()
        state.optimizer.step()
        state.optimizer.zero_grad()
        state.extras["data"].step = step + 1
        state.stepped(step + 1)
        history[step + 1] = (state.slot, state.fingerprint(CPU).hex())


def loss(state: StateTransfer, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step * 1009 + max(state.slot, 0))
    return state.model(torch.randn(4, 8, generator=g)).sum()


def story(layout: str, store: dist.Store, process: int) -> dict:
    fresh, _, lost_shard = LAYOUTS[layout]
    seen: dict = {}
    generation = 0

    def reform(state: StateTransfer, step: int) -> dict:
        nonlocal generation
        generation += 1
        if dist.is_initialized():
            dist.destroy_process_group()
        name = f"{layout}/g{generation}"
        prefix = dist.PrefixStore(f"{name}/", store)
        state.card_ahead(step, CPU)  # as the reform does, before it waits for its group
        dist.init_process_group("gloo", store=dist.PrefixStore("pg/", prefix), rank=process, world_size=WORLD,
                                timeout=timedelta(seconds=30))
        r = state.sync(step, GroupChannel(prefix, GroupSpec(generation, process, WORLD, 0, "", name), lambda: False, 30.0),
                       CPU)
        return {"role": r.role, "step": r.step, "sent": r.sent, "received": r.received, "slot": state.slot,
                "fingerprint": state.fingerprint(CPU).hex(), "position": state.extras["data"].step}

    history: dict[int, tuple[int, str]] = {}
    state = fresh(process)
    seen["first"] = reform(state, 0)
    train(state, 0, 3, history)
    before = state.fingerprint(CPU).hex()
    seen["kept"] = {**reform(state, 3), "before": before}
    train(state, 3, 4, history)
    seen["history"] = dict(history)
    if process == REPLACED:
        state = fresh(process)
    seen["replaced"] = reform(state, 0 if process == REPLACED else 4)
    loss(state, 99).backward()  # a step begun, its collective failed: discarded
    had = sum(p.grad is not None for p in state.model.parameters())
    state.discard_step()
    seen["discarded"] = (had, [n for n, p in state.model.named_parameters() if p.grad is not None])
    if lost_shard is not None:
        if process in lost_shard:
            state = fresh(process)
        try:
            reform(state, 0 if process in lost_shard else seen["replaced"]["step"])
            seen["lost"] = ("", "")
        except StateLost as exc:
            seen["lost"] = (type(exc).__name__, str(exc))
    return seen


def rank_main(process: int, port: int, out: mp.Queue) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    for layout in LAYOUTS:
        try:
            out.put((process, layout, "ok", story(layout, store, process)))
        except Exception:
            out.put((process, layout, "error", traceback.format_exc()))
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def seen() -> dict[str, dict[int, dict]]:
    """What every rank saw, by layout then process (the processes started once for the module)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    results: dict[str, dict[int, dict]] = {layout: {} for layout in LAYOUTS}
    errors = []
    for process, layout, kind, value in run_processes(rank_main, [(p, store.port) for p in range(WORLD)],
                                                      WORLD * len(LAYOUTS), 200):
        if kind == "error":
            errors.append(f"{layout}, process {process}: {value}")
        results[layout][process] = value
    assert not errors, "\n".join(errors)
    return results


def alike(ranks: dict[int, dict], key) -> None:
    """Ranks hold identical state exactly where the layout says they must (by `key` of their slot)."""
    for a in ranks.values():
        for b in ranks.values():
            same = key(a["slot"]) == key(b["slot"])
            assert (a["fingerprint"] == b["fingerprint"]) == same, (a, b)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fingerprints_agree_where_the_layout_replicates_and_differ_where_it_shards(seen, layout):
    ranks = seen[layout]
    assert sorted(r["first"]["slot"] for r in ranks.values()) == (
        [-1] * WORLD if layout == "replicated" else list(range(WORLD))), "every rank placed once"
    for when in ("first", "kept", "replaced"):
        alike({p: r[when] for p, r in ranks.items()}, LAYOUTS[layout][1])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_survivors_keep_their_state_and_move_nothing(seen, layout):
    for process, r in seen[layout].items():
        kept = r["kept"]
        assert (kept["sent"], kept["received"]) == (0, 0), (process, kept)
        assert kept["fingerprint"] == kept["before"] and kept["slot"] == r["first"]["slot"], (process, kept)
        assert (kept["step"], kept["position"]) == (3, 3)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_fresh_rank_receives_the_state_bit_for_bit(seen, layout):
    ranks = seen[layout]
    joiner = ranks[REPLACED]["replaced"]
    assert joiner["role"] == "receiver" and joiner["received"] > 0, joiner
    step = joiner["step"]
    assert 1 <= step <= 4 and joiner["position"] == step, joiner
    # Every slot, the replaced one too, holds what that slot held at the step synced to, bit for bit
    held_at = {slot: fp for r in ranks.values() for slot, fp in [r["history"][step]]}
    for process, r in ranks.items():
        assert r["replaced"]["step"] == step, (process, r["replaced"])
        assert r["replaced"]["fingerprint"] == held_at[r["replaced"]["slot"]], (process, r["replaced"])
        if process != REPLACED:
            assert r["replaced"]["received"] == 0, ("a survivor's own state never moves", process, r["replaced"])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_discarded_step_leaves_no_gradient(seen, layout):
    for process, r in seen[layout].items():
        had, left = r["discarded"]
        assert had > 0 and left == [], (process, had, left)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_lost_shard_raises(seen, layout):
    if LAYOUTS[layout][2] is None:
        pytest.skip("every rank holds the whole state: no shard to lose")
    for process, r in seen[layout].items():
        kind, why = r["lost"]
        assert kind in ("StateLost", "ShardLost") and "lost" in why, (process, r["lost"])
