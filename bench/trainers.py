"""The same trainer scripts, 2 nodes x 2 ranks, ranks SIGKILLed one at a time from a fault's time
into the run, three ways each, for three trainers (examples/train_trainer.py: a Hugging Face Trainer
with a small GPT-2, save_steps=5; examples/train_lightning.py: a Lightning MLP, ModelCheckpoint
every 5 steps; examples/train_accelerate.py: a hand-written Accelerate loop with the GPT-2,
save_state every 5 steps; all on CPU/gloo):

  torchrun     plain torchrun (c10d): every worker restarts and resumes from the last checkpoint
  muster-run   `muster run -- torchrun …` (the restart path, warm starts): the same, faster
  resilient    `muster run` with the script's one line (`--resilient`: muster.worker.integrations.hf,
               .lightning, .accelerate): the survivors re-form in-process, the replacement takes
               the state from them

Reported per trainer and way, over --kills kills (min, median, max): kill_to_step_s (the kill until
every rank still in the job has completed a step in the new group: under the restart paths every
rank restarted; with the integration the three survivors, in the group formed without the victim),
steps_redone (the highest step completed before the kill minus the first step after it, plus one),
workers_restarted. For the integration also: kill_to_replacement_s (until the replacement's first
step), bytes_received (the state the replacements took from their peers, all kills; survivors take
none), and the final loss of a run of at least --steps steps with the kills (on to the first step
all ranks run) against the same run, as long, uninterrupted (rank 0's loss of the last logged
step; HF's: averaged over the ranks and 10 steps).

    python bench/trainers.py [--fault-at 15] [--kills 3] [--steps N] > bench/results/trainers.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
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
TRAINERS = {"hf": "trainer", "lightning": "lightning", "accelerate": "accelerate"}  # -> unmodified.SCRIPTS
# The integration's runs' length: long enough to outlast the kills (Lightning's MLP steps ~5x faster
# than the GPT-2's: at 250 steps its run ended before the third kill's replacement joined)
STEPS = {"hf": 250, "lightning": 1000, "accelerate": 250}
LOSS_RECORD = re.compile(r'\{"event": "loss"[^{}]*\}')
KEPT = ("start_to_step_s", "kill_to_step_s", "steps_lost", "workers_restarted", "workers_left_after_stop", "error")
RECEIVED = re.compile(r"group_formed .*bytes_received=(\d+)")


def spread(values: list[float]) -> dict:
    return {"min": min(values), "median": round(statistics.median(values), 3), "max": max(values), "all": values}


def current_group(job: Nodes, mark: list[int]) -> dict[int, dict]:
    """The latest record of each process stepping in the newest generation since `mark`, by pid."""
    records = job.records_since(mark)
    newest = max((r["generation"] for r in records), default=None)
    return {r["pid"]: r for r in records if r["generation"] == newest}


def resilient_run(workdir: Path, coordinator: str, trainer: str, name: str, steps: int, fault_at_s: float | None,
                  kills: int, step_sleep_s: float) -> dict:
    """One run of the script with its line to --steps; from fault_at_s after the agents start (None:
    uninterrupted), `kills` times: a random rank SIGKILLed, once every rank steps 5 past the last
    replacement's first step. With kills, the run goes on past --steps to the first step all ranks
    run (--until-world: the last replacement's imports take what they take)."""
    tag = uuid.uuid4().hex
    env = {**os.environ, "MUSTER_BENCH_RUN": tag}
    until = ["--until-world", str(RANKS)] if fault_at_s is not None and kills else []
    script = [str(SCRIPTS[TRAINERS[trainer]]), "--resilient", "--steps", str(steps), *until, "--step-sleep", str(step_sleep_s),
              "--checkpoint-dir", str(workdir / name / "checkpoints"), "--checkpoint-every", "5", "--log-every", "10"]
    started = time.time()
    job = Nodes([launcher_argv("muster-run", i, NODES, RANKS // NODES, 3, tag, coordinator, script)
                 for i in range(NODES)], env, workdir, name, tag)
    out: dict = {}
    per_kill: dict[str, list] = {k: [] for k in ("victim_rank", "kill_to_step_s", "kill_to_replacement_s",
                                                   "replacement_joined_at_step", "steps_redone", "workers_restarted")}
    try:
        mark = job.marks()
        wait_until(lambda: len(current_group(job, mark)) == RANKS and current_group(job, mark), 180,
                   "all ranks stepping", 0.05)
        if fault_at_s is not None:
            time.sleep(max(0.0, started + fault_at_s - time.time()))
        for _ in range(kills if fault_at_s is not None else 0):
            current = current_group(job, mark)
            victim = random.choice(list(current.values()))
            survivors = set(current) - {victim["pid"]}
            before = max(r["step"] for r in current.values())
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
                                                   if r["pid"] not in survivors), None), 240,
                                     "the replacement's first step", 0.05)
            for key, value in (("victim_rank", victim["rank"]),
                               ("kill_to_step_s", round(max(r["time"] for r in firsts.values()) - killed_at, 3)),
                               ("kill_to_replacement_s", round(replacement["time"] - killed_at, 3)),
                               ("replacement_joined_at_step", replacement["step"]),
                               ("steps_redone", max(0, before - min(r["step"] for r in firsts.values()) + 1)),
                               ("workers_restarted", sum(1 for pid in survivors if pid not in job.workers()))):
                per_kill[key].append(value)
            wait_until(lambda: len(current_group(job, mark)) == RANKS
                       and min(r["step"] for r in current_group(job, mark).values()) >= replacement["step"] + 5,
                       120, "every rank 5 steps past the replacement's first", 0.05)
        if per_kill["kill_to_step_s"]:
            out.update(victim_ranks=per_kill["victim_rank"], replacement_joined_at_steps=per_kill["replacement_joined_at_step"],
                       kill_to_step_s=spread(per_kill["kill_to_step_s"]),
                       kill_to_replacement_s=spread(per_kill["kill_to_replacement_s"]),
                       steps_redone=max(per_kill["steps_redone"]), workers_restarted=sum(per_kill["workers_restarted"]))
        for a in job.agents:
            if a.proc.wait(600) != 0:
                raise RuntimeError(f"agent {a.index} exited {a.proc.returncode}: see {a.log_path}")
        text = "".join(a.log_path.read_text(errors="replace") for a in job.agents)
        losses = [json.loads(m) for m in LOSS_RECORD.findall(text)]
        out.update(last_step=max(r["step"] for r in job.records_since([0] * NODES, running=False)),
                   final_loss=round(losses[-1]["loss"], 4), final_step=losses[-1]["step"],
                   bytes_received=sum(int(m) for m in RECEIVED.findall(text)),
                   run_s=round(time.time() - started, 1))
        return out
    finally:
        job.stop()


