"""The durable tier's cost (issue 55 item 6): a 17M model (examples/train_ddp.py's, Adam) trained on
this machine's CPU, with and without the library's checkpoints (src/muster/worker/library/checkpoints.py, a
real directory): the host copy on the training thread per checkpoint, the whole step's time with
the write running beside it, the write itself, and the time to read a checkpoint back into the
model (the durable tier's part of a resume). Steps lost per tier come from the chaos tests
(tests/integration/test_checkpoints.py, test_snapshots_kill.py), quoted with their runs.

    .venv/bin/python bench/checkpoints.py --out bench/results/checkpoints.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

from muster.examples.train_ddp import MODELS, build
from muster.worker.library.checkpoints import Checkpoints, Durable
from muster.worker.library.state import ReplicatedState


def steps(model, optimizer, n: int, width: int, after=None) -> list[float]:
    out = []
    for i in range(n):
        began = time.perf_counter()
        x = torch.randn(16, width)
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if after is not None:
            after(i + 1, int((time.perf_counter() - began) * 1e6))
        out.append(time.perf_counter() - began)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="17M", choices=list(MODELS))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--out", default="")
    args = p.parse_args()
    load_before = os.getloadavg()[0]  # (a shared machine: the figures are read with it)
    torch.manual_seed(0)
    model, optimizer = build(args.model)
    width = MODELS[args.model][0]
    state = ReplicatedState(model, optimizer, {})
    steps(model, optimizer, 3, width)  # Adam's state made, the allocator warm
    base = steps(model, optimizer, args.steps, width)
    with tempfile.TemporaryDirectory() as root:
        durable = Durable(Checkpoints(root, every=args.every), 1)
        with_ckpt = steps(model, optimizer, args.steps, width,
                          after=lambda step, us: durable.stepped(step, us, 0, state.saved_tree))
        durable.flush()
        (newest,) = durable.complete()[:1]
        began = time.perf_counter()
        state.restore_saved(durable.read(newest, 0))
        resume_s = time.perf_counter() - began
        nbytes = sum(f.stat().st_size for f in __import__("pathlib").Path(root).rglob("*.bin")) // len(durable.complete())
    step_s = statistics.median(base)
    copy_s = statistics.median(durable.copies_s)
    # The cadence every="auto" picks from these costs (no failure seen yet: an hour's MTBF assumed)
    auto = Durable.__new__(Durable)
    auto.spec, auto.started, auto.failures = Checkpoints(root, every="auto"), time.monotonic(), 0
    auto.copy_s, auto.step_s, auto.write_s = copy_s, step_s, durable.write_s
    auto_every = auto.every()
    result = {
        "model": args.model, "parameters": sum(t.numel() for t in model.parameters()),
        "checkpoint_mib": round(nbytes / (1 << 20), 1), "every": args.every,
        "step_s": round(step_s, 4),
        "copy_on_training_thread_s": round(copy_s, 4),
        "copy_percent_of_a_step_amortised": round(100 * copy_s / args.every / step_s, 2),
        "copy_percent_of_the_step_it_is_taken_at": round(100 * copy_s / step_s, 1),
        "auto_every": auto_every,
        "auto_copy_percent_of_a_step_amortised": round(100 * copy_s / auto_every / step_s, 2),
        "step_with_checkpoints_s": round(statistics.mean(with_ckpt), 4),
        "step_without_s": round(statistics.mean(base), 4),
        "whole_step_overhead_percent": round(100 * (statistics.mean(with_ckpt) / statistics.mean(base) - 1), 2),
        "write_s": round(durable.write_s, 3), "written": durable.written, "skipped": durable.skipped,
        "resume_read_and_load_s": round(resume_s, 3),
        "steps_lost_per_tier": {
            "replica (Replicas, replicated DDP)": "0: the step in flight is redone",
            "snapshot (Snapshots(N, every=K))": "at most K (test_snapshots_kill: K=4)",
            "checkpoint (every=N)": "at most N; measured 1 (every rank killed at step 9, checkpoint 8) and 2 "
                                    "(a slot and its buddy killed at step 10, checkpoint 8) in test_checkpoints",
        },
        "machine": f"{torch.get_num_threads()} torch threads, CPU",
        "load_average_1m": [round(load_before, 1), round(os.getloadavg()[0], 1)],  # at the start and the end
    }
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
