"""A library rank's replacement under `muster run` (issue 25 item 5): N agents x S slots of
src/muster/examples/train_ddp.py (the worker library) against a real etcd and coordinator, with the
agent's defaults (warm starts on). One rank is SIGKILLed at a time; its agent starts a replacement
in the slot, which joins the running job at a planned switch. Prints one JSON object:

  kill_to_step_s      kill -> every survivor has completed a step in the new group
  restart_s           kill -> the agent started the replacement (its rank_started record: the
                      exit noticed, the restart backoff waited)
  replacement_s       the replacement started -> its first step in the group (the target: <= 0.5 s;
                      it waits for the planned switch, --switch-lead ahead)
  replacement_phases  where that went, from the replacement's own records, each since its start:
                      assigned_s (its first assignment: process up, library connected to the agent,
                      the leader's map), formed_s (its group formed: the planned switch waited for,
                      the state received), first_step_s
  warm                replacements forked from the node's zygote / all replacements
  steps_lost, survivors_lost  as bench/recovery.py

    python bench/replacement.py [--nodes 2 --slots 2 --kills 5]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from recovery import p50_max, settled, summary

from muster import logs
from muster.coordinator.core.policy import Timing
from muster.coordinator.etcd.server import EtcdServer
from muster.local import AgentProcess, CoordinatorProcess, end_on_sigterm, json_lines, record_time, wait_until

JOB = "replacement"
HEARTBEAT_TIMEOUT_S = 2.0


class Ranks:
    """etcd, one coordinator and N agents of one job; a rank is (agent, slot)."""

    def __init__(self, workdir: Path, nodes: int, slots: int, step_sleep_s: float, switch_lead_s: float):
        self.nodes, self.slots = nodes, slots
        self.etcd = EtcdServer(workdir / "etcd").start()
        self.coordinator = CoordinatorProcess([self.etcd.endpoint], workdir / "coordinator.log",
                                              ["--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S),
                                               "--switch-lead", str(switch_lead_s)]).start()
        # The agents' defaults (warm starts, restart backoff), not AgentProcess's test settings.
        self.agents = [AgentProcess([self.coordinator.address], JOB, f"node{i}", workdir / "ranks", slots=slots,
                                    nodes=f"{nodes}:{nodes}", steps=10**9, step_sleep_s=step_sleep_s,
                                    extra=["--restart-backoff", "1.0"]).start()
                       for i in range(nodes)]
        self.world = nodes * slots

    def ranks(self) -> list[tuple[AgentProcess, int]]:
        return [(a, s) for a in self.agents for s in range(self.slots)]

    def settled(self, timeout_s: float = 180.0) -> None:
        wait_until(lambda: all(settled(a.steps(s), self.world) for a, s in self.ranks()), timeout_s,
                   f"{self.world} ranks stepping together", interval_s=0.1)

    def stop(self) -> None:
        for a in self.agents:
            a.stop()
        self.coordinator.stop()
        self.etcd.stop()


def replacement_phases(log: Path, started: float) -> dict[str, float]:
    assigned = json_lines(log, "assignment_received")
    formed = json_lines(log, "group_formed")
    first = json_lines(log, "step")
    return {"assigned_s": record_time(assigned[0]) - started if assigned else None,
            "formed_s": record_time(formed[0]) - started if formed else None,
            "first_step_s": record_time(first[0]) - started}


def kill_cycles(ranks: Ranks, kills: int) -> dict:
    recoveries, restarts, replacements, lost, warm = [], [], [], [], 0
    phases: dict[str, list[float]] = {}
    survivors_lost = 0
    for _ in range(kills):
        agent, slot = random.choice(ranks.ranks())
        survivors = [(a, s) for a, s in ranks.ranks() if (a, s) != (agent, slot)]
        last = [a.steps(s)[-1] for a, s in ranks.ranks()]  # each rank's log read once
        generation, completed_before = max(r["generation"] for r in last), max(r["step"] for r in last)
        pid = agent.rank_pids(slot)[-1]
        starts = len(agent.rank_logs(slot))
        at = time.time()
        os.kill(pid, signal.SIGKILL)

        def survivors_stepping():
            firsts = [next((r for r in a.steps(s) if r["generation"] > generation), None) for a, s in survivors]
            return None if None in firsts else firsts

        firsts = wait_until(survivors_stepping, 60, "survivors stepping in the new group")
        recoveries.append(max(record_time(r) for r in firsts) - at)
        lost.append(max(0, completed_before - min(r["step"] for r in firsts) + 1))
        started = wait_until(lambda: next((r for r in agent.records("rank_started")
                                           if r["slot"] == slot and r["pid"] != pid and record_time(r) >= at), None),
                             30, f"{agent.node_id}'s replacement in slot {slot}")
        restarts.append(record_time(started) - at)
        warm += bool(started.get("warm"))
        wait_until(lambda: len(agent.rank_logs(slot)) > starts and agent.steps(slot), 60,
                   f"the replacement in {agent.node_id} slot {slot} stepping")
        log = agent.rank_logs(slot)[-1]
        for name, value in replacement_phases(log, record_time(started)).items():
            if value is not None:
                phases.setdefault(name, []).append(value)
        replacements.append(phases["first_step_s"][-1])
        survivors_lost += sum(1 for a, s in survivors  # restarted rather than kept
                              if any(r["slot"] == s and record_time(r) >= at for r in a.records("rank_started")))
        ranks.settled()
    return {"kill_to_step_s": summary(recoveries), "restart_s": summary(restarts),
            "replacement_s": summary(replacements),
            "replacement_phases": p50_max(phases),
            "warm": f"{warm}/{kills}", "steps_lost": {"max": max(lost), "total": sum(lost)},
            "survivors_lost": survivors_lost}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--switch-lead", type=float, default=Timing.switch_lead_s,
                   help="the coordinator's --switch-lead (default: its own, %(default)s)")
    p.add_argument("--workdir", type=Path, help="keep the logs here (default: a temporary directory)")
    args = p.parse_args()
    logs.configure("warning")
    with tempfile.TemporaryDirectory(prefix="muster-bench-") as d:
        ranks = Ranks(args.workdir or Path(d), args.nodes, args.slots, args.step_sleep, args.switch_lead)
        try:
            ranks.settled()
            result = {"benchmark": "replacement", "nodes": args.nodes, "slots": args.slots,
                      "step_sleep_s": args.step_sleep, "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S,
                      "switch_lead_s": args.switch_lead,
                      **kill_cycles(ranks, args.kills)}
        finally:
            ranks.stop()
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    end_on_sigterm()
    sys.exit(main())
