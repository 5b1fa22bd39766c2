"""Muster against plain torchrun, in one run on one machine: for each rank count, the same model
(examples/train_ddp.py under Muster, examples/train_plain.py under torchrun with c10d and restart
semantics) loses one rank to SIGKILL several times. Then the unmodified case: the plain script
(with --scripts plain,trainer also a Hugging Face Trainer script), on --nodes agents, under each
launcher (torchrun c10d, `muster run -- torchrun` with and without warm starts, torchrun
--rdzv-backend=muster). Prints one JSON object with every side and the ratios (torchrun / Muster;
above 1 means Muster is better).

    python bench/side_by_side.py --ranks 4,8,16 --kills 5 [--unmodified-ranks 4 --nodes 2 --scripts plain,trainer]
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
import unmodified  # noqa: E402

from muster import logs  # noqa: E402


def ratio(a: float, b: float) -> float | None:
    return round(a / b, 1) if b else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="4,8,16", help="rank counts, comma-separated ('' skips the library case)")
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--checkpoint-every", type=int, default=5, help="torchrun side: steps between checkpoints")
    p.add_argument("--unmodified-ranks", default="4", help="rank counts of the unmodified case ('' skips it)")
    p.add_argument("--nodes", type=int, default=2, help="agents (nodes) in the unmodified case")
    p.add_argument("--warmup", type=float, default=unmodified.WARMUP_S,
                   help="unmodified case: seconds from a job's start to its first kill")
    p.add_argument("--scripts", default="plain", help="the unmodified case's scripts, comma-separated: plain, "
                                                      "trainer (Hugging Face Trainer: needs transformers, accelerate)")
    args = p.parse_args()
    logs.configure("warning")
    out: dict = {"benchmark": "side_by_side", "torch": torch.__version__, "step_sleep_s": args.step_sleep,
                 "checkpoint_every": args.checkpoint_every, "runs": []}
    with tempfile.TemporaryDirectory(prefix="muster-side-by-side-") as d:
        for ranks in [int(r) for r in args.ranks.split(",") if r]:
            work = Path(d) / f"ranks-{ranks}"
            (work / "muster").mkdir(parents=True)
            (work / "torchrun").mkdir()
            muster = recovery.run(work / "muster", ranks, args.kills, 0, 0, args.step_sleep)["kill"]
            torchrun: dict = {}
            unmodified.kill_cycles(work / "torchrun", ranks, 1, args.kills, args.step_sleep,
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
        out["unmodified"] = [unmodified_case(Path(d) / f"unmodified-{script}-{ranks}", ranks, args, script)
                             for script in args.scripts.split(",") if script
                             for ranks in [int(r) for r in args.unmodified_ranks.split(",") if r]]
    print(json.dumps(out, indent=2))
    return 0


def unmodified_case(work: Path, ranks: int, args: argparse.Namespace, script: str) -> dict:
    """An unmodified script under each launcher, side by side (each its own fresh job)."""
    sides = {}
    with unmodified.muster_coordinator(work) as coordinator:
        for launcher in unmodified.LAUNCHERS:
            (work / launcher).mkdir(parents=True)
            result: dict = {}
            try:
                unmodified.kill_cycles(work / launcher, ranks, args.nodes, args.kills, args.step_sleep,
                                       args.checkpoint_every, 3 * args.kills, False, result, launcher,
                                       coordinator if launcher != "torchrun" else "", unmodified.SCRIPTS[script],
                                       args.warmup)
            except (RuntimeError, AssertionError) as exc:  # report what was measured, and why it stopped
                result["error"] = str(exc)
            sides[launcher] = {k: result.get(k) for k in ("start_to_step_s", "kill_to_step_s", "steps_lost",
                                                          "workers_restarted", "restart_rounds", "error")
                               if k in result}
    t = sides["torchrun"].get("kill_to_step_s")
    return {"script": script, "ranks": ranks, "nodes": args.nodes, **sides, "ratio": {
        f"kill_to_step_p50_{name}": ratio(t["p50"], sides[name]["kill_to_step_s"]["p50"])
        for name in ("muster-run", "muster-run-cold", "muster-rdzv") if t and sides[name].get("kill_to_step_s")}}


if __name__ == "__main__":
    sys.exit(main())
