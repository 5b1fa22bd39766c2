"""How soon a killed rank's death is heard, by the victim's size, under `muster run` (issue 59):
2 agents x 2 slots of examples/train_ddp.py (worker library, gloo) against a real etcd and
coordinator, for each model asked (--model: tiny, 17M, 50M, 100M; Adam, 12 bytes of state a
parameter); one rank SIGKILLed --kills times, its agent's replacement let rejoin in between.

The kernel frees a killed process's memory before it closes its sockets and lets it be reaped, so
a big rank's death reached the others late. Its agent now reads the kill under way from /proc
(supervisor.watch_dying) and reports the exit at once. Per kill, seconds from the signal (min,
median, max over kills), on the machine's one clock:

  dying_s      the agent read the kill under way (its rank_dying record)
  reaped_s     the victim reaped (its rank_exited record): what the agent waited for before
  decided_s    the leader's decision (its membership_changed record)
  began_s      the last survivor's reform began (its group_formed time less the reform's seconds):
               a survivor in a step's compute leaves it at the step's next module
  formed_s     the last survivor's group formed without the victim (group_formed)
  stepped_s    the last survivor's first step completed in that group (a kill lands inside a step:
               up to one steady step, steady_step_s, of this is the step the survivors redo)
  heard_before_reap_s   reaped_s - dying_s: what the read saves
  phases       the survivors' reform by phase (max over survivors, median over kills): abort_s,
               destroy_s, store_s, barrier_s, init_s, fingerprint_s, agree_s, sync_s, seconds

    python bench/death_heard.py [--model tiny,50M] [--kills 3] > bench/results/death_heard.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from muster import logs
from muster.coordinator.etcd.server import EtcdServer
from muster.local import AgentProcess, CoordinatorProcess, end_on_sigterm, record_time, wait_until

JOB, NODES, SLOTS = "death-heard", ("a", "b"), (0, 1)
STEP_SLEEP_S = 0.05
SETTLED = 3  # steps every rank takes in a group of all of them before the next kill
PHASES = ("abort_s", "destroy_s", "store_s", "barrier_s", "init_s", "fingerprint_s", "agree_s", "sync_s", "seconds")


def spread(values: list[float]) -> dict:
    return {"min": round(min(values), 4), "median": round(statistics.median(values), 4),
            "max": round(max(values), 4), "all": [round(v, 4) for v in values]}


def latest_steps(agents: list[AgentProcess]) -> dict[tuple[str, int], list[dict]]:
    return {(a.node_id, s): a.steps(s) for a in agents for s in SLOTS}


def settled(agents: list[AgentProcess]) -> int | None:
    """The generation all four slots' latest processes step in, SETTLED steps in; None until then."""
    steps = latest_steps(agents).values()
    if not all(steps):
        return None
    newest = max(s[-1]["generation"] for s in steps)
    ok = all(len([r for r in s if r["generation"] == newest and r["world_size"] == len(NODES) * len(SLOTS)]) >= SETTLED
             for s in steps)
    return newest if ok else None


def one_kill(leader: CoordinatorProcess, agents: list[AgentProcess]) -> dict[str, float]:
    generation = wait_until(lambda: settled(agents), 600, "every rank stepping together", interval_s=0.1)
    node, slot = random.choice(agents), random.choice(SLOTS)
    victim = node.rank_pids(slot)[-1]
    survivors = [(a, s) for a in agents for s in SLOTS if (a, s) != (node, slot)]
    at = time.time()
    os.kill(victim, signal.SIGKILL)

    def firsts():
        found = []
        for a, s in survivors:
            new = [r for r in a.steps(s) if r["generation"] > generation]
            if not new:
                return None
            found.append((a, s, new[0]))
        return found

    stepped = wait_until(firsts, 300, "every survivor stepping in the new group", interval_s=0.05)
    formed = [r for a, s, first in stepped for r in a.rank_records(s, "group_formed")
              if r["generation"] == first["generation"]]
    reaped = wait_until(lambda: [r for r in node.records("rank_exited") if r["pid"] == victim], 60, "the reap")
    dying = [r for r in node.records("rank_dying") if r["pid"] == victim]
    decided = [r for r in leader.find("membership_changed") if record_time(r) >= at]
    out = {"reaped_s": record_time(reaped[0]) - at, "decided_s": min(map(record_time, decided)) - at,
           "began_s": max(record_time(r) - r["seconds"] for r in formed) - at,
           "formed_s": max(map(record_time, formed)) - at,
           **{f"phase.{name}": max(r.get(name, 0.0) for r in formed) for name in PHASES},
           "stepped_s": max(record_time(first) for _, _, first in stepped) - at}
    if dying:
        out["dying_s"] = record_time(dying[0]) - at
        out["heard_before_reap_s"] = out["reaped_s"] - out["dying_s"]
    return out


def run(workdir: Path, model: str, kills: int) -> dict:
    etcd = EtcdServer(workdir / "etcd").start()
    leader = CoordinatorProcess([etcd.endpoint], workdir / "coordinator.log", ["--heartbeat-timeout", "2.0"]).start()
    command = [sys.executable, str(AgentProcess.SCRIPT), "--model", model, "--digest-every", "0",
               "--steps", str(10**9), "--step-sleep", str(STEP_SLEEP_S)]
    agents = [AgentProcess([leader.address], JOB, n, workdir / "ranks", nodes="2:2", command=command).start()
              for n in NODES]
    try:
        cycles = [one_kill(leader, agents) for _ in range(kills)]
        times = [record_time(r) for r in agents[0].steps(0)[-SETTLED - 1:]]
        steady = [b - a for a, b in zip(times, times[1:])]
    finally:
        for a in agents:
            a.stop()
        leader.stop()
        etcd.stop()
    names = ("dying_s", "reaped_s", "decided_s", "began_s", "formed_s", "stepped_s", "heard_before_reap_s")
    return {"model": model, "kills": kills, "read_dying": sum("dying_s" in c for c in cycles),
            "steady_step_s": round(statistics.median(steady), 4) if steady else None,
            **{n: spread([c[n] for c in cycles if n in c]) for n in names if any(n in c for c in cycles)},
            "phases": {n: round(statistics.median(c[f"phase.{n}"] for c in cycles), 4) for n in PHASES}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny,50M", help="model sizes, comma-separated (train_ddp.py's)")
    p.add_argument("--kills", type=int, default=3)
    args = p.parse_args()
    logs.configure("warning")
    rows = []
    for model in args.model.split(","):
        with tempfile.TemporaryDirectory(prefix="muster-death-") as tmp:
            rows.append(run(Path(tmp), model, args.kills))
    print(json.dumps({"benchmark": "death_heard", "host": {"cpus": os.cpu_count(), "machine": platform.machine(),
                                                           "loadavg_at_end": os.getloadavg()},
                      "nodes": len(NODES), "slots": len(SLOTS), "runs": rows}, indent=2))
    return 0


if __name__ == "__main__":
    end_on_sigterm()
    sys.exit(main())
