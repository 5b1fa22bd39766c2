"""`make bench-check`: the leader's hot path against its committed figures. Prints one JSON object;
exit 0 when every figure is within its tolerance, 1 when one is worse (a regression), 2 when one is
worse but the machine was too noisy to tell (run it again when `uptime` shows less load).

The figures (`bench/capacity.py`'s, each the median over --reps runs):
- in-process at 100k ranks (12,500 nodes x 8), CPU time: a membership change in the leader
  (`leader_change_ms`: liveness, decide, encode, every node's directive), `decide`, the state's
  encoding, a quiet tally tick, one node frame, a default Status, a straggler look;
- over the network, 1,000 direct nodes x 10 frames/s on one leader: the frame -> leader-visible
  latency (p50, p99) and the leader's CPU per frame (its event loop's, and the whole process's).

The machine's noise, measured around every repetition with a fixed CPU workload (`calibrate`):
its CPU time against the baseline's (`speed`, by which the CPU figures are scaled: a host whose
caches are shared with other load runs every CPU figure slower alike), the spread of that CPU time
(`cpu_spread`), and its wall time over its CPU time (`wall_over_cpu`: how much of a core the check
got). A figure fails when, scaled, it is worse than the baseline by more than its tolerance
(relative, plus an absolute slack for tiny figures); on a machine whose noise is past NOISY such a
figure is inconclusive instead (exit 2), since the scaling cannot be trusted there. The baseline is
bench/results/bench_check.json, written by --update from a run on a quiet machine (its load is
recorded beside it).

The wall-clock latencies are judged against an absolute bound as well (`Figure.bound`, the
product's target: frame p50 <= 5 ms, p99 <= 10 ms): past it a figure is worse whatever the noise
and the baseline say, so neither a slow baseline nor a noisy host can pass a regression; within it
the baseline's tolerance applies as above (and past that on a noisy host: inconclusive). The
noise tolerated, per figure: CPU figures, after scaling, 20-50% + a slack of 0.5-5 in their unit;
latencies p50 +50% + 1 ms and p99 +100% + 5 ms over the baseline's median of 3 runs (a p99 of one
8 s window varies 2-3x between runs of one quiet host: 4.1, 7.0, 11.0 ms in the baseline's), never
past the bound; noise past NOISY (the calibration's CPU varying by 25%, or getting 2/3 of a core)
turns a figure over its tolerance, not over its bound, inconclusive. A network point that cannot
run twice in one repetition (the nodes not all streaming within its bound: the leader, or the
host, does not keep up at all) makes every network figure `unmeasured`, a failure that quotes the
point's error; the in-process figures are judged all the same.

The reform's own cost at a real size (`reform_excess_s`, once, after the repetitions): bench/
death_heard.py's kills under `muster run` (2 agents x 2 slots, gloo, CPU), REFORM_KILLS kills
each, with the tiny model and with REFORM_MODEL (50M parameters with Adam, 600 MB of state a
rank): kill -> the last survivor's group formed without the victim (each then begins its step),
the median, of the big one less 1.5x the tiny one's. (Not "a step completed": at 50M that is the
step itself, ~2 s on 2 cores.) Both run on the same host minutes apart, so its speed cancels out;
the bound is the target (0.15 s): a death heard and a group re-formed at the same speed whatever
the model's size. ~2 minutes and ~5 GB of memory (--skip-reform: not).

    python bench/check.py                 # check (3 repetitions, 4.5-5 minutes with the reform)
    python bench/check.py --update        # write the baseline (after a deliberate change)
    python bench/check.py --skip-network --skip-reform  # the in-process figures only (~30 s)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import capacity  # noqa: E402
from muster import logs  # noqa: E402
from muster.local import end_on_sigterm  # noqa: E402

BASELINE = Path(__file__).parent / "results" / "bench_check.json"
REFORM_MODEL, REFORM_KILLS = "50M", 3
RANKS, SLOTS = 100_000, 8
NODES, RATE = 1_000, 10.0
# Past these the machine is too noisy to call a figure over its tolerance a regression.
NOISY = {"cpu_spread": 0.25, "wall_over_cpu": 1.5}


@dataclass(frozen=True)
class Figure:
    """One figure: where it is in a repetition's results, and how much worse than the baseline passes."""

    name: str
    path: tuple[str, ...]
    tolerance: float  # relative, before the noise is added
    slack: float  # absolute, in the figure's unit: tiny figures jitter by more than their percent
    cpu: bool  # CPU time: scaled by the machine's speed; otherwise wall time (latencies), not scaled
    bound: float | None = None  # absolute, a wall figure's: past it worse, whatever the baseline and the noise