def restart_run(workdir: Path, coordinator: str, trainer: str, way: str, kills: int, fault_at_s: float,
                step_sleep_s: float) -> dict:
    """The script without its line under torchrun or `muster run`'s restart path, `kills` kills."""
    (workdir / f"{trainer}-{way}").mkdir(exist_ok=True)
    measured: dict = {}
    try:
        kill_cycles(workdir / f"{trainer}-{way}", RANKS, NODES, kills, step_sleep_s, 5, kills + 2, False, measured, way,
                    coordinator if way != "torchrun" else "", SCRIPTS[TRAINERS[trainer]], fault_at_s)
    finally:  # the figures compared (bench/unmodified.py reports the rest)
        out = {k: measured[k] for k in KEPT if k in measured}
        if "kill_to_step_s" in out:
            out["kill_to_step_s"] = spread(out["kill_to_step_s"]["all"])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fault-at", type=float, default=15.0, help="seconds from the start to the first kill (default 15)")
    p.add_argument("--kills", type=int, default=3, help="kills per trainer and way (default 3)")
    p.add_argument("--steps", type=int, help=f"the integration's runs' length (default per trainer: {STEPS})")
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--trainers", default=",".join(TRAINERS))
    p.add_argument("--ways", default="torchrun,muster-run,resilient")
    p.add_argument("--workdir", type=Path, help="keep the logs and checkpoints here (default: a temporary directory)")
    args = p.parse_args()
    logs.configure("warning")
    import accelerate
    import lightning
    import transformers
    result: dict = {"benchmark": "trainers", "torch": torch.__version__, "transformers": transformers.__version__,
                    "accelerate": accelerate.__version__, "lightning": lightning.__version__, "ranks": RANKS,
                    "nodes": NODES, "fault_at_s": args.fault_at, "kills": args.kills, "step_sleep_s": args.step_sleep,
                    "load_at_start": " ".join(Path("/proc/loadavg").read_text().split()[:3])}
    rc = 0
    with tempfile.TemporaryDirectory(prefix="muster-bench-trainers-") as d:
        workdir = args.workdir or Path(d)
        workdir.mkdir(parents=True, exist_ok=True)
        with muster_coordinator(workdir) as coordinator:
            for trainer in args.trainers.split(","):
                rows = result[trainer] = {}
                for way in args.ways.split(","):
                    rows[way] = {}
                    try:
                        if way == "resilient":
                            rows[way] = resilient_run(workdir, coordinator, trainer, f"{trainer}-resilient",
                                                      args.steps or STEPS[trainer],
                                                      args.fault_at, args.kills, args.step_sleep)
                            rows["uninterrupted"] = resilient_run(workdir, coordinator, trainer,  # as long
                                                                  f"{trainer}-uninterrupted", rows[way]["last_step"],
                                                                  None, 0, args.step_sleep)
                        else:
                            rows[way] = restart_run(workdir, coordinator, trainer, way, args.kills, args.fault_at,
                                                    args.step_sleep)
                    except (RuntimeError, AssertionError) as exc:  # report what was measured, and why it stopped
                        rows[way]["error"] = str(exc)
                        rc = 1
                restart = rows.get("muster-run", {}).get("kill_to_step_s", {}).get("median")
                resilient = rows.get("resilient", {}).get("kill_to_step_s", {}).get("median")
                if restart and resilient:
                    rows["resilient_vs_restart_x"] = round(restart / resilient, 1)
    result["load_at_end"] = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    print(json.dumps(result, indent=2))
    return rc


if __name__ == "__main__":
    sys.exit(main())
