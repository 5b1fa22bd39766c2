"""Soak mode, outside CI: `pytest tests/chaos/test_soak.py --soak MINUTES -s`. A random fault every
15 s (a partition too when network namespaces can be made) on one cluster; the invariants are
checked after each. Prints progress made and recoveries as JSON, and writes it to report.json."""

import json
import os
import random
import statistics
import time
from collections import defaultdict

from harness import Chaos, NetNamespace

from test_faults import SEQUENCE

PERIOD_S = 15.0


def test_soak(request, tmp_path):
    minutes = request.config.getoption("--soak")
    seed = int(os.environ.get("MUSTER_SOAK_SEED", time.time()))
    rng = random.Random(seed)
    ns = None if NetNamespace.unavailable() else NetNamespace("msoak", 2).create()
    chaos = Chaos(tmp_path, job="soak", host=ns.host_ip if ns else "127.0.0.1", netns={"node2": ns} if ns else {})
    names = SEQUENCE + (["partition"] if ns else [])
    try:
        chaos.start()
        first_step = max(r["step"] for r in chaos.last_steps().values())
        began = time.time()
        while time.time() - began < minutes * 60:
            time.sleep(max(0.0, PERIOD_S - (time.time() - began) % PERIOD_S))
            chaos.scenario(rng.choice(names))
        report = chaos.report()
    finally:
        leftovers = chaos.stop()
        if ns is not None:
            ns.delete()
    by_kind = defaultdict(list)
    for f in report["faults"]:
        by_kind[f["name"]].append(f["recovered_s"])
    summary = {
        "seed": seed, "minutes": minutes, "faults": len(report["faults"]),
        "steps_made": report["highest_step"] - first_step,
        "steps_per_s": round((report["highest_step"] - first_step) / (time.time() - began), 2),
        "rank_processes": report["rank_processes"],
        "recovered_s": {k: {"n": len(v), "median": round(statistics.median(v), 3), "max": max(v)}
                        for k, v in sorted(by_kind.items())},
        "report": str(tmp_path / "report.json"),
    }
    print(json.dumps(summary, indent=2))
    assert not leftovers, f"processes left behind: {leftovers}"
