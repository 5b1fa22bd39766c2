"""`muster demo`: the whole system on this machine. An embedded etcd, two coordinator replicas and
N node agents, each training src/muster/examples/train_ddp.py (shipped in the package) on K slots
(gloo on CPU). A live table shows ranks, steps, generation and leader; on a schedule a rank is
SIGKILLed (the next fault waits for its replacement to rejoin), then a whole node (its agent), then
the coordinator leader. At the end it prints the recovery times, writes a PNG timeline (steps per
rank over time, faults and generations marked) and exits 0 only if every fault was recovered from.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from muster.client import Coordinators
from muster.coordinator.etcd.server import EtcdServer
from muster.local import AgentProcess, CoordinatorProcess, json_lines, record_time, wait_until
from muster.v1 import muster_pb2 as pb

JOB = "demo"


@dataclass
class Fault:
    name: str
    at: float  # wall clock
    recovered_s: float | None = None
    detail: str = ""


def _rank_runs(agents: list[AgentProcess]) -> dict[str, list[dict]]:
    """Every rank process's steps, by '<node>/slot<K>#<start>'."""
    runs = {}
    for a in agents:
        for log in sorted(a.log_dir.glob(f"{a.job}/*/{a.node_id}-slot*-*.log")):
            steps = json_lines(log, "step")
            if steps:
                runs[log.stem] = steps
    return runs


def _table(coordinators: list[str]) -> str:
    try:
        with Coordinators(coordinators, timeout_s=1) as c:
            job = c.call("Status", pb.StatusRequest(job=JOB)).jobs[0]
            if not job.live and job.leader:
                job = c.stub(job.leader).Status(pb.StatusRequest(job=JOB), timeout=1).jobs[0]
    except Exception as exc:  # the leader may be between lives: that is part of the show
        return f"  (status unavailable: {exc.__class__.__name__})"
    head = (f"leader {job.leader}  term {job.term}  generation {job.generation}  world_size {job.world_size}"
            f"  spares {list(job.spares) or '-'}")
    ranks = "  ".join(f"r{r.rank}:{r.node}/{r.local_rank} step {r.step}" for r in sorted(job.ranks, key=lambda r: r.rank))
    return f"{head}\n  {ranks}"


def _recovered_after(agents, fault: Fault, generation_before: int) -> float | None:
    """Seconds from the fault until every rank still alive stepped in a newer generation."""
    firsts = []
    live = [a for a in agents if a.proc.poll() is None]  # a killed node's ranks may step once more as they die
    for steps in _rank_runs(live).values():
        if record_time(steps[-1]) < fault.at:
            continue  # a run that ended before the fault
        newer = [r for r in steps if r["generation"] > generation_before and record_time(r) >= fault.at]
        if not newer:
            return None
        firsts.append(record_time(newer[0]))
    return max(firsts) - fault.at if firsts else None


def _rejoined(agent: AgentProcess, slot: int, world_size: int, since: float) -> float | None:
    """When the slot's newest process first stepped in a whole job (None: not yet)."""
    logs = agent.rank_logs(slot)
    steps = json_lines(logs[-1], "step") if logs else []
    return next((record_time(r) for r in steps if r["world_size"] == world_size and record_time(r) >= since), None)


