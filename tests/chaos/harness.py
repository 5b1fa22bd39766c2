"""The chaos harness: a 3-member etcd cluster, coordinator replicas and node agents running
examples/train_ddp.py, one fault at a time (or two at once), and the invariants checked after
each recovery. Used by the chaos tests and by their soak mode.

Invariants (see `check`): survivors keep their PIDs; every rank process completes contiguous
steps (never backwards, none lost); all ranks hold identical state at every step of a
generation; the event history explains every generation and every fault; no process is left
behind (`stop`). Recovery times are recorded per fault and written to `report.json`.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from muster.coordinator.client import Coordinators
from muster.coordinator.etcd_backend import connect
from muster.coordinator.etcd_server import EtcdCluster
from muster.coordinator.leader import EVICTIONS
from muster.testing import AgentProcess, CoordinatorProcess, json_lines, process_alive, record_time, wait_until
from muster.v1 import muster_pb2 as pb

Slot = tuple[str, int]  # (node id, local rank)


@dataclass
class RankRun:
    """One process of one slot: its PID and the log of its steps."""

    node: str
    slot: int
    pid: int
    log: Path

    def steps(self) -> list[dict]:
        return json_lines(self.log, "step") if self.log.exists() else []


@dataclass
class Fault:
    name: str
    detail: str
    at: float  # wall clock, just before the fault
    generation_before: int
    victims: list[Slot]  # slots whose process is expected to change
    membership: bool  # whether a new generation is the expected answer
    expect: set[str]  # event kinds, any of which explains the fault
    pids_before: dict[Slot, int] = field(repr=False)
    detected_s: float | None = None  # fault -> the leader's decision (membership faults)
    recovered_s: float | None = None  # fault -> every survivor stepped in a new group / a new leader serves
    generation_after: int = 0
    notes: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        d = asdict(self)
        d.pop("pids_before")
        d["victims"] = [f"{n}/{s}" for n, s in self.victims]
        d["expect"] = sorted(self.expect)
        return d


class NetNamespace:
    """A node behind a veth pair in its own network namespace, so it can be cut off (both ends
    of the link down: packets are dropped, connections stay open, nothing is told)."""

    def __init__(self, name: str, subnet: int):
        self.name = name
        self.host_ip, self.node_ip = f"10.251.{subnet}.1", f"10.251.{subnet}.2"
        self.host_dev, self.node_dev = f"{name}-h", f"{name}-n"

    @staticmethod
    def unavailable() -> str | None:
        """Why namespaces cannot be made here, or None."""
        if os.geteuid() != 0:
            return "network namespaces need root"
        probe = NetNamespace("mprobe", 250)
        try:
            probe.create()
        except (OSError, subprocess.CalledProcessError) as exc:
            return f"cannot create a network namespace: {exc}"
        finally:
            probe.delete()
        return None

    def _ip(self, *args: str, inside: bool = False) -> None:
        prefix = ["ip", "netns", "exec", self.name] if inside else []
        subprocess.run([*prefix, "ip", *args], check=True, capture_output=True, timeout=10)

    def create(self) -> NetNamespace:
        self.delete()  # what a killed run of ours may have left
        self._ip("netns", "add", self.name)
        self._ip("link", "add", self.host_dev, "type", "veth", "peer", "name", self.node_dev)
        self._ip("link", "set", self.node_dev, "netns", self.name)
        self._ip("addr", "add", f"{self.host_ip}/30", "dev", self.host_dev)
        self._ip("addr", "add", f"{self.node_ip}/30", "dev", self.node_dev, inside=True)
        self._ip("link", "set", "lo", "up", inside=True)
        self.heal()
        return self

    def partition(self) -> None:
        self._ip("link", "set", self.host_dev, "down")
        self._ip("link", "set", self.node_dev, "down", inside=True)

    def heal(self) -> None:
        self._ip("link", "set", self.host_dev, "up")
        self._ip("link", "set", self.node_dev, "up", inside=True)

    def wrap(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    def delete(self) -> None:
        subprocess.run(["ip", "link", "del", self.host_dev], capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=10)


class Chaos:
    """The cluster under test. `start`, then faults (each returns its `Fault`), `recover`, the
    matching repair (`restart_*`), `full_strength`, `check`; `stop` at the end."""

    def __init__(self, workdir: Path, *, nodes: int = 3, slots: int = 2, replicas: int = 2, etcd_members: int = 3,
                 job: str = "chaos", step_sleep_s: float = 0.1, heartbeat_timeout_s: float = 2.0,
                 host: str = "127.0.0.1", netns: dict[str, NetNamespace] | None = None):
        self.workdir = workdir
        self.nodes = [f"node{i}" for i in range(nodes)]
        self.slots = slots
        self.job = job
        self.step_sleep_s = step_sleep_s
        self.host = host  # what the coordinators and the nodes outside a namespace listen on
        self.netns = netns or {}
        self.coordinator_flags = ["--heartbeat-timeout", str(heartbeat_timeout_s), "--session-ttl", "3"]
        self.etcd = EtcdCluster(workdir / "etcd", etcd_members)
        self.replicas: list[CoordinatorProcess] = []
        self.agents: dict[str, AgentProcess] = {}
        self.incarnations: dict[str, list[AgentProcess]] = defaultdict(list)
        self.faults: list[Fault] = []
        self.pids: set[int] = set()  # every process started, for the orphan check
        self.started_at = 0.0
        self._n_replicas = replicas

    # ---- lifecycle -------------------------------------------------------------------

    def start(self, timeout_s: float = 120.0) -> Chaos:
        self.started_at = time.time()
        self.etcd.start()
        self.pids.update(m.pid for m in self.etcd.members)
        for _ in range(self._n_replicas):
            self.restart_coordinator()
        for node in self.nodes:
            self.restart_agent(node)
        self.full_strength(timeout_s)
        return self

    def stop(self) -> list[int]:
        """Stop everything; the PIDs of processes (ranks included) still running afterwards."""
        for agents in self.incarnations.values():
            for a in agents:
                a.stop()
        for r in self.replicas:
            r.stop()
        self.etcd.stop()
        self.pids.update(run.pid for run in self.runs())
        time.sleep(0.5)  # ranks die with their agent (PR_SET_PDEATHSIG): give them a moment
        return sorted(pid for pid in self.pids if process_alive(pid))

    def restart_coordinator(self) -> CoordinatorProcess:
        """A new replica; in place of a dead one (same address, as a StatefulSet pod comes back), if any."""
        live = set(self.addresses)
        dead = next((r.address for r in self.replicas if r.proc.poll() is not None and r.address not in live), None)
        replica = CoordinatorProcess(self.etcd.endpoints, self.workdir / f"coordinator-{len(self.replicas)}.log",
                                     self.coordinator_flags, listen=dead or f"{self.host}:0").start()
        self.replicas.append(replica)  # every replica ever started: their logs hold the decisions
        self.pids.add(replica.pid)
        return replica

    def restart_agent(self, node: str) -> AgentProcess:
        """A node (again): a fresh agent with the same node id, its ranks logging to a new folder."""
        ns = self.netns.get(node)
        incarnation = len(self.incarnations[node])
        agent = AgentProcess(self.addresses, self.job, node, self.workdir / "ranks" / f"{node}.{incarnation}",
                             slots=self.slots, nodes=f"1:{len(self.nodes)}", steps=10**9,
                             step_sleep_s=self.step_sleep_s, host=ns.node_ip if ns else self.host,
                             extra=["--max-restarts", "1000"], wrap=ns.wrap() if ns else None).start()
        self.agents[node] = agent
        self.incarnations[node].append(agent)
        self.pids.add(agent.pid)
        return agent

    def restart_etcd(self) -> None:
        for member in self.etcd.members:
            if not member.running():
                member.start()
                self.pids.add(member.pid)

    # ---- views -----------------------------------------------------------------------

    @property
    def addresses(self) -> list[str]:
        return [r.address for r in self.replicas if r.proc.poll() is None]

    def runs(self) -> list[RankRun]:
        """Every rank process ever started, oldest first per slot."""
        out = []
        for agents in self.incarnations.values():
            for a in agents:
                for r in a.records("rank_started"):
                    out.append(RankRun(a.node_id, r["slot"], r["pid"], a.log_dir / f"{a.node_id}-slot{r['slot']}-{r['start']}.log"))
        return out

    def current(self) -> dict[Slot, RankRun]:
        """The newest live process of every slot of every running agent."""
        out = {}
        for node, agent in self.agents.items():
            if agent.proc.poll() is not None:
                continue
            for run in self.runs():
                if run.node == node and run.log.parent == agent.log_dir and process_alive(run.pid):
                    out[(run.node, run.slot)] = run
        return out

    def last_steps(self) -> dict[Slot, dict]:
        out = {}
        for key, run in self.current().items():
            steps = run.steps()
            if steps:
                out[key] = steps[-1]
        return out

    def generation(self) -> int:
        return max((r["generation"] for r in self.last_steps().values()), default=0)

    def leader(self, timeout_s: float = 15.0) -> CoordinatorProcess:
        """The replica leading the job (after an etcd fault a new election may still be running)."""
        return wait_until(lambda: next((r for r in self.replicas if r.leads(self.job)), None), timeout_s,
                          "a coordinator leading the job", interval_s=0.1)

    def events(self) -> list[pb.Event]:
        with Coordinators(self.addresses, timeout_s=5) as c:
            return list(c.call("Events", pb.EventsRequest(job=self.job)).events)

    def full_strength(self, timeout_s: float = 90.0) -> None:
        """Wait until every slot of every live node trains in one group of full size."""
        def ready():
            live = [n for n, a in self.agents.items() if a.proc.poll() is None]
            last = self.last_steps()
            want = len(live) * self.slots
            return (len(last) == want and len({r["generation"] for r in last.values()}) == 1
                    and all(r["world_size"] == want for r in last.values()))
        wait_until(ready, timeout_s, "the job back at full strength", interval_s=0.1)
        steps = {k: r["step"] for k, r in self.last_steps().items()}
        wait_until(lambda: all(self.last_steps().get(k, {}).get("step", 0) >= s + 3 for k, s in steps.items()),
                   timeout_s, "every rank stepping at full strength", interval_s=0.1)

    # ---- faults ----------------------------------------------------------------------

    def _inject(self, name: str, detail: str, victims: list[Slot], *, membership: bool, expect: set[str],
                action: Callable[[], None]) -> Fault:
        current = self.current()
        fault = Fault(name, detail, time.time(), self.generation(), victims, membership, expect,
                      {k: r.pid for k, r in current.items()})
        action()
        self.faults.append(fault)
        return fault

    def rank_slot(self, rank: int | None = None) -> Slot:
        """The slot holding `rank`; None: a random rank other than 0."""
        by_rank = {r["rank"]: k for k, r in self.last_steps().items()}
        return by_rank[rank] if rank is not None else by_rank[random.choice([r for r in by_rank if r != 0])]

    def kill_rank(self, rank: int | None = None) -> Fault:
        slot = self.rank_slot(rank)
        pid = self.current()[slot].pid
        return self._inject(f"SIGKILL rank {'0' if rank == 0 else ''}".strip(), f"rank pid {pid} at {slot[0]}/{slot[1]}",
                            [slot], membership=True, expect={"rank_exited"},
                            action=lambda: os.kill(pid, signal.SIGKILL))

    def hang_rank(self) -> Fault:
        """SIGSTOP a rank; `resume` it later: it must find itself fenced out and stop."""
        slot = self.rank_slot()
        pid = self.current()[slot].pid
        return self._inject("SIGSTOP rank", f"rank pid {pid} at {slot[0]}/{slot[1]}", [slot], membership=True,
                            expect={"rank_silent", "rank_stalled"}, action=lambda: os.kill(pid, signal.SIGSTOP))

    def resume(self, fault: Fault) -> None:
        os.kill(fault.pids_before[fault.victims[0]], signal.SIGCONT)

    def kill_agent(self, node: str | None = None) -> Fault:
        node = node or random.choice([n for n in self.agents if n != self.rank_slot(0)[0]])
        agent = self.agents[node]
        return self._inject("SIGKILL agent", f"agent pid {agent.pid} of {node} (and so its ranks)",
                            [(node, s) for s in range(self.slots)], membership=True, expect={"node_silent"},
                            action=lambda: agent.signal(signal.SIGKILL))

    def partition(self, node: str) -> Fault:
        ns = self.netns[node]
        return self._inject("partition node", f"{node} cut off ({ns.name} link down)",
                            [(node, s) for s in range(self.slots)], membership=True, expect={"node_silent"},
                            action=ns.partition)

    def kill_leader(self) -> Fault:
        leader = self.leader()
        return self._inject("SIGKILL coordinator leader", f"coordinator {leader.address} pid {leader.pid}", [],
                            membership=False, expect=set(), action=leader.kill)

    def kill_etcd(self, *, leader: bool) -> Fault:
        index = self._etcd_leader()
        if not leader:
            index = next(i for i in range(len(self.etcd.members)) if i != index)
        member = self.etcd.members[index]
        return self._inject(f"SIGKILL etcd {'leader' if leader else 'member'}", f"etcd {member.name} pid {member.pid}",
                            [], membership=False, expect=set(), action=lambda: self.etcd.kill_member(index))

    def _etcd_leader(self) -> int:
        client = connect([m.endpoint for m in self.etcd.members if m.running()])
        try:
            leader = client.status().leader
        finally:
            client.close()
        return next(i for i, m in enumerate(self.etcd.members) if m.client_url in leader.client_urls)

    def kill_rank_and_leader(self) -> Fault:
        slot = self.rank_slot()
        pid = self.current()[slot].pid
        leader = self.leader()

        def both():
            os.kill(pid, signal.SIGKILL)
            leader.kill()
        return self._inject("SIGKILL rank + coordinator leader", f"rank pid {pid} at {slot[0]}/{slot[1]} and "
                            f"coordinator {leader.address}", [slot], membership=True, expect={"rank_exited"},
                            action=both)

    def kill_during_reform(self) -> Fault:
        """Kill a rank; the moment the leader publishes the new generation, kill another."""
        first = self.kill_rank()
        leader = self.leader()
        wait_until(lambda: [r for r in leader.find("membership_changed", kind="generation")
                            if record_time(r) >= first.at], 15, "the first fault's new generation", interval_s=0.005)
        survivors = [k for k in self.current() if k not in first.victims and k != self.rank_slot(0)]
        second = random.choice(survivors)
        pid = self.current()[second].pid
        stepped = any(r["generation"] > first.generation_before for r in self.last_steps().values())
        os.kill(pid, signal.SIGKILL)
        first.name = "SIGKILL during a reform"
        first.victims.append(second)
        first.detail += f"; then rank pid {pid} at {second[0]}/{second[1]} as the new generation was published"
        first.notes.append("second kill before any survivor stepped in the new group" if not stepped
                           else "second kill after a survivor had already stepped in the new group")
        return first

    def heal(self, fault: Fault) -> None:
        """End a partition: the cut-off node must not have trained on alone; back on the network it
        finds itself evicted and its agent exits, its ranks with it; a fresh agent rejoins."""
        node = fault.victims[0][0]
        cut_off = self.agents[node]
        others = [r["step"] for k, r in self.last_steps().items() if k[0] != node]
        stranded = max((r["step"] for run in self.runs() if run.node == node for r in run.steps()), default=0)
        assert stranded <= min(others), f"{node} trained on alone while cut off (step {stranded})"
        self.netns[node].heal()
        assert cut_off.wait(60) != 0, f"{node} was taken back silently instead of being evicted"
        fault.notes.append(f"{node}'s agent exited with {cut_off.proc.returncode} once the network healed")
        self.restart_agent(node)

    def scenario(self, name: str) -> Fault:
        """One named fault: inject it, time the answer, repair what it broke, wait for full strength,
        check the invariants."""
        inject, repair = {
            "rank": (self.kill_rank, None),
            "rank0": (lambda: self.kill_rank(0), None),
            "hang": (self.hang_rank, self.resume),
            "agent": (self.kill_agent, lambda f: self.restart_agent(f.victims[0][0])),
            "leader": (self.kill_leader, lambda f: self.restart_coordinator()),
            "etcd_member": (lambda: self.kill_etcd(leader=False), lambda f: self.restart_etcd()),
            "etcd_leader": (lambda: self.kill_etcd(leader=True), lambda f: self.restart_etcd()),
            "rank_and_leader": (self.kill_rank_and_leader, lambda f: self.restart_coordinator()),
            "during_reform": (self.kill_during_reform, None),
            "partition": (lambda: self.partition(next(iter(self.netns))), self.heal),
        }[name]
        fault = self.recover(inject())
        if repair is not None:
            repair(fault)
        self.full_strength()
        self.check(fault)
        return fault

    # ---- recovery and invariants -----------------------------------------------------

    def recover(self, fault: Fault, timeout_s: float = 60.0) -> Fault:
        """Wait for the answer to `fault` and time it."""
        if fault.membership:
            def stepped_in_new_group():
                firsts = []
                for key, run in self.current().items():
                    if key in fault.victims or fault.pids_before.get(key) != run.pid:
                        continue
                    new = [r for r in run.steps() if r["generation"] > fault.generation_before
                           and record_time(r) >= fault.at]
                    if not new:
                        return None
                    firsts.append(record_time(new[0]))
                return firsts or None
            firsts = wait_until(stepped_in_new_group, timeout_s, f"survivors stepping after {fault.name}",
                                interval_s=0.05)
            fault.recovered_s = round(max(firsts) - fault.at, 3)
            decisions = [record_time(r) for rep in self.replicas for r in rep.find("membership_changed")
                         if r["kind"] in fault.expect and record_time(r) >= fault.at]
            fault.detected_s = round(min(decisions) - fault.at, 3) if decisions else None
        else:
            survivors = [r for r in self.replicas if r.proc.poll() is None]
            wait_until(lambda: any(r.leads(self.job) for r in survivors), timeout_s, "a serving leader")
            fault.recovered_s = round(time.time() - fault.at, 3)
            steps = {k: r["step"] for k, r in self.last_steps().items()}
            wait_until(lambda: all(self.last_steps().get(k, {}).get("step", 0) >= s + 5 for k, s in steps.items()),
                       timeout_s, "every rank stepping on", interval_s=0.1)
        fault.generation_after = self.generation()
        return fault

    def check(self, fault: Fault) -> None:
        """The invariants, over everything logged so far; raises AssertionError naming the broken one."""
        current = self.current()
        for key, pid in fault.pids_before.items():
            if key not in fault.victims:
                assert key in current and current[key].pid == pid, \
                    f"{fault.name}: survivor {key} lost its process (pid {pid})"
        by_step: dict[tuple[int, int], set[str]] = defaultdict(set)
        for run in self.runs():
            _check_progress(fault.name, run)
            for r in run.steps():
                by_step[(r["generation"], r["step"])].add(r["digest"])
        split = {k: v for k, v in by_step.items() if len(v) > 1}
        assert not split, f"{fault.name}: ranks differ at (generation, step) {sorted(split)[:5]}"
        events = self.events()
        explained = {e.generation for e in events}
        seen = {g for (g, _) in by_step if g > min(explained, default=0)}
        assert seen <= explained, f"{fault.name}: generations {sorted(seen - explained)} have no event"
        after = [e for e in events if e.time_unix_ms >= fault.at * 1000 - 5]
        if fault.membership:
            assert fault.generation_after > fault.generation_before, f"{fault.name}: no new generation"
            assert any(e.kind in fault.expect for e in after), \
                f"{fault.name}: no {sorted(fault.expect)} event; got {[(e.kind, e.reason) for e in after]}"
        else:
            evictions = [(e.kind, e.reason) for e in after if e.kind in EVICTIONS]
            assert not evictions, f"{fault.name}: nobody may be evicted, got {evictions}"
            assert fault.generation_after == fault.generation_before, \
                f"{fault.name}: generation {fault.generation_before} -> {fault.generation_after}"

    def report(self) -> dict:
        runs = self.runs()
        top = max((r["step"] for run in runs for r in run.steps()[-1:]), default=0)
        out = {"job": self.job, "nodes": len(self.nodes), "slots": self.slots,
               "seconds": round(time.time() - self.started_at, 1), "highest_step": top,
               "rank_processes": len(runs), "faults": [f.summary() for f in self.faults]}
        (self.workdir / "report.json").write_text(json.dumps(out, indent=2))
        return out


def _check_progress(fault: str, run: RankRun) -> None:
    """A rank's completed steps follow each other, except that a reform may bring it forward to
    the step another rank completed (state sync from the highest); never backwards. A planned
    switch forms the new group inside the step's end, so its record follows the group's."""
    done, switched = None, False  # the step this process's state is at
    for r in json_lines(run.log) if run.log.exists() else []:
        if r.get("event") == "group_formed":
            assert done is None or r["step"] >= done, \
                f"{fault}: {run.node}/{run.slot} pid {run.pid} went back from step {done} to {r['step']}"
            done, switched = r["step"], True
        elif r.get("event") == "step":
            assert done is None or r["step"] == done + 1 or (switched and r["step"] == done), \
                f"{fault}: {run.node}/{run.slot} pid {run.pid} completed step {r['step']} after step {done}"
            done, switched = r["step"], False
