"""Security review 5, H1, as a test: an attacker with nothing but a TCPStore client finds the
generation's prefix with list_keys() and plants every state key it sees (a pickle that would run a
command, forged cards that would choose the source and the plan, garbage) while two real gloo ranks
move the state (a trained source, a fresh receiver). No payload runs, no plan changes: each rank
either ends with the source's state or fails the generation with a named error."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import threading
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from muster.worker.library.comm import GroupChannel, GroupSpec
from muster.worker.library.state import ReplicatedState
from muster.worker.store import serve

pytestmark = pytest.mark.timeout(180)
CPU = torch.device("cpu")
PREFIX = "muster/j/g2-0123456789abcdef"
KEY = bytes(range(32))
NAMED = ("StoreTampered", "SkeletonRefused", "StateMismatch")


class RunsCode:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def state_of(seed: int, steps: int) -> ReplicatedState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for i in range(steps):
        torch.manual_seed(100 + i)
        model(torch.randn(4, 32)).sum().backward()
        opt.step()
        opt.zero_grad()
    return ReplicatedState(model, opt, {}, bucket_bytes=1 << 12)


def rank_main(rank: int, port: int, out: mp.Queue) -> None:
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
        prefix = dist.PrefixStore(PREFIX + "/", store)
        dist.init_process_group("gloo", store=dist.PrefixStore("pg/", prefix), rank=rank, world_size=2,
                                timeout=timedelta(seconds=30))
        state = state_of(0, 3) if rank == 0 else state_of(7, 0)
        before = state.fingerprint(CPU).hex()
        channel = GroupChannel(prefix, GroupSpec(2, rank, 2, 0, f"127.0.0.1:{port}", PREFIX, KEY), lambda: False, 10.0)
        try:
            result = state.sync(3 if rank == 0 else 0, channel, CPU)
        except Exception as exc:
            out.put((rank, "failed", type(exc).__name__, str(exc)[:300], before))
            return
        out.put((rank, "ok", result.role, state.fingerprint(CPU).hex(), before))
    except Exception:
        out.put((rank, "error", traceback.format_exc(), "", ""))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def attack(port: int, marker: str, stop: threading.Event, planted: list[str]) -> None:
    """Plants every state key it can list, again and again: a pickle payload for the skeleton and
    verdicts, a card that claims step 999 with rank 1's state (which would make it the source)."""
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    payload = pickle.dumps({"model": RunsCode(marker)})
    while not stop.is_set():
        for key in client.list_keys():
            if "/state/" not in key:
                continue
            value = b"999 " + b"f" * 32 + b" 0000000000000000" if "/state/card/" in key else payload
            client.set(key, value)
            if key not in planted:
                planted.append(key)


def trial(tmp_path, n: int) -> tuple[dict, list[str]]:
    store = serve("127.0.0.1", timedelta(seconds=30))
    marker = str(tmp_path / f"ran-{n}")
    stop, planted = threading.Event(), []
    attacker = threading.Thread(target=attack, args=(store.port, marker, stop, planted), daemon=True)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, store.port, out)) for r in range(2)]
    attacker.start()
    for p in procs:
        p.start()
    try:
        results = {}
        for _ in range(2):
            rank, *rest = out.get(timeout=120)
            results[rank] = rest
    finally:
        stop.set()
        attacker.join(10)
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    assert not os.path.exists(marker), "the planted pickle ran"
    return results, planted


def test_a_list_keys_attacker_runs_no_code_and_changes_no_plan(tmp_path):
    tampered = 0
    for n in range(3):
        results, planted = trial(tmp_path, n)
        assert any("/state/" in k for k in planted), planted  # it found the prefix and planted
        for rank, (kind, *rest) in results.items():
            assert kind in ("ok", "failed"), rest
            if kind == "ok":
                role, after, _ = rest
                assert role == ("source" if rank == 0 else "receiver")  # the forged cards chose nothing
                assert after == results[0][-1]  # the source's state as it was before, whatever was planted
            else:
                name, message, _ = rest
                assert name in NAMED or "did not publish" in message, (name, message)
                tampered += name == "StoreTampered"
    assert tampered, "no rank ever read a planted value: the attack never reached a reader"
