"""Stragglers, end to end: how soon a slowed rank is named, and the job's throughput before, during
and after `--straggler-action replace` swaps its node for the hot spare.

One etcd, one coordinator (`--straggler-action replace --straggler-factor F`), N+1 ranks of examples/train_ddp.py
under the worker library on gloo (each its own node; N in the map, one hot spare). For each slowdown
in `--slowdowns`, a fresh job: once every rank steps, one rank of the map is throttled from outside
(`muster.local.Throttle`: SIGSTOP/SIGCONT on a duty cycle) until the leader has replaced it. The
work per step is slept in 2 ms slices (`--step-sleep`), which a throttle stretches as it would
real work (about 1/(1-s) stopped s of every 50 ms; 0.4 and 0.75 measured 1.5x and 3.0x here), and
the factor the leader measured is reported beside them. The default factor here is 1.3: a 1.5x
rank is on the edge of the deployment default's 1.5.

Prints JSON: per slowdown, the throttle, the factor named, detection (throttle → named) in
seconds and in the victim's steps, the replacement (named → the spare in the map) and the job's
steps/s before, while slowed and after the swap (from the ranks' own step records)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from muster import logs
from muster.coordinator.etcd.server import EtcdServer
from muster.local import (AgentProcess, CoordinatorProcess, Throttle, TrainingProcess,
                          end_on_sigterm, record_time, wait_until)

# slowdown name -> (stopped share, period s): ~1.5x and ~3x a rank's compute
SLOWDOWNS = {"1.5x": (0.4, 0.05), "3x": (0.75, 0.05)}
WINDOW_S = 6.0  # seconds of steps each throughput figure is taken over
PLAIN = Path(__file__).resolve().parents[1] / "examples" / "train_plain.py"


def at(record: dict) -> float:
    """When a record was written: a library rank's log records carry a timestamp, the script's step lines a time."""
    return record["time"] if "time" in record else record_time(record)


def steps_per_s(procs: list[TrainingProcess], since: float, until: float) -> float:
    """The job's steps per second over [since, until]: the fastest rank's steps there (all ranks step
    together), per second."""
    best = 0
    for p in procs:
        best = max(best, sum(1 for r in p.steps() if since <= at(r) <= until))
    return round(best / max(until - since, 1e-9), 2)


def per_step_cost_us(rounds: int = 7, iterations: int = 5000) -> dict:
    """What the evidence costs the training thread: the hook in backward (a tiny model's backward
    with and without it) and the sample a step takes (`step_scope` with and without one); for a
    script's rank, the step probe's hook on `optimizer.step()` with and without it."""
    import mmap
    import statistics

    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from muster.worker.rank import step_probe

    from muster.worker import Worker, WorkerConfig
    from muster.worker.compute_clock import ComputeClock

    bare_model, hooked_model, x = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1), torch.randn(2, 4)
    ComputeClock().watch(hooked_model)

    def backward_us(model) -> float:
        t0 = time.perf_counter()
        for _ in range(iterations):
            model(x).sum().backward()
        return (time.perf_counter() - t0) / iterations * 1e6

    scope = Worker(WorkerConfig(coordinators=("127.0.0.1:1",), job="bench", node_id="bench")).step_scope()

    def scope_us(sample: bool) -> float:
        t0 = time.perf_counter()
        for _ in range(iterations * 20):
            with scope:
                if sample:
                    scope.compute._gradients_ready(None)
        return (time.perf_counter() - t0) / (iterations * 20) * 1e6

    # A script's rank under `muster run`: the step probe's hook on optimizer.step() (its sample and
    # its write to the agent's file); the gradient hook is the library's above.
    board = mmap.mmap(-1, step_probe.SIZE)
    probe = step_probe.StepProbe(board, ComputeClock())
    optimizer = torch.optim.SGD(bare_model.parameters(), lr=0.0)
    bare_model(x).sum().backward()

    def optimizer_step_us(probed: bool) -> float:
        handle = register_optimizer_step_post_hook(probe.stepped) if probed else None
        t0 = time.perf_counter()
        for _ in range(iterations):
            optimizer.step()
        took = (time.perf_counter() - t0) / iterations * 1e6
        if handle is not None:
            handle.remove()
        return took

    backward_us(bare_model), backward_us(hooked_model), optimizer_step_us(True)  # warm
    # interleaved, each difference taken within one round: a busy machine shifts both alike
    hook = statistics.median(backward_us(hooked_model) - backward_us(bare_model) for _ in range(rounds))
    sample = statistics.median(scope_us(True) - scope_us(False) for _ in range(rounds))
    probe_step = statistics.median(optimizer_step_us(True) - optimizer_step_us(False) for _ in range(rounds))
    return {"hook_us": round(hook, 2), "sample_us": round(sample, 2), "total_us": round(hook + sample, 2),
            "script_probe_us": round(probe_step, 2), "script_total_us": round(hook + probe_step, 2),
            "budget_us": 20}


class ScriptRank:
    """The one rank of a `muster run` node running examples/train_plain.py (no Muster code: measured
    by the runner's step probe), seen as a TrainingProcess is: its current process's pid and steps."""

    def __init__(self, agent: AgentProcess):
        self.agent = agent

    def start(self) -> ScriptRank:
        self.agent.start()
        return self

    @property
    def pid(self) -> int:
        return self.agent.rank_pids(0)[-1]

    def steps(self) -> list[dict]:
        return self.agent.steps(0)

    @property
    def last_step(self) -> int:
        return max((r["step"] for r in self.steps()), default=0)

    def stop(self) -> None:
        self.agent.stop()


def ranks_of(kind: str, workdir: Path, leader: str, ranks: int, step_sleep_s: float) -> list:
    """N+1 ranks, each its own node: library ranks (train_ddp.py) or a script's under `muster run`."""
    if kind == "library":
        return [TrainingProcess([leader], "straggle", workdir / f"rank-{i}.log", steps=10**9,
                                step_sleep_s=step_sleep_s, min_nodes=ranks - 1, max_nodes=ranks).start()
                for i in range(ranks + 1)]
    script = [sys.executable, str(PLAIN), "--steps", str(10**9), "--step-sleep", str(step_sleep_s),
              "--checkpoint-dir", str(workdir / "checkpoints"), "--checkpoint-every", "100"]
    return [ScriptRank(AgentProcess([leader], "straggle", f"node{i}", workdir / "ranks", slots=1,
                                    nodes=f"{ranks - 1}:{ranks}", command=script)).start() for i in range(ranks + 1)]


def one(workdir: Path, kind: str, ranks: int, step_sleep_s: float, name: str, min_steps: int, factor: float) -> dict:
    stopped, period_s = SLOWDOWNS[name]
    etcd = EtcdServer(workdir / "etcd").start()
    leader = CoordinatorProcess([etcd.endpoint], workdir / "coordinator.log",
                                ["--heartbeat-timeout", "2.0", "--straggler-action", "replace",
                                 "--straggler-min-steps", str(min_steps), "--straggler-factor", str(factor)]).start()
    procs = ranks_of(kind, workdir, leader.address, ranks, step_sleep_s)
    throttle = None
    try:
        wait_until(lambda: sum(1 for p in procs if len(p.steps()) >= 40) == ranks, 180, "the map's ranks stepping")
        stepping = [p for p in procs if p.steps()]
        time.sleep(WINDOW_S)
        began = time.time()
        before = steps_per_s(stepping, began - WINDOW_S, began)
        victim = stepping[-1]
        step_at_throttle = victim.last_step
        throttle = Throttle(victim.pid, stopped, period_s).start()
        named = wait_until(lambda: leader.find("straggler_named"), 120, "the straggler named")[0]
        named_at = at(named)
        step_at_named = max([r["step"] for r in victim.steps() if at(r) <= named_at] or [step_at_throttle])
        during = steps_per_s(stepping, began + (named_at - began) / 2, named_at)
        left = wait_until(lambda: leader.find("membership_changed", kind="node_left"), 60, "the node's planned leave")
        spare = next(p for p in procs if p not in stepping)
        wait_until(lambda: len(spare.steps()) >= 5, 60, "the spare stepping in the map")
        swapped_at = at(spare.steps()[0])
        time.sleep(WINDOW_S + 1)
        after = steps_per_s([p for p in procs if p is not victim], swapped_at + 1, swapped_at + 1 + WINDOW_S)
        return {
            "ranks": kind, "slowdown": name, "throttle": {"stopped": stopped, "period_s": period_s},
            "factor_named": named["factor"], "loss_named": named["loss"], "whole_node": named["whole_node"],
            "detection_s": round(named_at - began, 2), "detection_steps": step_at_named - step_at_throttle,
            "left_after_named_s": round(at(left[0]) - named_at, 2),
            "spare_stepping_after_named_s": round(swapped_at - named_at, 2),
            "steps_per_s": {"before": before, "slowed": during, "after_swap": after},
            "others_named": [r["node"] for r in leader.find("straggler_named")[1:]],
        }
    finally:
        if throttle is not None:
            throttle.stop()
        for p in procs:
            p.stop()
        leader.stop()
        etcd.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4, help="ranks in the map (one more runs as the spare)")
    p.add_argument("--step-sleep", type=float, default=0.05, help="seconds of simulated compute a step")
    p.add_argument("--slowdowns", default="1.5x,3x", help=f"of {', '.join(SLOWDOWNS)}")
    p.add_argument("--kinds", default="library,script", help="library (train_ddp.py), script (train_plain.py, "
                   "unmodified, under muster run), or both")
    p.add_argument("--min-steps", type=int, default=20, help="--straggler-min-steps")
    p.add_argument("--factor", type=float, default=1.3, help="--straggler-factor")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args()
    logs.configure("warning")
    results = []
    cost = per_step_cost_us()
    names = [s.strip() for s in args.slowdowns.split(",") if s.strip()]
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = [n for n in names if n not in SLOWDOWNS] + [k for k in kinds if k not in ("library", "script")]
    if unknown:
        print(f"stragglers.py: unknown {unknown}; slowdowns: {', '.join(SLOWDOWNS)}; kinds: library, script",
              file=sys.stderr)
        return 2
    for kind in kinds:
        for name in names:
            with tempfile.TemporaryDirectory(prefix="muster-stragglers-") as tmp:
                results.append(one(Path(tmp), kind, args.ranks, args.step_sleep, name, args.min_steps, args.factor))
    out = {"bench": "stragglers", "ranks": args.ranks, "spares": 1, "step_sleep_s": args.step_sleep,
           "min_steps": args.min_steps, "factor": args.factor, "backend": "gloo",
           "per_step_cost": cost, "results": results}
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    end_on_sigterm()
    sys.exit(main())
