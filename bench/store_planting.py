"""Security review 5, H1: an attacker with nothing but a TCPStore client finds a generation's prefix
with list_keys() and plants every state key it sees (a pickle that would run a command, forged
cards that would choose the source and the plan) while two real gloo ranks move the state through
the real path (GroupChannel + ReplicatedState.sync: a trained source, a fresh receiver). Prints one
JSON object: per trial, the keys planted, whether the payload ran, each rank's outcome (its role
and whether it ends with the source's state, or the named error it failed the generation with).

    python bench/store_planting.py --trials 3
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pickle
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from muster.testing import run_processes
from muster.worker.library.comm import GroupChannel, GroupSpec
from muster.worker.library.state import ReplicatedState
from muster.worker.store import serve

CPU = torch.device("cpu")
PREFIX = "muster/j/g2-0123456789abcdef"
KEY = bytes(range(32))


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
            out.put({"rank": rank, "outcome": "failed", "error": type(exc).__name__, "message": str(exc)[:300],
                     "before": before})
            return
        out.put({"rank": rank, "outcome": "ok", "role": result.role, "after": state.fingerprint(CPU).hex(),
                 "before": before})
    except Exception:
        out.put({"rank": rank, "outcome": "error", "message": traceback.format_exc()})
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def attack(port: int, marker: str, stop: threading.Event, planted: list[str]) -> None:
    """Plants every state key it can list, again and again: a pickle payload for the skeleton and
    verdicts, a card that claims step 999 (which would make its holder the source)."""
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    payload = pickle.dumps({"model": RunsCode(marker)})
    while not stop.is_set():
        for key in client.list_keys():
            if "/state/" not in key:
                continue
            client.set(key, b"999 " + b"f" * 32 + b" 0000000000000000" if "/state/card/" in key else payload)
            if key not in planted:
                planted.append(key)


def trial(workdir: str, n: int) -> dict:
    """One attacked transfer: the ranks' results by rank, the keys planted, and whether the payload ran."""
    store = serve("127.0.0.1", timedelta(seconds=30))
    marker = os.path.join(workdir, f"ran-{n}")
    stop, planted = threading.Event(), []
    attacker = threading.Thread(target=attack, args=(store.port, marker, stop, planted), daemon=True)
    began = time.monotonic()
    attacker.start()
    try:
        # (forked from a server that imported torch once: a spawned rank imported it again, 3-4 s of CPU)
        ranks = {r.pop("rank"): r for r in run_processes(rank_main, [(0, store.port), (1, store.port)], 2, 120)}
    finally:
        stop.set()
        attacker.join(10)
    return {"ranks": ranks, "planted": planted, "payload_ran": os.path.exists(marker),
            "seconds": round(time.monotonic() - began, 3)}


def run(trials: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="muster-planting-") as workdir:
        done = [trial(workdir, n) for n in range(trials)]
    outcomes = [r["outcome"] if r["outcome"] == "ok" else r["error"] for t in done for r in t["ranks"].values()]
    return {"trials": trials, "payload_ran": sum(t["payload_ran"] for t in done),
            "keys_planted": sum(len(t["planted"]) for t in done),
            "rank_outcomes": {o: outcomes.count(o) for o in sorted(set(outcomes))},
            "wrong_state": sum(r["outcome"] == "ok" and r["after"] != t["ranks"][0]["before"]
                               for t in done for r in t["ranks"].values()),
            "detail": done}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    print(json.dumps({"benchmark": "store_planting", **run(parser.parse_args().trials)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
