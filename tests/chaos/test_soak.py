"""Soak mode, outside CI: `pytest tests/chaos/test_soak.py --soak MINUTES -s`. A random fault every
15 s — the chaos table's single faults, the compound ones (etcd total outage, every coordinator
down, etcd data loss, a rank killed during an outage, the leader frozen as it publishes a reform,
a hostile client) and a partition when network namespaces can be made — on one cluster, drawn
from MUSTER_SOAK_SEED (printed; set it to replay a sequence); MUSTER_SOAK_FAULTS=a,b,... draws
from those kinds only. MUSTER_SOAK_RELAYS=1 runs three replicas with relays on (every node streams
through the replica its id hashes to) and adds the relaying replica's SIGKILL to the kinds. Each
etcd outage and coordinator outage lasts a length drawn between 5 s and MUSTER_SOAK_OUTAGE_MAX_S
(default 120). The invariants are checked after each fault; a wedge (the job not stepping
again within the liveness bound) or a rank lost to a fault outside it is recorded and the soak
goes on; any other broken invariant stops it. Prints JSON (seed, faults by kind, recoveries,
longest stall, ranks lost, wedges) and writes it with every fault to report.json."""

import json
import os
import random
import time

from compound import COMPOUND, TABLE, draw, run, summary
from harness import Chaos, NetNamespace

PERIOD_S = 15.0


def test_soak(request, tmp_path):
    minutes = request.config.getoption("--soak")
    seed = int(os.environ.get("MUSTER_SOAK_SEED", time.time()))
    rng = random.Random(seed)
    ns = None if NetNamespace.unavailable() else NetNamespace("soak").create()
    relays = os.environ.get("MUSTER_SOAK_RELAYS", "") not in ("", "0")
    names = TABLE + COMPOUND + (["partition"] if ns else []) + (["relay"] if relays else [])
    only = [n.strip() for n in os.environ.get("MUSTER_SOAK_FAULTS", "").split(",") if n.strip()]
    unknown = sorted(set(only) - set(names))
    assert not unknown, f"MUSTER_SOAK_FAULTS names unknown kinds {unknown}; known: {names}"
    names = only or names
    longest = float(os.environ.get("MUSTER_SOAK_OUTAGE_MAX_S", 120))
    print(json.dumps({"seed": seed, "minutes": minutes, "kinds": names, "relays": relays, "outages_s": [5, longest]}),
          flush=True)
    chaos = Chaos(tmp_path, job="soak", host=ns.host_ip if ns else "127.0.0.1", netns={"node2": ns} if ns else {},
                  seed=seed, strict=False, outages_s=(5.0, max(5.0, longest)), **({"replicas": 3, "relay_min_nodes": 1} if relays else {}))
    stopped_by, report, first_step, began = None, None, 0, time.time()
    try:
        chaos.start()
        first_step = max(r["step"] for r in chaos.last_steps().values())
        began = time.time()
        sequence = draw(rng, names, int(minutes * 60 / PERIOD_S) + 1)
        stopped_by = run(chaos, sequence, until=began + minutes * 60, period_s=PERIOD_S)
    finally:
        report = chaos.report()
        leftovers = chaos.stop()
        if ns is not None:
            ns.delete()
    out = summary(chaos, report, seed=seed, began=began, first_step=first_step, stopped_by=stopped_by)
    if relays:
        out["replay"] += " MUSTER_SOAK_RELAYS=1"
    out["replay"] += f" MUSTER_SOAK_OUTAGE_MAX_S={longest:g}"
    (tmp_path / "report.json").write_text(json.dumps({"summary": out, **report}, indent=2, default=str))
    print(json.dumps(out, indent=2))
    assert not leftovers, f"processes left behind: {leftovers}"
    assert stopped_by is None, f"the soak stopped (seed {seed}): {stopped_by}"
    assert not out["stragglers_named"], f"seed {seed}: healthy ranks named stragglers: {out['stragglers_named']}"
    assert not out["wedges"] and not out["ranks_lost_to_outside_faults"], \
        f"seed {seed}: {out['wedges']} wedge(s), {out['ranks_lost_to_outside_faults']} rank(s) lost to faults " \
        f"outside them; see {tmp_path / 'report.json'}"
