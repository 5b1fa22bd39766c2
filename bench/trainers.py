"""The same Hugging Face Trainer script (examples/train_trainer.py: a small GPT-2 on CPU/gloo,
save_steps=5), 2 nodes x 2 ranks, one rank SIGKILLed a fault's time into the run, three ways:

  torchrun     plain torchrun (c10d): every worker restarts and resumes from the last checkpoint
  muster-run   `muster run -- torchrun …` (the restart path, warm starts): the same, faster
  resilient    `muster run` with the script's one line (`--resilient`: muster.worker.integrations.hf):
               the survivors re-form in-process, the replacement takes the state from them

Reported per way: kill_to_step_s (the kill until every rank still in the job has completed a step
in the new group: under the restart paths every rank restarted; with the integration the three
survivors, in the group formed without the victim), steps_redone (the highest step completed before
the kill minus the first step after it, plus one), workers_restarted. For the integration also:
kill_to_replacement_s (until the replacement's first step), bytes_received (the state the
replacement took from its peers; survivors take none), and the final loss of a run of --steps
steps with the kill against the same run uninterrupted (logged every 10 steps, averaged over the
ranks and the 10 steps).

    python bench/trainers.py [--fault-at 15] [--steps 150] > bench/results/trainers.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from unmodified import SCRIPTS, Nodes, kill_cycles, launcher_argv, muster_coordinator

from muster import logs
from muster.local import wait_until

RANKS, NODES = 4, 2
LOSS_RECORD = re.compile(r'\{"event": "loss"[^{}]*\}')
KEPT = ("start_to_step_s", "kill_to_step_s", "steps_lost", "workers_restarted", "workers_left_after_stop", "error")
RECEIVED = re.compile(r"group_formed .*bytes_received=(\d+)")


def resilient_run(workdir: Path, coordinator: str, name: str, steps: int, fault_at_s: float | None,
                  step_sleep_s: float) -> dict:
    """One run of the script with its line to --steps, killing a random rank fault_at_s after the
    agents start (None: uninterrupted)."""
    tag = uuid.uuid4().hex
    env = {**os.environ, "MUSTER_BENCH_RUN": tag}
    script = [str(SCRIPTS["trainer"]), "--resilient", "--steps", str(steps), "--step-sleep", str(step_sleep_s),
              "--checkpoint-dir", str(workdir / name / "checkpoints"), "--checkpoint-every", "5", "--log-every", "10"]
    started = time.time()
    job = Nodes([launcher_argv("muster-run", i, NODES, RANKS // NODES, 3, tag, coordinator, script)
                 for i in range(NODES)], env, workdir, name, tag)
    out: dict = {}
    try:
        group = job.marks()
        wait_until(job.stepping_past(1, group, RANKS), 180, "all ranks stepping", 0.05)
        if fault_at_s is not None:
            time.sleep(max(0.0, started + fault_at_s - time.time()))
            current = job.latest(group)
            victim = current[random.randrange(RANKS)]
            survivors = {r["pid"] for r in current.values()} - {victim["pid"]}
            mark = job.marks()
            killed_at = time.time()
            os.kill(victim["pid"], signal.SIGKILL)

            def survivors_stepping():
                after = {}
                for r in job.records_since(mark):
                    if r["pid"] in survivors and r["generation"] > victim["generation"]:
                        after.setdefault(r["pid"], r)
                return len(after) == len(survivors) and after

            firsts = wait_until(survivors_stepping, 60, "every survivor stepping in the new group", 0.01)
            replacement = wait_until(lambda: next((r for r in job.records_since(mark)
                                                   if r["pid"] not in survivors), None), 120,
                                     "the replacement's first step", 0.05)
            before = max(r["step"] for r in job.records_since(group) if r["time"] <= killed_at)
            out.update(victim_rank=victim["rank"],
                       kill_to_step_s=round(max(r["time"] for r in firsts.values()) - killed_at, 3),
                       kill_to_replacement_s=round(replacement["time"] - killed_at, 3),
                       replacement_joined_at_step=replacement["step"],
                       steps_redone=max(0, before - min(r["step"] for r in firsts.values()) + 1),
                       workers_restarted=sum(1 for pid in survivors if pid not in job.workers()))
        for a in job.agents:
            if a.proc.wait(600) != 0:
                raise RuntimeError(f"agent {a.index} exited {a.proc.returncode}: see {a.log_path}")
        text = "".join(a.log_path.read_text(errors="replace") for a in job.agents)
        losses = [json.loads(m) for m in LOSS_RECORD.findall(text)]
        out.update(final_loss=losses[-1]["loss"], final_step=losses[-1]["step"],
                   bytes_received=sum(int(m) for m in RECEIVED.findall(text)),
                   run_s=round(time.time() - started, 1))
        return out
    finally:
        job.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fault-at", type=float, default=15.0, help="seconds from the start to the kill (default 15)")
    p.add_argument("--steps", type=int, default=150, help="the integration's runs' length (default 150)")
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--ways", default="torchrun,muster-run,resilient")
    p.add_argument("--workdir", type=Path, help="keep the logs and checkpoints here (default: a temporary directory)")
    args = p.parse_args()
    logs.configure("warning")
    result: dict = {"benchmark": "trainers", "torch": torch.__version__, "ranks": RANKS, "nodes": NODES,
                    "fault_at_s": args.fault_at, "step_sleep_s": args.step_sleep}
    import accelerate
    import transformers
    result.update(transformers=transformers.__version__, accelerate=accelerate.__version__)
    rc = 0
    with tempfile.TemporaryDirectory(prefix="muster-bench-trainers-") as d:
        workdir = args.workdir or Path(d)
        workdir.mkdir(parents=True, exist_ok=True)
        with muster_coordinator(workdir) as coordinator:
            for way in args.ways.split(","):
                result[way] = {}
                try:
                    if way == "resilient":
                        result[way] = resilient_run(workdir, coordinator, "resilient", args.steps, args.fault_at,
                                                    args.step_sleep)
                        result["uninterrupted"] = resilient_run(workdir, coordinator, "uninterrupted", args.steps,
                                                                None, args.step_sleep)
                    else:
                        (workdir / way).mkdir(exist_ok=True)
                        measured: dict = {}
                        try:
                            kill_cycles(workdir / way, RANKS, NODES, 1, args.step_sleep, 5, 3, False, measured, way,
                                        coordinator if way != "torchrun" else "", SCRIPTS["trainer"], args.fault_at)
                        finally:  # the figures compared (bench/unmodified.py reports the rest)
                            result[way] = {k: measured[k] for k in KEPT if k in measured}
                except (RuntimeError, AssertionError) as exc:  # report what was measured, and why it stopped
                    result[way]["error"] = str(exc)
                    rc = 1
    restart = result.get("muster-run", {}).get("kill_to_step_s", {}).get("p50")
    if restart and result.get("resilient", {}).get("kill_to_step_s"):
        result["resilient_vs_restart_x"] = round(restart / result["resilient"]["kill_to_step_s"], 1)
    print(json.dumps(result, indent=2))
    return rc


if __name__ == "__main__":
    sys.exit(main())