def _timeline(agents, faults: list[Fault], started: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 5))
    generations = {}
    for name, steps in sorted(_rank_runs(agents).items()):
        ax.plot([record_time(r) - started for r in steps], [r["step"] for r in steps], lw=1.2, label=name)
        for r in steps:
            generations.setdefault(r["generation"], record_time(r) - started)
    for g, t in sorted(generations.items()):
        ax.axvline(t, color="grey", ls=":", lw=0.8)
        ax.text(t, ax.get_ylim()[1] * 0.02, f"g{g}", color="grey", fontsize=8)
    for f in faults:
        ax.axvline(f.at - started, color="red", lw=1.5)
        ax.text(f.at - started, ax.get_ylim()[1] * 0.95, f" {f.name}", color="red", fontsize=9, va="top")
    ax.set_xlabel("seconds")
    ax.set_ylabel("completed step")
    ax.set_title("Muster demo: steps per rank; red = faults, dotted = generations")
    ax.legend(fontsize=7, ncol=2, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _generation(agents) -> int:
    return max((steps[-1]["generation"] for steps in _rank_runs(agents).values()), default=0)


def _report(coordinators: list[str], faults: list[Fault], out: Path) -> None:
    """The job's membership history, as the coordinators recorded it, and what each fault cost."""
    with Coordinators(coordinators) as c:
        events = c.call("Events", pb.EventsRequest(job=JOB)).events
    print("\nmembership history:")
    for e in events:
        print(f"  g{e.generation:<3} term {e.term:<5} {e.kind:<16} {','.join(e.nodes):<14} {e.reason}")
    print("\nrecovery:")
    for f in faults:
        took = f"{f.recovered_s:.2f}s" if f.recovered_s is not None else "NOT RECOVERED"
        print(f"  {f.name:<16} {took:>14}   {f.detail}")
    print(f"\ntimeline written to {out}")
    print(json.dumps({f.name: f.recovered_s for f in faults}))


def run(duration_s: float = 60.0, nodes: int = 3, slots: int = 2, out: Path = Path("muster-demo.png")) -> int:
    with tempfile.TemporaryDirectory(prefix="muster-demo-") as d:
        work = Path(d)
        etcd = EtcdServer(work / "etcd").start()
        replicas: list[CoordinatorProcess] = []
        agents: list[AgentProcess] = []
        faults: list[Fault] = []
        try:
            replicas = [CoordinatorProcess([etcd.endpoint], work / f"coordinator-{i}.log",
                                           ["--heartbeat-timeout", "2.0"]).start() for i in range(2)]
            addresses = [r.address for r in replicas]
            print(f"etcd {etcd.endpoint} (pid {etcd.pid}); coordinators {addresses}", flush=True)
            agents = [AgentProcess(addresses, JOB, f"node{i}", work / "ranks", slots=slots, nodes=f"1:{nodes}",
                                   steps=10**9, step_sleep_s=0.05).start() for i in range(nodes)]
            wait_until(lambda: len(_rank_runs(agents)) == nodes * slots
                       and all(s[-1]["world_size"] == nodes * slots for s in _rank_runs(agents).values()),
                       90, "every rank training")
            started = time.time()
            print(f"{nodes} nodes x {slots} ranks training; faults follow\n", flush=True)
            schedule = [(0.15, "kill a rank"), (0.4, "kill a node"), (0.65, "kill the leader")]
            t0 = time.time()
            for share, name in schedule:
                while time.time() < t0 + share * duration_s:
                    print(_table(addresses), flush=True)
                    time.sleep(1.0)
                generation = _generation(agents)
                if name == "kill a rank":
                    pid = agents[0].rank_pids(slots - 1)[-1]
                    os.kill(pid, signal.SIGKILL)
                    # Stamped once it is sent: a step the rank logged just before (a loaded machine can
                    # stall this process between the two) is not taken for its life after the fault.
                    faults.append(Fault(name, time.time(), detail=f"SIGKILL rank pid {pid} on node0"))
                elif name == "kill a node":
                    victim = agents[-1]
                    faults.append(Fault(name, time.time(), detail=f"SIGKILL the agent of {victim.node_id}"))
                    victim.signal(signal.SIGKILL)
                else:
                    leader = next(r for r in replicas if r.find("leadership_acquired", job=JOB) and r.leads(JOB))
                    faults.append(Fault(name, time.time(), detail=f"SIGKILL coordinator {leader.address}"))
                    leader.kill()
                print(f"\n>>> {faults[-1].name}: {faults[-1].detail}\n", flush=True)
                fault = faults[-1]
                if name == "kill the leader":
                    standby = next(r for r in replicas if r is not leader)
                    wait_until(lambda: standby.leads(JOB), 15, "a new leader")
                    fault.recovered_s = time.time() - fault.at
                    fault.detail += f"; steps went on in generation {generation}"
                else:
                    try:
                        wait_until(lambda: _recovered_after(agents, fault, generation), 30, name)
                        fault.recovered_s = _recovered_after(agents, fault, generation)
                    except AssertionError:
                        pass
                    if name == "kill a rank":
                        # The next fault hits a whole job: the killed rank's replacement has rejoined.
                        try:
                            back = wait_until(lambda: _rejoined(agents[0], slots - 1, nodes * slots, fault.at), 60,
                                              "the replacement rank")
                            fault.detail += f"; its replacement rejoined after {back - fault.at:.1f}s"
                        except AssertionError:
                            fault.detail += "; its replacement did not rejoin within 60s"
            while time.time() < t0 + duration_s:
                print(_table([r.address for r in replicas if r.proc.poll() is None]), flush=True)
                time.sleep(1.0)
            _timeline(agents, faults, started, out)
            _report([r.address for r in replicas if r.proc.poll() is None], faults, out)
            return 0 if all(f.recovered_s is not None for f in faults) else 1
        finally:
            for a in agents:
                a.stop()
            for r in replicas:
                r.stop()
            etcd.stop()

