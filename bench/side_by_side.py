"""Muster against plain torchrun, in one run on one machine: for each rank count, the same model
(examples/train_ddp.py under Muster, examples/train_plain.py under torchrun with c10d and restart
semantics) loses one rank to SIGKILL several times. Prints one JSON object with both sides and
their ratios (torchrun / Muster; above 1 means Muster is better).

    python bench/side_by_side.py --ranks 4,8,16 --kills 5
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import recovery  # noqa: E402
import torchrun_baseline  # noqa: E402

from muster import logs  # noqa: E402


def ratio(a: float, b: float) -> float | None:
    return round(a / b, 1) if b else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="4,8,16", help="rank counts, comma-separated")
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--checkpoint-every", type=int, default=5, help="torchrun side: steps between checkpoints")
    args = p.parse_args()
    logs.configure("warning")
    out: dict = {"benchmark": "side_by_side", "torch": torch.__version__, "step_sleep_s": args.step_sleep,
                 "checkpoint_every": args.checkpoint_every, "runs": []}
    with tempfile.TemporaryDirectory(prefix="muster-side-by-side-") as d:
        for ranks in [int(r) for r in args.ranks.split(",")]:
            work = Path(d) / f"ranks-{ranks}"
            (work / "muster").mkdir(parents=True)
            (work / "torchrun").mkdir()
            muster = recovery.run(work / "muster", ranks, args.kills, 0, 0, args.step_sleep)["kill"]
            torchrun: dict = {}
            torchrun_baseline.kill_cycles(work / "torchrun", ranks, 1, args.kills, args.step_sleep,
                                          args.checkpoint_every, 3 * args.kills, False, torchrun)
            m, t = muster["kill_to_step_s"], torchrun["kill_to_step_s"]
            out["runs"].append({
                "ranks": ranks,
                "muster": {"kill_to_step_s": m, "steps_lost": muster["steps_lost"],
                           "survivors_lost": muster["survivors_lost"], "detection_s": muster["detection_s"]},
                "torchrun": {k: torchrun[k] for k in ("kill_to_step_s", "steps_lost", "survivors_lost",
                                                      "workers_restarted", "phases_s")},
                "ratio": {"kill_to_step_p50": ratio(t["p50"], m["p50"]), "kill_to_step_p99": ratio(t["p99"], m["p99"]),
                          "steps_lost_total": f"{torchrun['steps_lost']['total']} vs {muster['steps_lost']['total']}",
                          "processes_restarted_per_kill": f"{ranks} vs 1"},
            })
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
