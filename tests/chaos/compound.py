"""Compound-fault sequences: the chaos table's single faults and the whole-deployment ones, drawn
from a seeded RNG (MUSTER_SOAK_SEED replays a sequence, victims included), and the summary of a
run that the soak prints (seed, faults by kind, recoveries, the longest stall, ranks lost to
faults outside them, wedges)."""

from __future__ import annotations

import random
import statistics
import time
from collections import Counter, defaultdict

from harness import AFTERMATH_S, HEAL_BOUND_S, LIVENESS_BOUND_S, Chaos

from muster.local import record_time

from faults import COMPOUND as COMPOUND_TABLE
from faults import SINGLE, named

TABLE = named(SINGLE)  # the single faults of test_faults.py (docs/reliability.md's table)
COMPOUND = named(COMPOUND_TABLE)  # whole-deployment faults, each a scenario of the harness with its repair


def draw(rng: random.Random, names: list[str], n: int) -> list[str]:
    return [rng.choice(names) for _ in range(n)]


def run(chaos: Chaos, names: list[str], *, until: float | None = None, period_s: float = 0.0) -> str | None:
    """Inject `names` one after another (each `period_s` after the previous one began, and none
    after `until`); returns why the sequence stopped early (the first failure), or None."""
    for name in names:
        if until is not None and time.time() >= until:
            break
        began = time.time()
        try:
            chaos.scenario(name)
        except AssertionError as exc:
            return f"{name}: {exc}"
        time.sleep(max(0.0, began + period_s - time.time()))
    try:
        chaos.between(AFTERMATH_S)  # the last fault's late consequences
    except AssertionError as exc:
        return f"after the last fault: {exc}"
    return None


def _spread(values: list[float]) -> dict:
    return {"n": len(values), "median": round(statistics.median(values), 3), "max": max(values)} if values else {"n": 0}


def summary(chaos: Chaos, report: dict, *, seed: int, began: float, first_step: int, stopped_by: str | None) -> dict:
    faults = report["faults"]
    recovered, resumed = defaultdict(list), defaultdict(list)
    for f in faults:
        if f["recovered_s"] is not None:
            recovered[f["kind"]].append(f["recovered_s"])
        if f["resumed_s"] is not None:
            resumed[f["kind"]].append(f["resumed_s"])
    lost = [line for f in faults for line in f["lost"]]
    wedges = [{"fault": i, "kind": f["kind"], "detail": f["detail"], "why": f["wedged"]}
              for i, f in enumerate(faults) if f["wedged"]]
    seconds = max(time.time() - began, 1e-9)
    return {
        "seed": seed,
        "replay": f"MUSTER_SOAK_SEED={seed}",
        "seconds": round(seconds, 1),
        "faults": len(faults),
        "injected": dict(sorted(Counter(f["kind"] for f in faults).items())),
        "recovered_s": {k: _spread(v) for k, v in sorted(recovered.items())},  # fault -> the answer
        "resumed_s": {k: _spread(v) for k, v in sorted(resumed.items())},  # heal -> every slot stepping again
        "liveness_bound_s": LIVENESS_BOUND_S,  # a single fault -> every surviving slot stepping again
        "heal_bound_s": HEAL_BOUND_S,  # an outage's heal -> the same, however long the outage
        # every outage: how long it lasted, and its heal -> every surviving slot stepping again
        "outages": [{"kind": f["kind"], "outage_s": f["outage_s"], "resumed_s": f["resumed_s"]}
                    for f in faults if f["outage_s"] is not None],
        "longest_stall_s": report["longest_stall_s"],  # max gap between two steps of the job
        "longest_stall_by_kind": {k: max(f["stall_s"] for f in faults if f["kind"] == k)
                                  for k in sorted({f["kind"] for f in faults})},
        # stragglers named but the throttled ranks' nodes (slow_rank): false positives (docs/guide/stragglers.md)
        "stragglers_named": [{k: r.get(k) for k in ("node", "factor", "timestamp")}
                             for replica in chaos.replicas for r in replica.find("straggler_named")
                             if not any(f["slowed"] == r["node"] and f["at"] <= record_time(r) for f in faults)],
        "ranks_lost_to_outside_faults": len(lost),
        "lost": lost,
        # survivors the stuck-thread bound replaced within 3 s (gloo's wait, docs/limits.md): not lost, counted
        "ranks_replaced_by_the_stuck_bound": sum(len(f.get("replaced_stuck", [])) for f in faults),
        "wedges": len(wedges),
        "wedged": wedges,
        "steps_made": report["highest_step"] - first_step,
        "steps_per_s": round((report["highest_step"] - first_step) / seconds, 2),
        "rank_processes": report["rank_processes"],
        "stopped_by": stopped_by,
        "report": str(chaos.workdir / "report.json"),
    }