FIGURES = (
    Figure("leader_change_ms", ("membership", "leader_change_ms"), 0.20, 5.0, True),
    Figure("decide_node_lost_ms", ("membership", "decide_ms", "node_lost"), 0.20, 2.0, True),
    Figure("encode_ms", ("membership", "encode_ms"), 0.25, 2.0, True),
    Figure("tick_ms", ("membership", "tick_ms"), 0.50, 0.5, True),
    Figure("frame_us", ("membership", "frame_us"), 0.20, 2.0, True),
    Figure("status_ms", ("membership", "status_ms"), 0.25, 2.0, True),
    Figure("straggler_look_ms", ("membership", "straggler_look_ms"), 0.25, 2.0, True),
    Figure("frame_latency_p50_ms", ("network", "frame_latency_ms", "p50"), 0.50, 1.0, False, bound=5.0),
    Figure("frame_latency_p99_ms", ("network", "frame_latency_ms", "p99"), 1.00, 5.0, False, bound=10.0),
    Figure("leader_loop_us_per_node_frame", ("network", "leader_loop_us_per_node_frame"), 0.25, 3.0, True),
    Figure("leader_frame_cpu_us_per_node_frame", ("network", "leader_frame_cpu_us_per_node_frame"), 0.25, 5.0, True),
    Figure("straggler_slice_max_ms", ("membership", "straggler_slice_max_ms"), 0.50, 1.0, True),
    # the big model's kill -> stepping over 1.5x the tiny one's: near 0, so an absolute tolerance
    Figure("reform_excess_s", ("reform", "excess_s"), 0.0, 0.1, False, bound=0.15),
)


def calibrate() -> tuple[float, float]:
    """(CPU s, wall s) of a fixed workload shaped like the leader's: small objects made, looked up
    in dicts, formatted."""
    wall, cpu = time.perf_counter(), time.thread_time()
    table = {}
    for i in range(150_000):
        key = f"node-{i % 5000:05d}"
        table[key] = (i, key, [i, i + 1])
        table.get(key[::-1])
    return time.thread_time() - cpu, time.perf_counter() - wall


def repetition(workdir: Path, ranks: int, network: bool) -> dict:
    result = {"membership": capacity.membership_at(ranks, SLOTS, 3)}
    if network:
        for attempt in range(2):  # once more on a fresh deployment: a loaded host can time out the Joins
            point = capacity.heartbeat_capacity(workdir / str(attempt), [(NODES, RATE)], SLOTS, 2, window_s=4.0,
                                                warmup_s=2.0)["points"][0]
            if "error" not in point:
                result["network"] = point
                break
        else:  # judged as a failure of every network figure; the other figures are still measured
            result["network_error"] = point["error"]
    return result


def reform(workdir: Path) -> dict:
    """Kill -> the last survivor's group formed, median, with the tiny model and with REFORM_MODEL
    (death_heard.py's kills under `muster run`); the excess of the big one over 1.5x the tiny one,
    and the big one's marks from the kill."""
    import death_heard  # (beside this file)

    runs = {}
    for model in ("tiny", REFORM_MODEL):
        (workdir / model).mkdir(parents=True)
        runs[model] = death_heard.run(workdir / model, model, REFORM_KILLS)
    tiny, big = (runs[m]["formed_s"]["median"] for m in ("tiny", REFORM_MODEL))
    marks = ("dying_s", "decided_s", "reaped_s", "began_s", "formed_s")
    return {"model": REFORM_MODEL, "tiny_s": tiny, "sized_s": big, "excess_s": round(big - 1.5 * tiny, 4),
            "timeline": {m: runs[REFORM_MODEL][m]["median"] for m in marks if m in runs[REFORM_MODEL]}}


def value(rep: dict, path: tuple[str, ...]) -> float | None:
    for key in path:
        if not isinstance(rep, dict) or key not in rep:
            return None
        rep = rep[key]
    return rep


def measure(reps: int, ranks: int, network: bool, sized_reform: bool) -> dict:
    calibration, results = [], []
    with tempfile.TemporaryDirectory(prefix="muster-bench-check-") as d:
        for i in range(reps):
            calibration.extend(calibrate() for _ in range(3))
            results.append(repetition(Path(d) / str(i), ranks, network))
        calibration.extend(calibrate() for _ in range(3))
        if sized_reform:  # once: its p50 is over REFORM_KILLS kills already
            results[0]["reform"] = reform(Path(d) / "reform")
    cpu = [c for c, _ in calibration]
    unmeasured = [r["network_error"] for r in results if "network_error" in r]
    figures = {}
    for f in FIGURES:
        values = [v for r in results if (v := value(r, f.path)) is not None]
        if values:
            figures[f.name] = {"median": round(statistics.median(values), 3), "runs": values,
                               "tolerance": f.tolerance, "slack": f.slack,
                               "clock": "cpu" if f.cpu else "wall"}
    return {
        **({"reform": results[0]["reform"]} if sized_reform else {}),
        "calibration_cpu_ms": round(statistics.median(cpu) * 1e3, 2),
        "noise": {"cpu_spread": round((max(cpu) - min(cpu)) / statistics.median(cpu), 3),
                  "wall_over_cpu": round(statistics.median(w / c for c, w in calibration), 3)},
        "figures": figures,
        **({"network_errors": unmeasured} if unmeasured else {}),
    }


