"""The chaos harness: a 3-member etcd cluster, coordinator replicas and node agents running
examples/train_ddp.py, one fault at a time (or two at once), and the invariants checked after
each recovery. Used by the chaos tests and by their soak mode.

Invariants (see `check`): survivors keep their PIDs; every rank process completes contiguous
steps (never backwards, none lost); all ranks hold identical state at every step of a
generation; the event history explains every generation and every fault; no process is left
behind (`stop`). Liveness (see `liveness`): once a fault heals, every surviving slot steps again
within LIVENESS_BOUND_S. Recovery times are recorded per fault and written to `report.json`.

Compound faults (the soak and tests/chaos/test_compound.py) add whole-deployment outages: every
etcd member killed or frozen, every coordinator killed, etcd's data lost, a rank killed during an
outage, the leader frozen as it publishes a reform, and a hostile client on the gRPC port.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import random
import re
import signal
import subprocess
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path

import faults
import hostile
from muster.client import Coordinators
from muster.coordinator.core.kinds import EVICTIONS
from muster.coordinator.etcd.client import connect
from muster.coordinator.etcd.server import EtcdCluster
from muster.local import (AgentProcess, CoordinatorProcess, Throttle, carries_tag, json_lines, process_alive,
                          progress_gap, record_time, wait_until)
from muster.v1 import muster_pb2 as pb

Slot = tuple[str, int]  # (node id, local rank)

CHAOS_RUN_ENV = "MUSTER_CHAOS_RUN"  # marks the processes of one chaos run (see Chaos.tag)
# The coordinators' timing in the harness (flags below; a Chaos may set another grace).
HEARTBEAT_TIMEOUT_S = 2.0
SESSION_TTL_S = 3
GRACE_S = 2.0
# A fault heals (etcd back, coordinators serving again, the fault itself for instant ones) -> every
# surviving slot has completed a step again (in a new generation when one is the answer). The
# slowest legitimate path is a rank killed during an etcd outage: the replicas' session and campaign
# retries back off up to 2 s with jitter x2 (4 s); a campaign key of the old session outlives the
# outage by its lease TTL (3 s); the new leader's grace (at most 2 s: a heartbeat timeout after the
# first frame, less once every node attached) — exit reports act at once, but a death it only learns
# from frames may wait for it —; a silent rank is found after the heartbeat timeout (2 s); the
# survivors then re-form on two loaded cores (about 1 s). 4 + 3 + 2 + 2 + 1 = 12, plus a 3 s margin.
LIVENESS_BOUND_S = 15.0
# After a whole-deployment outage (etcd or every coordinator down), however long it lasted: the heal
# -> every surviving slot stepping again. Reconnection is prompt (capped gRPC backoff, session retries
# under 1 s, the old session's lease revoked once etcd answers), so this holds for 10 s and 2 minutes alike.
HEAL_BOUND_S = 5.0
ETCD_OUTAGE_S = 10.0  # every etcd member down (killed or frozen), then back with its data
COORDINATORS_DOWN_S = 20.0  # every coordinator killed, then restarted at its address
# A rank killed during an outage dies this far into it: past the leader's renew deadline (2/3 of the
# TTL), so no leader is left to hear of it.
KILL_INTO_OUTAGE_S = 4.0
STEP_DOWN_BOUND_S = 5.0  # a resumed, frozen leader logs that it lost the job within this
# A throttled rank (stopped 60% of every 50 ms: ~2.4x its compute) -> its node named a straggler:
# --straggler-min-steps (20) of the job's slowed steps (~4 a second), after the rank's window median
# (32 steps) crossed the factor (~16 steps), with a margin for a loaded box.
STRAGGLER_BOUND_S = 30.0
HOSTILE_SETTLE_S = HEARTBEAT_TIMEOUT_S + 1.0  # after the hostile client: the ranks step on this long (an eviction shows)
AFTERMATH_S = HEARTBEAT_TIMEOUT_S + 3.0  # after the last fault of a sequence: time for a late consequence to show
# What explains a rank killed during an outage: its agent's exit report reaching the new leader, or,
# when that report was lost with the refused streams of the outage, the survivors found holding in a
# broken group (after the heartbeat timeout).
OUTAGE_KILL_EXPECT = frozenset({"rank_exited", "group_broken"})
# A whole node lost during an outage: judged silent by the new leader a heartbeat timeout after the
# survivors' first frame reached it (their attaching ends its grace; the lost node's never comes).
OUTAGE_AGENT_EXPECT = frozenset({"node_silent", "group_broken"})


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
    kind: str = ""  # the scenario's name in the table (`Chaos.scenario`)
    rebuild: bool = False  # etcd's data was lost: exactly one state_rebuilt generation is the answer
    healed_at: float | None = None  # wall clock: the cause removed (etcd back, coordinators serving, leader resumed)
    resumed_s: float | None = None  # the heal (else the fault) -> every surviving slot stepped again
    wedged: str | None = None  # why the job did not step again within bound_s
    bound_s: float = LIVENESS_BOUND_S  # the heal (else the fault) -> every surviving slot stepping again
    outage_s: float | None = None  # how long etcd or every coordinator was down (an outage's length)
    lost: list[str] = field(default_factory=list)  # survivors whose process changed (lost to a fault outside them)
    # Survivors whose training thread gloo left in a wait that no closed connection ends (a peer killed
    # while its message to this rank was half read): the stuck-thread bound replaced them within 3 s,
    # their state taken from the others. Counted apart from `lost` (docs/limits.md, gloo's wait).
    replaced_stuck: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # other broken invariants, each a precise message
    stall_s: float | None = None  # longest gap between two steps of the job from this fault to the next
    frozen: tuple[CoordinatorProcess, int] | None = field(default=None, repr=False)  # (leader, its term)
    slowed: str | None = None  # the node of the rank a throttle slows (slow_rank)
    throttle: Throttle | None = field(default=None, repr=False)

    @property
    def since(self) -> float:
        return self.healed_at or self.at

    def summary(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("pids_before", "frozen", "throttle")}
        d["victims"] = [f"{n}/{s}" for n, s in self.victims]
        d["expect"] = sorted(self.expect)
        return d


class NetNamespace:
    """A node behind a veth pair in its own network namespace, so it can be cut off (both ends
    of the link down: packets are dropped, connections stay open, nothing is told).

    Named after its purpose and this process's PID, with a /30 of 10.251.0.0/16 that no other
    namespace on the host holds (chosen under a host-wide lock): two suites on one machine never
    delete or shadow each other's. `create` removes the namespaces of ours whose process is gone."""

    LOCK = Path("/run/lock/muster-netns.lock")
    OURS = re.compile(r"^mu([a-z]+)([0-9]+)$")

    def __init__(self, purpose: str, pid: int = 0):
        self.name = f"mu{purpose}{pid or os.getpid()}"
        self.host_dev, self.node_dev = f"{self.name}-h", f"{self.name}-n"
        assert len(self.host_dev) <= 15, f"interface name {self.host_dev!r} over Linux's 15 characters"
        self.host_ip = self.node_ip = ""

    @staticmethod
    def unavailable() -> str | None:
        """Why namespaces cannot be made here, or None."""
        if os.geteuid() != 0:
            return "network namespaces need root"
        probe = NetNamespace("prob")
        try:
            probe.create()
        except (OSError, subprocess.CalledProcessError) as exc:
            return f"cannot create a network namespace: {exc}"
        finally:
            probe.delete()
        return None

    def _ip(self, *args: str, inside: bool = False) -> str:
        prefix = ["ip", "netns", "exec", self.name] if inside else []
        return subprocess.run([*prefix, "ip", *args], check=True, capture_output=True, text=True, timeout=10).stdout

    def create(self) -> NetNamespace:
        self.LOCK.parent.mkdir(parents=True, exist_ok=True)
        with open(self.LOCK, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            for line in self._ip("netns", "list").splitlines():
                name = line.split()[0] if line.strip() else ""
                found = self.OURS.match(name)
                if found and (name == self.name or not process_alive(int(found[2]))):
                    NetNamespace(found[1], int(found[2])).delete()  # a killed run's, or an earlier one of ours
            held = {(int(c), int(d)) for c, d in re.findall(r"inet 10\.251\.(\d+)\.(\d+)/30",
                                                            self._ip("-4", "-o", "addr", "show"))}
            third, block = next(divmod(b, 64) for b in range(16384) if (b // 64, b % 64 * 4 + 1) not in held)
            self.host_ip, self.node_ip = (f"10.251.{third}.{block * 4 + n}" for n in (1, 2))
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
                 grace_s: float = GRACE_S,
                 host: str = "127.0.0.1", netns: dict[str, NetNamespace] | None = None, seed: int | None = None,
                 strict: bool = True, relay_min_nodes: int = 0,
                 outages_s: tuple[float, float] | None = None):
        self.workdir = workdir
        self.rng = random.Random(seed)  # every random choice of the harness: a seed replays the victims
        # strict: any broken invariant raises at once. Otherwise (the soak) a wedge or a rank lost to
        # a fault outside it is recorded on the fault and the sequence goes on; the rest still raises.
        self.strict = strict
        # how long an etcd outage or every coordinator down lasts: drawn per fault (from the seed) between
        # the two bounds; None: ETCD_OUTAGE_S and COORDINATORS_DOWN_S
        self.outages_s = outages_s
        self.nodes = [f"node{i}" for i in range(nodes)]
        self.slots = slots
        self.job = job
        self.step_sleep_s = step_sleep_s
        self.host = host  # what the coordinators and the nodes outside a namespace listen on
        self.netns = netns or {}
        self.grace_s = grace_s
        self.coordinator_flags = ["--heartbeat-timeout", str(heartbeat_timeout_s), "--session-ttl", str(SESSION_TTL_S),
                                  "--grace", str(grace_s)]
        if relay_min_nodes:  # the nodes stream through the replicas their ids hash to, relayed to the leader
            self.coordinator_flags += ["--relay-min-nodes", str(relay_min_nodes)]
        if not host.startswith("127."):  # a namespace's veth address: a private test network, no TLS or tokens
            self.coordinator_flags.append("--insecure")
        self.etcd = EtcdCluster(workdir / "etcd", etcd_members)
        self.replicas: list[CoordinatorProcess] = []
        self.agents: dict[str, AgentProcess] = {}
        self.incarnations: dict[str, list[AgentProcess]] = defaultdict(list)
        self.faults: list[Fault] = []
        self.pids: set[int] = set()  # every process started, for the orphan check
        # In the environment of every process it starts (ranks inherit it from their agents): over a
        # long soak on a busy machine a PID of the run is reused by someone else's process.
        self.tag = f"{CHAOS_RUN_ENV}={uuid.uuid4().hex}"
        self.started_at = 0.0
        self.full_at = 0.0  # first time at full strength: stalls are counted from here
        self._n_replicas = replicas
        self._frozen: set[int] = set()  # PIDs of coordinators held by SIGSTOP
        self._checked: dict[Slot, int] = {}  # every slot's process when the last fault passed its checks

    # ---- lifecycle -------------------------------------------------------------------

    def start(self, timeout_s: float = 120.0) -> Chaos:
        self.started_at = time.time()
        os.environ[CHAOS_RUN_ENV] = self.tag.split("=", 1)[1]
        self.etcd.start()
        self.pids.update(m.pid for m in self.etcd.members)
        for _ in range(self._n_replicas):
            self.restart_coordinator()
        for node in self.nodes:
            self.restart_agent(node)
        self.full_strength(timeout_s)
        self.full_at = time.time()
        return self

    def stop(self) -> list[int]:
        """Stop everything; the PIDs of processes (ranks included) still running afterwards."""
        for agents in self.incarnations.values():
            for a in agents:
                a.stop()
        for r in self.replicas:
            r.stop()
        self.etcd.stop()
        if not any(m.running() for m in self.etcd.members):
            self.etcd.wipe()  # its members' preallocated WAL files: 64 MB each, the logs stay
        self.pids.update(run.pid for run in self.runs())
        os.environ.pop(CHAOS_RUN_ENV, None)

        def left() -> list[int]:
            return sorted(pid for pid in self.pids if process_alive(pid) and carries_tag(pid, self.tag))

        try:  # ranks die with their agent (PR_SET_PDEATHSIG), a moment after it
            wait_until(lambda: not left(), 5, "the run's processes to end")
        except AssertionError:
            pass  # the caller reports them
        return left()


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
                member.start(port_wait_s=10.0)
                self.pids.add(member.pid)

    def revive(self) -> list[str]:
        """Bring back what died without being the fault's victim (an agent that exited, a replica
        short): a soak goes on at full strength after a recorded failure. What it did, as notes."""
        notes = []
        for node, agent in list(self.agents.items()):
            if agent.proc.poll() is not None:
                notes.append(f"{node}'s agent (pid {agent.pid}) had exited with {agent.proc.returncode}: restarted; "
                             f"its log: {agent.log_path}")
                self.restart_agent(node)
        while len(self.addresses) < self._n_replicas:
            notes.append(f"restarted coordinator {self.restart_coordinator().address}")
        return notes

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
                    out.append(RankRun(a.node_id, r["slot"], r["pid"], Path(r["log"])))
        return out

    def _run_named(self, reason: str) -> RankRun | None:
        """The rank process an event's reason names ('... pid 123 exit code 3')."""
        pid = re.search(r"\bpid (\d+)", reason)
        return next((run for run in self.runs() if pid and run.pid == int(pid.group(1))), None)

    def current(self) -> dict[Slot, RankRun]:
        """The newest live process of every slot of every running agent."""
        out = {}
        for node, agent in self.agents.items():
            if agent.proc.poll() is not None:
                continue
            for run in self.runs():
                if run.node == node and run.log.is_relative_to(agent.log_dir) and process_alive(run.pid):
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
        return wait_until(self.serving_leader, timeout_s, "a coordinator leading the job", interval_s=0.1)

    def serving_leader(self) -> CoordinatorProcess | None:
        """The replica answering as the job's live leader now, if any (frozen ones are not asked)."""
        return next((r for r in self.replicas if r.pid not in self._frozen and r.leads(self.job)), None)

    def status(self, brief: bool = True) -> pb.JobStatus | None:
        """The job as the serving leader sees it (generation, term; not brief: its ranks' first page), or None."""
        leader = self.serving_leader()
        if leader is None:
            return None
        try:
            with Coordinators([leader.address], timeout_s=2) as c:
                return c.call("Status", pb.StatusRequest(job=self.job, brief=brief)).jobs[0]
        except Exception:  # between lives
            return None

    def events(self) -> list[pb.Event]:
        live = [r.address for r in self.replicas if r.proc.poll() is None and r.pid not in self._frozen]
        with Coordinators(live or self.addresses, timeout_s=5) as c:
            return list(c.call("Events", pb.EventsRequest(job=self.job)).events)

    def step_times(self) -> list[float]:
        """When the job completed a step: every step record of every rank process, sorted."""
        return sorted(record_time(r) for run in self.runs() for r in run.steps())

    def stall(self, start: float, end: float, step_times: list[float] | None = None) -> float:
        """The longest time in [start, end] with no step completed by any rank."""
        times = [start, *(t for t in (self.step_times() if step_times is None else step_times) if start < t < end), end]
        return round(max(b - a for a, b in zip(times, times[1:])), 3)

    def coordinator_logs(self) -> str:
        return ", ".join(str(r.log_path) for r in self.replicas if r.proc.poll() is None) or "(none running)"

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
        return by_rank[rank] if rank is not None else by_rank[self.rng.choice(sorted(r for r in by_rank if r != 0))]

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

    def slow_rank(self) -> Fault:
        """Throttle a rank from outside (SIGSTOP 60% of every 50 ms): nothing dies, the job slows to
        its pace; `unthrottle` checks that its node was named a straggler, and nobody else."""
        slot = self.rank_slot()
        pid = self.current()[slot].pid
        throttle = Throttle(pid, stopped=0.6, period_s=0.05)
        fault = self._inject("throttle rank", f"rank pid {pid} at {slot[0]}/{slot[1]}, stopped 60% of every 50 ms",
                             [], membership=False, expect={"straggler"}, action=throttle.start)
        fault.slowed, fault.throttle = slot[0], throttle
        return fault

    def unthrottle(self, fault: Fault) -> None:
        def named(node: str | None = None) -> list[dict]:
            return [r for rep in self.replicas for r in rep.find("straggler_named")
                    if record_time(r) >= fault.at and (node is None or r["node"] == node)]
        try:
            first = wait_until(lambda: named(fault.slowed), STRAGGLER_BOUND_S, f"{fault.slowed} named a straggler")[0]
            fault.detected_s = round(record_time(first) - fault.at, 3)
            fault.notes.append(f"named {fault.detected_s} s after the throttle began: {first['factor']}x, "
                               f"up to {first['loss']:.0%} of the job's throughput lost")
        except AssertionError as exc:
            fault.problems.append(f"{fault.name}: {exc} (coordinator logs: {self.coordinator_logs()})")
        finally:
            fault.throttle.stop()
        others = [{k: r.get(k) for k in ("node", "local_ranks", "factor", "median_ms", "timestamp")}
                  for r in named() if r["node"] != fault.slowed]
        if others:  # with every rank's compute now: was the host slowing them, or the judgement wrong?
            status = self.status(brief=False)
            computes = {f"{r.node}/{r.local_rank}": round(r.compute_us / 1e3, 1) for r in status.ranks} \
                if status else "no leader answered"
            fault.problems.append(f"{fault.name}: healthy nodes named stragglers: {others}; every rank's "
                                  f"compute (ms) now: {computes}; load average {os.getloadavg()}")

    def kill_agent(self, node: str | None = None) -> Fault:
        node = node or self.rng.choice(sorted(n for n in self.agents if n != self.rank_slot(0)[0]))
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

    def kill_relay(self) -> Fault:
        """SIGKILL a replica that does not lead the job (with relays on, it carries some nodes' streams)."""
        leader = self.leader()
        relay = self.rng.choice([r for r in self.replicas if r.proc.poll() is None and r is not leader])
        return self._inject("SIGKILL a relaying replica", f"coordinator {relay.address} pid {relay.pid}", [],
                            membership=False, expect=set(), action=relay.kill)

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
        second = self.rng.choice(sorted(survivors))
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
        finds itself evicted and joins again as a new member, its ranks held (never taken back
        silently as the member it was)."""
        node = fault.victims[0][0]
        cut_off = self.agents[node]
        others = [r["step"] for k, r in self.last_steps().items() if k[0] != node]
        stranded = max((r["step"] for run in self.runs() if run.node == node for r in run.steps()), default=0)
        assert stranded <= min(others), f"{node} trained on alone while cut off (step {stranded})"
        self.netns[node].heal()
        wait_until(lambda: cut_off.records("node_rejoining") or cut_off.proc.poll() is not None, 60,
                   f"{node} to join again once the network healed")
        assert cut_off.proc.poll() is None, f"{node}'s agent exited with {cut_off.proc.returncode} instead of joining again"
        fault.notes.append(f"{node} joined again as a new member once the network healed (was member "
                           f"{cut_off.records('node_rejoining')[-1]['member']})")

    # ---- compound faults: whole-deployment outages, a frozen leader, a hostile client ----

    def _sleep_until(self, at: float) -> None:
        time.sleep(max(0.0, at - time.time()))

    def _outage_length(self, default_s: float) -> float:
        return round(self.rng.uniform(*self.outages_s), 1) if self.outages_s else default_s

    def _outage_victim(self, kill: str | None) -> tuple[list[Slot], str, Callable[[], None] | None, frozenset]:
        """What dies during an outage: nothing, a rank (`rank`, `rank0`: the store host) or a whole
        node (`agent`, its ranks with it). (victims, what, the kill, the events that explain it)."""
        if kill is None:
            return [], "", None, frozenset()
        if kill == "agent":
            node = self.rng.choice(sorted(n for n in self.agents if n != self.rank_slot(0)[0]))
            agent = self.agents[node]
            return ([(node, s) for s in range(self.slots)], f"agent pid {agent.pid} of {node}",
                    lambda: agent.signal(signal.SIGKILL), OUTAGE_AGENT_EXPECT)
        slot = self.rank_slot(0 if kill == "rank0" else None)
        pid = self.current()[slot].pid
        return ([slot], f"rank{' 0' if kill == 'rank0' else ''} pid {pid} at {slot[0]}/{slot[1]}",
                lambda: os.kill(pid, signal.SIGKILL), OUTAGE_KILL_EXPECT)

    def _kill_during(self, fault: Fault, what: str, victim: str, kill: Callable[[], None] | None) -> None:
        """The victim of an outage fault dies KILL_INTO_OUTAGE_S into it, while no leader can hear of
        it (a rank's agent replaces it); the survivors must hold (no crash) until a leader is back."""
        if kill is None:
            return
        self._sleep_until(fault.at + KILL_INTO_OUTAGE_S)
        kill()
        fault.notes.append(f"{victim} SIGKILLed {round(time.time() - fault.at, 1)} s into the {what}")

    def etcd_outage(self, *, freeze: bool = False, kill: str | None = None, seconds: float | None = None) -> Fault:
        """Every etcd member killed (or frozen: connections hang instead of being refused) for
        `seconds` (default: drawn from `outages_s`), then restarted with its data (or resumed). The
        leader steps down (its lease cannot be renewed); training goes on in its groups; once etcd is
        back a leader loads the state, gives the nodes their grace, and nothing changes. With `kill`,
        a rank (or a node) dies during the outage: a rank's agent restarts it, the survivors hold, and
        they re-form once a leader is back (the exit report reaches it with the node's next frame)."""
        victims, victim, action, expect = self._outage_victim(kill)
        seconds = seconds or self._outage_length(ETCD_OUTAGE_S)
        how = "SIGSTOP" if freeze else "SIGKILL"
        fault = self._inject(f"etcd total outage ({how}){' + SIGKILL ' + kill if kill else ''}",
                             f"every etcd member ({', '.join(str(m.pid) for m in self.etcd.members)}) {how} for "
                             f"{seconds:g} s" + (f"; {victim}" if victim else ""),
                             victims, membership=kill is not None, expect=set(expect),
                             action=self.etcd.freeze_all if freeze else self.etcd.kill_all)
        fault.bound_s, fault.outage_s = HEAL_BOUND_S, seconds
        self._kill_during(fault, "etcd outage", victim, action)
        self._sleep_until(fault.at + seconds)
        if freeze:
            self.etcd.thaw_all()
            wait_until(self.etcd.healthy, 30, "every etcd member healthy after SIGCONT", interval_s=0.1)
        else:
            self.etcd.restart()
            self.pids.update(m.pid for m in self.etcd.members)
        fault.healed_at = time.time()
        return fault

    def coordinators_down(self, *, kill: str | None = None, seconds: float | None = None) -> Fault:
        """Every coordinator SIGKILLed for `seconds` (default: drawn from `outages_s`), then restarted
        at its address. Training goes on in its groups; the agents keep retrying; nobody is evicted
        (the new leader gives the nodes their grace). With `kill`, a rank or a node dies meanwhile
        (as in `etcd_outage`)."""
        victims, victim, action, expect = self._outage_victim(kill)
        seconds = seconds or self._outage_length(COORDINATORS_DOWN_S)
        down = [r for r in self.replicas if r.proc.poll() is None]

        def kill_all():
            for r in down:
                r.kill()
        fault = self._inject(f"every coordinator down{' + SIGKILL ' + kill if kill else ''}",
                             f"coordinators {', '.join(f'{r.address} pid {r.pid}' for r in down)} SIGKILLed for "
                             f"{seconds:g} s" + (f"; {victim}" if victim else ""),
                             victims, membership=kill is not None, expect=set(expect), action=kill_all)
        fault.bound_s, fault.outage_s = HEAL_BOUND_S, seconds
        self._kill_during(fault, "coordinator outage", victim, action)
        self._sleep_until(fault.at + seconds)
        for _ in down:
            self.restart_coordinator()
        fault.healed_at = time.time()
        return fault

    def etcd_data_loss(self) -> Fault:
        """Every etcd member killed, its data deleted, and a fresh cluster started at the same
        endpoints: the job's state, spec and elections are gone. The coordinators must rebuild the
        job from its nodes (their rejoin identity): exactly one state_rebuilt generation, nobody
        evicted, the survivors keep their processes and their steps."""
        def wipe():
            self.etcd.kill_all()
            self.etcd.wipe()
            self.etcd.restart()
        fault = self._inject("etcd data loss", f"every etcd member ({', '.join(str(m.pid) for m in self.etcd.members)}) "
                             "SIGKILLed, its data deleted, a fresh cluster started at the same endpoints", [],
                             membership=False, expect={"state_rebuilt"}, action=wipe)
        self.pids.update(m.pid for m in self.etcd.members)
        fault.rebuild = True
        fault.healed_at = time.time()
        return fault

    def freeze_leader_at_reform(self) -> Fault:
        """Kill a rank; the moment the leader logs the new generation, SIGSTOP the leader. A standby
        takes over once its lease expires and the survivors re-form; resumed (`resume_leader`), the
        old leader must find itself stepped down (fenced) and publish nothing."""
        leader = self.leader()
        fault = self.kill_rank()
        published = wait_until(lambda: [r for r in leader.find("membership_changed", kind="generation")
                                        if record_time(r) >= fault.at], 15,
                               f"the leader's membership_changed kind=generation record (log {leader.log_path})",
                               interval_s=0.005)
        leader.signal(signal.SIGSTOP)
        self._frozen.add(leader.pid)
        term = published[0].get("term", 0)
        fault.frozen = (leader, term)
        fault.name = "SIGSTOP the leader as it publishes a reform"
        fault.detail += (f"; then coordinator {leader.address} pid {leader.pid} (term {term}) SIGSTOPped "
                         f"{round(time.time() - record_time(published[0]), 3)} s after it logged generation "
                         f"{published[0].get('generation')}")
        return fault

    def resume_leader(self, fault: Fault) -> None:
        """SIGCONT the frozen leader: within STEP_DOWN_BOUND_S it must log that it lost the job
        (its session expired, or its fenced write was refused) and publish nothing as the old term."""
        leader, term = fault.frozen
        try:  # resumed only once a standby leads: what it must find is that it was replaced
            successor = self.leader(LIVENESS_BOUND_S)
            took = [record_time(r) - fault.at for r in successor.find("leadership_acquired", job=self.job)
                    if record_time(r) >= fault.at]
            fault.notes.append(f"{successor.address} led {round(took[0], 3) if took else '?'} s after the kill; "
                               f"the survivors had stepped in the new group {fault.recovered_s} s after it"
                               + (" (the frozen leader's directives had gone out)"
                                  if fault.recovered_s is not None and took and fault.recovered_s < took[0] else ""))
        except AssertionError:
            fault.notes.append(f"no standby led within {LIVENESS_BOUND_S:g} s: resumed anyway")
        resumed = fault.healed_at = time.time()  # taken first: the resumed process may log before we read the clock
        os.kill(leader.pid, signal.SIGCONT)
        self._frozen.discard(leader.pid)

        def after(event: str) -> list[dict]:
            return [r for r in leader.find(event, job=self.job) if r.get("term") == term and record_time(r) >= resumed]
        try:
            lost = wait_until(lambda: after("leadership_lost"), STEP_DOWN_BOUND_S, "leadership_lost", interval_s=0.05)
            fault.notes.append(f"resumed leader stepped down {round(record_time(lost[0]) - resumed, 3)} s after SIGCONT: "
                               f"{lost[0].get('reason')}")
        except AssertionError:
            fault.problems.append(
                f"{fault.name}: the resumed leader {leader.address} pid {leader.pid} logged no leadership_lost for "
                f"term {term} within {STEP_DOWN_BOUND_S:g} s of SIGCONT (expected: it steps down, fenced); "
                f"read {leader.log_path}")
        published = after("membership_changed")
        if published:
            fault.problems.append(
                f"{fault.name}: the resumed leader published as term {term} after SIGCONT (it should be fenced): "
                f"{[(r.get('kind'), r.get('generation'), r.get('reason')) for r in published][:5]}; read {leader.log_path}")
        status = self.status()
        if status is not None and status.term <= term:
            fault.problems.append(f"{fault.name}: the job is led with term {status.term} by {status.leader} after the "
                                  f"frozen leader (term {term}) resumed; a standby should have taken over with a "
                                  "higher term")

    def hostile_client(self) -> Fault:
        """A hostile client on the wire while training runs: garbage bytes to every replica's port;
        oversized names; a Join as an existing node; Sessions and immediate Leaves of a node with
        guessed member_ids (the real one among them) and no session secret. Every RPC must be
        refused with a precise status, the same leader keeps serving with the same term, and
        nothing changes: no generation, no eviction, no process."""
        leader = self.leader()
        before = self.status()
        node = self.rng.choice(sorted(n for n in self.agents if n != self.rank_slot(0)[0]))
        joined = self.agents[node].records("node_joined")
        member_id = joined[-1]["member"] if joined else 1
        agents = {n: a.pid for n, a in self.agents.items()}
        outcomes: list[hostile.Outcome] = []
        changes: list[str] = []

        def look(probe: str) -> None:
            deaf = [r.address for r in self.replicas if r.proc.poll() is None and not _answers(r.address, self.job)]
            if deaf:
                changes.append(f"after {probe}: replica(s) {deaf} no longer answer Status "
                               f"(read {self.coordinator_logs()})")
            now = self.status()
            gone = [f"{n}'s agent (pid {pid}) exited with {self.agents[n].proc.returncode}, its log: "
                    f"{self.agents[n].log_path}" for n, pid in agents.items() if self.agents[n].proc.poll() is not None]
            if now is None:
                changes.append(f"after {probe}: no leader serves the job any more (read {self.coordinator_logs()})")
            elif before is not None and (now.generation, now.term, now.leader) != (before.generation, before.term,
                                                                                     before.leader):
                changes.append(f"after {probe}: (generation, term, leader) went from "
                               f"{(before.generation, before.term, before.leader)} to "
                               f"{(now.generation, now.term, now.leader)}")
            for g in gone:
                if not any(g in c for c in changes):
                    changes.append(f"after {probe}: {g}")

        def attack():
            outcomes.extend(hostile.attack(leader.address, self.addresses, self.job, node, member_id, self.slots,
                                           between=look))
        fault = self._inject("hostile client", f"garbage, oversized names and an impostor of {node} (member "
                             f"{member_id}) against leader {leader.address}", [], membership=False, expect=set(),
                             action=attack)
        # Proved by progress, not by a sleep: every rank steps on for as long as silence would take
        # to evict a node (a broken stream or an eviction shows by then).
        settle_steps = math.ceil(HOSTILE_SETTLE_S / self.step_sleep_s)
        after = self.last_steps()
        try:
            wait_until(lambda: all(s["step"] >= after[k]["step"] + settle_steps
                                   for k, s in self.last_steps().items() if k in after),
                       LIVENESS_BOUND_S + HOSTILE_SETTLE_S,
                       f"every rank {settle_steps} steps on after the hostile client")
        except AssertionError as exc:
            changes.append(str(exc))
        look("the settle time")
        fault.notes.extend(str(o) for o in outcomes)
        for o in outcomes:
            if o.accepted:
                fault.problems.append(f"hostile client: {o.probe} was accepted (expected a refusal); read {leader.log_path}")
            elif o.imprecise:
                fault.problems.append(f"hostile client: {o.probe} got {o.result} (expected a precise refusal, one of "
                                      f"{sorted(hostile.PRECISE_REFUSALS)}): {o.detail[:200]}; read {leader.log_path}")
        fault.problems.extend(f"hostile client: {c}" for c in dict.fromkeys(changes))
        if leader.proc.poll() is not None:
            fault.problems.append(f"hostile client: the leader {leader.address} exited with {leader.proc.returncode}; "
                                  f"read {leader.log_path}")
        return fault

    def scenario(self, name: str) -> Fault:
        """One named fault: inject it (an outage also heals inside), check that the job steps again
        within LIVENESS_BOUND_S, time the answer, repair what it broke, wait for full strength,
        check the invariants."""
        kind = faults.BY_NAME[name]
        self.between()
        fault = kind.inject(self)
        fault.kind = name
        self.liveness(fault)
        fault.lost = self.find_lost(fault)
        if self.strict and (fault.wedged or fault.lost or fault.problems):  # fail fast, with the cause first
            self.verdict(fault)
        self.recover(fault)
        if kind.repair is not None:
            kind.repair(self, fault)
        fault.notes.extend(self.revive())
        self.full_strength()
        if kind.new_leader:
            self.past_grace(fault)
        self.check(fault)
        return fault

    def past_grace(self, fault: Fault) -> None:
        """Wait until the serving leader's grace and a heartbeat timeout after it have passed."""
        leader = self.serving_leader()
        took = [record_time(r) for r in leader.find("leadership_acquired", job=self.job)] if leader else []
        if took and took[-1] >= fault.at:
            self._sleep_until(took[-1] + self.grace_s + HEARTBEAT_TIMEOUT_S + 0.5)

    # ---- recovery and invariants -----------------------------------------------------

    def between(self, wait_s: float = 0.0) -> None:
        """What broke after the last fault passed its checks and before the next one (or the end,
        after `wait_s`): an agent that exited (its ranks with it), a rank process that changed.
        Each is a rank lost to a fault outside it, charged to the last fault. Strict: raises.
        Otherwise the deployment is brought back to full strength and the sequence goes on."""
        time.sleep(wait_s)
        if not self.faults:
            return
        last = self.faults[-1]
        broken = [f"{node}'s agent (pid {agent.pid}) exited with {agent.proc.returncode}; its log {agent.log_path} "
                  f"ends: {_tail(agent.log_path, 2)}" for node, agent in self.agents.items()
                  if agent.proc.poll() is not None]
        current = self.current()
        for key, pid in self._checked.items():
            if key[0] in self.agents and self.agents[key[0]].proc.poll() is None and (
                    key not in current or current[key].pid != pid):
                old = next((run for run in self.runs() if run.pid == pid), None)
                if _replaced_stuck(old, last):
                    continue
                broken.append(f"rank {key[0]}/{key[1]} (pid {pid}) was replaced" +
                              (f"; its log {old.log} ends: {_tail(old.log, 2)}" if old else ""))
        if not broken:
            return
        lines = [f"after {last.name} ({last.detail}) had passed its checks, before the next fault: {b}" for b in broken]
        last.lost += lines
        if self.strict:
            raise AssertionError("\n".join(lines))
        last.notes.extend(self.revive())
        self.full_strength()
        self._checked = {k: r.pid for k, r in self.current().items()}

    def _rebuilt(self, fault: Fault) -> list[pb.Event]:
        try:
            events = self.events()
        except Exception:  # no leader yet, or the job not known again yet
            return []
        return [e for e in events if e.kind == "state_rebuilt" and e.time_unix_ms >= fault.at * 1000 - 5]

    def liveness(self, fault: Fault) -> None:
        """After the fault healed (or was injected), within LIVENESS_BOUND_S: a leader serves and
        every slot it did not target has completed a step again (in a new generation when one is
        the answer; after the state_rebuilt event for a data loss). A slot whose process was lost
        counts through its replacement (the loss itself is reported by `check`). Sets resumed_s,
        or records the wedge with what each slot last did."""
        since = fault.since

        def stepped():
            if self.serving_leader() is None:
                return None
            start = since
            if fault.rebuild:
                rebuilt = self._rebuilt(fault)
                if not rebuilt:
                    return None
                start = max(since, rebuilt[0].time_unix_ms / 1000)
            firsts = []
            for key, run in self.current().items():
                if key in fault.victims:
                    continue
                new = [r for r in run.steps() if record_time(r) >= start
                       and (not fault.membership or r["generation"] > fault.generation_before)]
                if not new:
                    return None
                firsts.append(record_time(new[0]))
            return firsts or None
        try:  # waited for past the bound (to LIVENESS_BOUND_S): a late answer is timed, and reported as one
            firsts = wait_until(stepped, max(fault.bound_s, LIVENESS_BOUND_S) + 1.0, "the job stepping again",
                                interval_s=0.1)
        except AssertionError:
            firsts = None
        if firsts is not None:
            fault.resumed_s = round(max(firsts) - since, 3)
            if fault.resumed_s <= fault.bound_s:
                return
        fault.wedged = self._wedge_report(fault)

    def find_lost(self, fault: Fault) -> list[str]:
        """Slots the fault did not target whose process changed: each with the log of the one lost
        (one the stuck-thread bound replaced goes to the fault's `replaced_stuck` instead)."""
        current = self.current()
        lost = []
        for key, pid in fault.pids_before.items():
            if key in fault.victims or (key in current and current[key].pid == pid):
                continue
            old = next((run for run in self.runs() if run.pid == pid), None)
            if _replaced_stuck(old, fault):
                continue
            now = f"now pid {current[key].pid}" if key in current else "the slot runs nothing now"
            agent = next((a for a in self.incarnations[key[0]] if old is not None and old.log.is_relative_to(a.log_dir)),
                         None)
            why = ""
            if agent is not None and (agent.proc.poll() is not None or key not in current):
                state = f"exited with {agent.proc.returncode}" if agent.proc.poll() is not None else "running"
                why = f"; its agent (pid {agent.pid}) {state}, its log {agent.log_path} ends: {_tail(agent.log_path, 2)}"
            lost.append(f"{fault.name}: survivor {key[0]}/{key[1]} lost its process (pid {pid}; {now}){why}; "
                        + (f"its log {old.log} ends: {_tail(old.log, 3)}" if old else "no log found"))
        return lost

    def _wedge_report(self, fault: Fault) -> str:
        start = "it healed" if fault.healed_at else "the fault"
        late = f" (it did after {fault.resumed_s} s)" if fault.resumed_s is not None else ""
        lines = [f"WEDGE: {fault.name} ({fault.detail}): the job did not step again within {fault.bound_s:g} s of "
                 f"{start} (expected: a leader serving and every surviving slot stepping"
                 f"{' in a new generation' if fault.membership else ''}"
                 f"{' after the state_rebuilt event' if fault.rebuild else ''}){late}."]
        leader = self.serving_leader()
        lines.append(f"  leader: {leader.address + ' ' + str(leader.log_path) if leader else 'none serving'}; "
                     f"coordinator logs: {self.coordinator_logs()}")
        if fault.rebuild:
            lines.append(f"  state_rebuilt events since the fault: {len(self._rebuilt(fault))}")
        for key, run in sorted(self.current().items()):
            if key in fault.victims:
                continue
            steps = run.steps()
            last = steps[-1] if steps else None
            tail = _tail(run.log, 2)
            lines.append(f"  {key[0]}/{key[1]} pid {run.pid}: last step "
                         f"{(last['step'], 'generation', last['generation'], round(time.time() - record_time(last), 1), 's ago') if last else None}; "
                         f"log {run.log} ends: {tail}")
        return "\n".join(lines)

    def recover(self, fault: Fault, timeout_s: float = 60.0) -> Fault:
        """Wait for the answer to `fault` and time it."""
        if fault.membership:
            def stepped_in_new_group():
                firsts = []
                current = {k: run for k, run in self.current().items() if k not in fault.victims}
                kept = {k: run for k, run in current.items() if fault.pids_before.get(k) == run.pid}
                for key, run in (kept or current).items():  # survivors all lost (`check` says so): their replacements
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
            survivors = [r for r in self.replicas if r.proc.poll() is None and r.pid not in self._frozen]
            wait_until(lambda: any(r.leads(self.job) for r in survivors), timeout_s, "a serving leader")
            fault.recovered_s = round(time.time() - fault.at, 3)
            if fault.rebuild:
                wait_until(lambda: self._rebuilt(fault), timeout_s,
                           f"a state_rebuilt event after {fault.name} (coordinator logs: {self.coordinator_logs()})",
                           interval_s=0.2)
            steps = {k: r["step"] for k, r in self.last_steps().items()}
            wait_until(lambda: all(self.last_steps().get(k, {}).get("step", 0) >= s + 5 for k, s in steps.items()),
                       timeout_s, "every rank stepping on", interval_s=0.1)
        fault.generation_after = self.generation()
        return fault

    def check(self, fault: Fault) -> None:
        """The invariants, over everything logged so far. Strict: raises AssertionError naming every
        broken one. Otherwise lost ranks and the wedge stay recorded on the fault and only the
        other problems raise."""
        current_runs = self.current()
        seen = {line.split(" lost its process")[0] for line in fault.lost}  # one line per slot (found after liveness)
        fault.lost += [line for line in self.find_lost(fault) if line.split(" lost its process")[0] not in seen]
        by_step: dict[tuple[int, int], set[str]] = defaultdict(set)
        for run in self.runs():
            records = json_lines(run.log) if run.log.exists() else []  # read once: both checks walk it
            gap = progress_gap(records)
            if gap:
                fault.problems.append(f"{fault.name}: {run.node}/{run.slot} pid {run.pid} {gap} (log {run.log})")
            for r in records:
                if r.get("event") == "step":
                    by_step[(r["generation"], r["step"])].add(r["digest"])
        split = {k: v for k, v in by_step.items() if len(v) > 1}
        if split:
            fault.problems.append(f"{fault.name}: ranks differ at (generation, step) {sorted(split)[:5]}")
        events = self.events()
        explained = {e.generation for e in events}
        seen = {g for (g, _) in by_step if g > min(explained, default=0)}
        if not seen <= explained:
            fault.problems.append(f"{fault.name}: generations {sorted(seen - explained)} have no event")
        after = [e for e in events if e.time_unix_ms >= fault.at * 1000 - 5]
        evictions = [(e.kind, e.reason) for e in after if e.kind in EVICTIONS]
        if fault.rebuild:
            rebuilt = [e for e in after if e.kind == "state_rebuilt"]
            fault.notes.extend(f"state_rebuilt (generation {e.generation}): {e.reason}" for e in rebuilt)
            if len(rebuilt) != 1:
                fault.problems.append(f"{fault.name}: expected exactly one state_rebuilt event, got {len(rebuilt)}: "
                                      f"{[(e.kind, e.generation, e.reason) for e in after]}; "
                                      f"read {self.coordinator_logs()}")
            # A rank the stuck-thread bound replaced (gloo's wait on a half-read message outlives the
            # rebuild's abort) is counted apart, as in find_lost: its exit and return are the only
            # generations allowed beyond the rebuild's.
            stuck = [e for e in after if e.kind == "rank_exited" and _replaced_stuck(self._run_named(e.reason), fault)]
            evictions = [(e.kind, e.reason) for e in after if e.kind in EVICTIONS and e not in stuck]
            excused = {e.generation for e in stuck} | {
                e.generation for e in after if e.kind == "rank_recovered" and stuck and e.generation > stuck[0].generation}
            if evictions:
                fault.problems.append(f"{fault.name}: nobody may be evicted, got {evictions}")
            stepped = {r["generation"] for run in self.runs() for r in run.steps()
                       if r["generation"] > fault.generation_before and record_time(r) >= fault.at} - excused
            generations = {e.generation for e in after if e.kind == "generation"} - excused
            if len(stepped) > 1 or len(generations) > 1:
                fault.problems.append(f"{fault.name}: expected one rebuild generation; ranks stepped in generations "
                                      f"{sorted(stepped)} after it, events name {sorted(generations)}: "
                                      f"{[(e.kind, e.generation, e.reason) for e in after]}")
        elif fault.membership:
            if not fault.generation_after > fault.generation_before:
                fault.problems.append(f"{fault.name}: no new generation (still {fault.generation_before})")
            explained_by = [f"{e.kind} (generation {e.generation}): {e.reason}" for e in after if e.kind in fault.expect]
            if explained_by:
                fault.notes.append(f"explained by {explained_by[0]}")
            else:
                fault.problems.append(f"{fault.name}: no {sorted(fault.expect)} event; "
                                      f"got {[(e.kind, e.reason) for e in after]}")
        else:
            if evictions:
                fault.problems.append(f"{fault.name}: nobody may be evicted, got {evictions}")
            if fault.generation_after != fault.generation_before:
                fault.problems.append(f"{fault.name}: generation {fault.generation_before} -> {fault.generation_after} "
                                      f"(expected none): {[(e.kind, e.generation, e.reason) for e in after]}")
        self.verdict(fault)
        self._checked = {k: r.pid for k, r in current_runs.items()}

    def verdict(self, fault: Fault) -> None:
        broken = (fault.lost + ([fault.wedged] if fault.wedged else []) if self.strict else []) + fault.problems
        if broken:
            raise AssertionError("\n".join(dict.fromkeys(broken)))

    def report(self) -> dict:
        runs = self.runs()
        top = max((r["step"] for run in runs for r in run.steps()[-1:]), default=0)
        now, times = time.time(), self.step_times()
        for fault, following in zip(self.faults, [*self.faults[1:], None]):
            fault.stall_s = self.stall(fault.at, following.at if following else now, times)
        out = {"job": self.job, "nodes": len(self.nodes), "slots": self.slots,
               "seconds": round(now - self.started_at, 1), "highest_step": top,
               "rank_processes": len(runs), "liveness_bound_s": LIVENESS_BOUND_S,
               "longest_stall_s": self.stall(self.full_at, now, times) if self.full_at else None,
               "faults": [f.summary() for f in self.faults]}
        (self.workdir / "report.json").write_text(json.dumps(out, indent=2, default=str))
        return out


def _answers(address: str, job: str) -> bool:
    """The replica at `address` answers a Status call (as leader or standby)."""
    try:
        with Coordinators([address], timeout_s=2) as c:
            c.call("Status", pb.StatusRequest(job=job, brief=True))
        return True
    except Exception:
        return False


def _replaced_stuck(run: RankRun | None, fault: Fault) -> bool:
    """Whether `run` ended itself by the stuck-thread bound, its training thread still in a group an
    abort broke (rank_exited_stuck: gloo's wait on a message half read when its peer died is ended
    by nothing but the op's timeout). Recorded on `fault` once."""
    stuck = json_lines(run.log, "rank_exited_stuck") if run is not None and run.log.exists() else []
    if not stuck or "has not left generation" not in stuck[-1].get("error", ""):
        return False
    line = f"{run.node}/{run.slot} pid {run.pid}: {stuck[-1]['error']}"
    if line not in fault.replaced_stuck:
        fault.replaced_stuck.append(line)
    return True


def _tail(path: Path, lines: int) -> list[str]:
    """The last lines of a log, shortened, for a failure message."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [line[:300] for line in text[-lines:]]


def started(cluster: Chaos, request):
    """`cluster` started for a module's faults, stopped afterwards with the orphan check."""
    try:
        cluster.start()
        yield cluster
    finally:
        report = cluster.report()
        leftovers = cluster.stop()
        request.config._chaos_reports = getattr(request.config, "_chaos_reports", []) + [report]
        assert not leftovers, f"processes left behind: {leftovers}"