def judge(now: dict, baseline: dict) -> tuple[int, list[dict]]:
    """(exit status, one verdict per figure)."""
    speed = now["calibration_cpu_ms"] / baseline["calibration_cpu_ms"]
    noise = now["noise"]
    noisy = any(noise[k] > limit for k, limit in NOISY.items())
    verdicts, status = [], 0
    for f in FIGURES:
        ours, theirs = now["figures"].get(f.name), baseline["figures"].get(f.name)
        if theirs is not None and f.path[0] == "network" and now.get("network_errors"):
            # a repetition whose point could not run (1,000 nodes not all streaming in time, their
            # Joins timing out): the leader did not keep up at all, the worst of latencies
            status = 1
            verdicts.append({"figure": f.name, "verdict": "unmeasured", "baseline": theirs["median"],
                             "error": now["network_errors"][0]})
            continue
        if ours is None:
            continue
        scaled = ours["median"] / speed if f.cpu else ours["median"]
        allowed = theirs["median"] * (1 + f.tolerance) + f.slack if theirs is not None else None
        if f.bound is not None and scaled > f.bound:
            verdict = "worse"  # the promise itself: no baseline or noise excuses it
        elif allowed is None:
            verdict = "no baseline"  # a figure newer than the baseline: its bound alone (--update adds it)
        else:
            verdict = "ok" if scaled <= allowed else ("inconclusive" if noisy else "worse")
        status = max(status, {"ok": 0, "no baseline": 0, "inconclusive": 2, "worse": 1}[verdict])
        verdicts.append({"figure": f.name, "verdict": verdict, "median": ours["median"], "scaled": round(scaled, 3),
                         **({"allowed": round(allowed, 3), "baseline": theirs["median"]} if theirs is not None else {}),
                         **({"bound": f.bound} if f.bound is not None else {})})
    return status, verdicts


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=10).stdout.strip()
    except OSError:
        return ""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3, help="repetitions of every figure (the median is judged)")
    p.add_argument("--update", action="store_true", help=f"write the baseline ({BASELINE.name}) instead of checking")
    p.add_argument("--skip-network", action="store_true", help="no figure over the network")
    p.add_argument("--skip-reform", action="store_true", help=f"no {REFORM_MODEL} reform (its ranks: ~5 GB, ~3 min)")
    p.add_argument("--baseline", type=Path, default=BASELINE)
    p.add_argument("--ranks", type=int, default=RANKS, help="the in-process figures' job size (a smoke test: fewer)")
    args = p.parse_args()
    logs.configure("warning")
    load = [round(x, 2) for x in os.getloadavg()]
    now = {"benchmark": "bench_check", "commit": commit(), "host": {"cpus": os.cpu_count(), "loadavg_at_start": load},
           "repetitions": args.reps, "ranks": args.ranks, **measure(args.reps, args.ranks, not args.skip_network,
                                                               not args.skip_reform)}
    now["host"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    if args.update:
        args.baseline.write_text(json.dumps(now, indent=2) + "\n")
        print(json.dumps(now, indent=2))
        return 0
    baseline = json.loads(args.baseline.read_text())
    if baseline.get("ranks") != args.ranks:
        raise SystemExit(f"bench-check: the baseline is of {baseline.get('ranks')} ranks, not {args.ranks}")
    status, verdicts = judge(now, baseline)
    now["baseline"] = {"commit": baseline.get("commit"), "host": baseline.get("host"),
                       "calibration_cpu_ms": baseline["calibration_cpu_ms"]}
    now["speed_vs_baseline"] = round(now["calibration_cpu_ms"] / baseline["calibration_cpu_ms"], 3)
    now["verdicts"] = verdicts
    now["result"] = {0: "pass", 1: "worse than the baseline", 2: "inconclusive: too noisy, run it again"}[status]
    print(json.dumps(now, indent=2))
    for v in verdicts:
        if v["verdict"] == "unmeasured":
            print(f"bench-check: {v['figure']} unmeasured: the network point failed twice in a repetition "
                  f"(host {now['speed_vs_baseline']}x the baseline's CPU time): {v['error']}", file=sys.stderr)
        elif v["verdict"] != "ok":
            past = f"its bound {v['bound']}" if v.get("bound") is not None and v["scaled"] > v["bound"] else \
                f"{v['allowed']} allowed (baseline {v['baseline']})"
            print(f"bench-check: {v['figure']} {v['verdict']}: {v['scaled']} (scaled) > {past}", file=sys.stderr)
    return status


if __name__ == "__main__":
    end_on_sigterm()
    sys.exit(main())
