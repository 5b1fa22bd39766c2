"""An unmodified script (examples/train_plain.py: env:// DDP, a snapshot every few steps, resumed at
start) under a launcher, one worker kill -9'd repeatedly. Launchers (--launcher): plain torchrun
(c10d rendezvous on 127.0.0.1, --max-restarts), `muster run -- torchrun …`, and torchrun
--rdzv-backend=muster, the last two against a real etcd and a coordinator. Each answers a dead rank
by restarting every worker, so the script resumes from its last snapshot. It is also the baseline
for bench/recovery.py: the same keys, so the two compare as ratios:

  start_to_step_s  from starting the launchers until every rank has completed its first step
  kill_to_step_s   from just before the SIGKILL until every rank has completed a step in the
                   restarted group (its first step record from a new process)
  steps_lost       (highest step completed before the kill) - (first step after the restart) + 1:
                   work redone because of the rollback to the checkpoint
  survivors_lost   survivors that are not in the new group: under torchrun all of them (restarted)
  workers_restarted  processes replaced per kill (the victim and every survivor)
  phases_s         where the time goes, from the agents' log: detect (kill -> an agent reacts),
                   stop (-> re-rendezvous begins; stopping the survivors, and any failed rounds),
                   rendezvous (-> new workers spawned), worker_start (-> every rank has stepped:
                   interpreter + torch import, init_process_group, checkpoint load, first step)

Each kill lands at a random phase of the checkpoint cycle (the group first completes one to two
checkpoint intervals). torchrun's default of sharing the agent's TCPStore with the workers is turned
off (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): with it, a restarted gloo group reads the previous
attempt's addresses from the store and fails (pytorch/pytorch#135712); --share-store keeps it on.

    python bench/unmodified.py [--launcher muster-run] --ranks 8 --kills 5 [--nodes 2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from contextlib import contextmanager, nullcontext
from datetime import datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from recovery import summary

from muster import logs
from muster.coordinator.etcd.server import EtcdServer
from muster.local import CoordinatorProcess, end_on_sigterm, process_alive, wait_until
from muster.net import free_port

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# plain: a DDP script with torch.save snapshots; trainer: a Hugging Face Trainer script (a small
# GPT-2, save_steps), which needs `pip install transformers accelerate`; lightning (ModelCheckpoint)
# and accelerate (a hand-written loop, save_state): bench/trainers.py's
SCRIPTS = {"plain": EXAMPLES / "train_plain.py", "trainer": EXAMPLES / "train_trainer.py",
           "lightning": EXAMPLES / "train_lightning.py", "accelerate": EXAMPLES / "train_accelerate.py"}
TRAIN = SCRIPTS["plain"]
WARMUP_S = 40.0  # the ranks' imports recorded at 20 s, then a successor zygote imports them
STEP_RECORD = re.compile(r'\{"event": "step"[^{}]*\}')  # ranks share the agent's stdout; --tee adds "[default0]:"
# the agents' glog-style lines: "I1121 13:01:25.529000 14013 torch/.../api.py:942] message"
AGENT_LINE = re.compile(r"^[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d{6}) +(\d+) \S+\] (.*)$")
REACTIONS = ("closing signal", "failed (exitcode", "Worker group FAILED", "new nodes from group_rank")


def parent_pid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
        return None


def tagged_pids(tag: str) -> list[int]:
    """Live processes carrying this run's environment marker: our agents' workers, and only those."""
    found, needle = [], f"MUSTER_BENCH_RUN={tag}".encode()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read().split(b"\0") and process_alive(int(entry)):
                        found.append(int(entry))
            except OSError:
                continue
    return found


class Agent:
    """One torchrun agent (a 'node'): its output is read live into step records and agent events."""

    def __init__(self, index: int, argv: list[str], env: dict, log_path: Path):
        self.index, self.log_path = index, log_path
        self.steps: list[dict] = []
        self.events: list[tuple[float, str]] = []  # (wall time from the agent's own line, message)
        self.lock = threading.Lock()
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        year = time.localtime().tm_year
        with open(self.log_path, "w") as log:
            for raw in self.proc.stdout:
                line = raw.decode(errors="replace").rstrip("\n")
                log.write(line + "\n")
                steps = [json.loads(m) for m in STEP_RECORD.findall(line)]
                m = AGENT_LINE.match(line)
                event = None
                if m and int(m[7]) == self.proc.pid:
                    month, day, hour, minute, second, micro = (int(m[i]) for i in range(1, 7))
                    event = (datetime(year, month, day, hour, minute, second, micro).timestamp(), m[8])
                with self.lock:
                    self.steps += steps
                    if event:
                        self.events.append(event)

    def snapshot_events(self) -> list[tuple[float, str]]:
        with self.lock:
            return list(self.events)

    def workers(self) -> set[int]:
        """Its live descendants: torchrun's workers are its children, `muster run`'s are its
        children or its zygote's."""
        found, todo = set(), [self.proc.pid]
        while todo:
            children = _children(todo.pop())
            found.update(children)
            todo += children
        return {pid for pid in found if process_alive(pid)}

    def stop(self) -> None:
        """SIGTERM the agent (it stops its workers), then SIGKILL its process group if it lingers."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self.reader.join(5)


def _children(pid: int) -> list[int]:
    pids = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:  # it exited meanwhile
        return []
    for task in tasks:
        try:
            pids += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    return pids


LAUNCHERS = ("torchrun", "muster-run", "muster-run-cold", "muster-rdzv")


def launcher_argv(launcher: str, node: int, nodes: int, per_node: int, max_restarts: int, tag: str,
                  endpoint: str, script: list[str], muster_options: tuple[str, ...] = ()) -> list[str]:
    """One node's command. torchrun: c10d rendezvous at `endpoint`; muster-run: `muster run
    [muster_options] -- torchrun …` against the coordinator at `endpoint` (muster-run-cold: with
    --no-warm-start); muster-rdzv: torchrun --rdzv-backend=muster."""
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    if launcher.startswith("muster-run"):
        return [str(Path(sys.executable).with_name("muster")), "--log-level", "info", "run", "--coordinator", endpoint,
                "--job", tag[:12], "--node-id", f"node{node}", "--nodes", f"{nodes}:{nodes}",
                "--max-restarts", str(max_restarts),
                "--no-warm-start" if launcher == "muster-run-cold" else "--warm-start", *muster_options, "--", torchrun, "--nproc-per-node", str(per_node), *script]
    backend = "muster" if launcher == "muster-rdzv" else "c10d"
    return [torchrun, "--nnodes", str(nodes), "--nproc-per-node", str(per_node), "--rdzv-backend", backend,
            "--rdzv-endpoint", endpoint, "--rdzv-id", tag[:12], "--local-addr", "127.0.0.1",
            "--max-restarts", str(max_restarts), *script]


class Nodes:
    """The agents of one job started by a launcher, read through their output: every rank's step
    records, in arrival order."""

    def __init__(self, argvs: list[list[str]], env: dict, workdir: Path, name: str, tag: str):
        self.tag = tag
        self.agents: list[Agent] = []
        self.agents += [Agent(i, argv, env, workdir / f"{name}-{i}.log") for i, argv in enumerate(argvs)]

    def check(self) -> None:
        for a in self.agents:
            if a.proc.poll() is not None:
                raise RuntimeError(f"agent {a.index} exited ({a.proc.returncode}): see {a.log_path}")

    def marks(self) -> list[int]:
        return [len(a.steps) for a in self.agents]

    def records_since(self, mark: list[int], running: bool = True) -> list[dict]:
        """Step records that arrived after `mark` (in arrival order: each rank's in its own order);
        `running`: every agent is expected to be (one that exited raises)."""
        if running:
            self.check()
        out = []
        for a, m in zip(self.agents, mark):
            with a.lock:
                out += a.steps[m:]
        return out

    def latest(self, mark: list[int]) -> dict[int, dict]:
        return {r["rank"]: r for r in self.records_since(mark)}

    def stepping_past(self, target: int, mark: list[int], ranks: int):
        def check():
            current = self.latest(mark)
            return len(current) == ranks and min(r["step"] for r in current.values()) >= target and current
        return check

    def stepping_from_new_processes(self, mark: list[int], old: set[int], ranks: int):
        """A predicate: every rank's first step record after `mark` from a process not in `old`."""
        def check():
            new = {}
            for r in self.records_since(mark):
                if r["pid"] not in old:
                    new.setdefault(r["rank"], r)
            return len(new) == ranks and new
        return check

    def workers(self) -> set[int]:
        return set().union(*(a.workers() for a in self.agents))

    def events(self) -> list[tuple[int, float, str]]:
        return sorted((a.index, t, msg) for a in self.agents for t, msg in a.snapshot_events())

    def stop(self) -> int:
        """Stop the agents; end any worker that outlived its agent (ours by the marker in its
        environment). Returns how many did."""
        for a in self.agents:
            a.stop()
        leftovers = tagged_pids(self.tag)
        for pid in leftovers:
            os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not tagged_pids(self.tag), 10, "no worker processes left")
        return len(leftovers)


def restart_phases(window: list[tuple[int, float, str]], killed_at: float, recovered_at: float, nodes: int,
                   phases: dict[str, list[float]]) -> int:
    """The agents' view of one kill's interval: reaction, (failed rounds,) rendezvous, spawn; adds
    to `phases` and returns the restarts the kill took (1 = the first restart worked)."""
    reacted = min((t for _, t, msg in window if any(k in msg for k in REACTIONS)), default=None)
    starts = {i: t for i, t, msg in window if "Starting worker group" in msg}  # each agent's last
    rdzv = {i: t for i, t, msg in window if "Rendezvous'ing worker group" in msg and t <= starts.get(i, 0)}
    if reacted is not None and starts and rdzv:
        spawned, rdzv_began = max(starts.values()), min(rdzv.values())
        phases["detect"].append(reacted - killed_at)
        phases["stop"].append(rdzv_began - reacted)
        phases["rendezvous"].append(spawned - rdzv_began)
        phases["worker_start"].append(recovered_at - spawned)
    return max((sum(1 for j, _, msg in window if j == i and "Starting worker group" in msg) for i in range(nodes)),
               default=0)


def kill_cycles(workdir: Path, ranks: int, nodes: int, kills: int, step_sleep_s: float, checkpoint_every: int,
                max_restarts: int, share_store: bool, result: dict, launcher: str = "torchrun",
                coordinator: str = "", script_path: Path = TRAIN, warmup_s: float = 0.0) -> None:
    """Fills `result` as it goes, so a run that fails midway still reports what it measured.
    `coordinator`: the Muster coordinator's address (the muster launchers)."""
    if ranks % nodes:
        raise SystemExit("--ranks must be a multiple of --nodes")
    tag = uuid.uuid4().hex
    env = {**os.environ, "MUSTER_BENCH_RUN": tag, "LOGLEVEL": "INFO"}  # INFO: the agents' restart phases
    if not share_store:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    endpoint = coordinator or f"127.0.0.1:{free_port('127.0.0.1')}"
    script = [str(script_path), "--steps", str(10**9), "--step-sleep", str(step_sleep_s),
              "--checkpoint-dir", str(workdir / "checkpoints"), "--checkpoint-every", str(checkpoint_every)]
    recoveries, lost, restarted, rounds, victims = [], [], [], [], []
    phases: dict[str, list[float]] = {"detect": [], "stop": [], "rendezvous": [], "worker_start": []}
    result.update(launcher=launcher, script=script_path.name, warmup_s=warmup_s, ranks=ranks, nodes=nodes,
                  kills=kills, share_store=share_store, max_restarts=max_restarts, step_sleep_s=step_sleep_s, checkpoint_every=checkpoint_every)
    started = time.time()
    job = Nodes([launcher_argv(launcher, i, nodes, ranks // nodes, max_restarts, tag, endpoint, script)
                 for i in range(nodes)], env, workdir, launcher, tag)
    try:
        group = job.marks()  # where the current group's records begin
        wait_until(job.stepping_past(1, group, ranks), 120, "all ranks stepping", 0.05)
        firsts: dict[int, dict] = {}
        for r in job.records_since(group):
            firsts.setdefault(r["rank"], r)
        result["start_to_step_s"] = round(max(r["time"] for r in firsts.values()) - started, 3)
        wait_until(job.stepping_past(checkpoint_every + 1, group, ranks), 120, "all ranks stepping", 0.1)
        # A job runs a while before its first fault: long enough for warm starts to have learned
        # the ranks' imports (the runner records them IMPORTS_AFTER_S after a rank's start).
        time.sleep(max(0.0, started + warmup_s - time.time()))
        for _ in range(kills):
            # land the kill at a random phase of the checkpoint cycle
            first = min(r["step"] for r in job.latest(group).values())
            current = wait_until(job.stepping_past(first + checkpoint_every + random.randrange(checkpoint_every),
                                                   group, ranks), 120, "the group stepping before the kill", 0.1)
            workers = job.workers()
            victim_rank = random.randrange(ranks)
            victim = current[victim_rank]["pid"]
            if victim not in workers:  # only ever signal a worker of our own agents
                raise RuntimeError(f"rank {victim_rank} (pid {victim}) is not a live worker of our agents")
            old_pids = {r["pid"] for r in job.records_since(group)} | workers
            mark = job.marks()
            killed_at = time.time()
            os.kill(victim, signal.SIGKILL)
            victims.append(victim_rank)
            firsts = wait_until(job.stepping_from_new_processes(mark, old_pids, ranks), 60,
                                "every rank stepping after the restart")
            recovered_at = max(r["time"] for r in firsts.values())
            group_pids = {r["pid"] for r in current.values()}
            completed_before = max(r["step"] for r in job.records_since(group)
                                   if r["pid"] in group_pids and r["time"] <= killed_at)
            group = mark
            recoveries.append(recovered_at - killed_at)
            lost.append(max(0, completed_before - min(r["step"] for r in firsts.values()) + 1))
            restarted.append(sum(1 for pid in workers if not process_alive(pid)))
            window = [(i, t, msg) for i, t, msg in job.events() if killed_at <= t <= recovered_at]
            rounds.append(restart_phases(window, killed_at, recovered_at, nodes, phases))
            result.update(
                victim_ranks=victims,
                kill_to_step_s=summary(recoveries),
                steps_lost={"max": max(lost), "total": sum(lost)},
                survivors_lost=sum(n - 1 for n in restarted),
                workers_restarted={"per_kill": restarted, "total": sum(restarted)},
                restart_rounds=rounds,  # restarts each kill took (1 = the first restart worked)
                phases_s={k: summary(v) for k, v in phases.items() if v},
            )
    finally:
        result["workers_left_after_stop"] = job.stop()


@contextmanager
def muster_coordinator(workdir: Path):
    """A real etcd and one coordinator replica for the muster launchers: yields its address."""
    etcd = EtcdServer(workdir / "etcd").start()
    try:
        replica = CoordinatorProcess([etcd.endpoint], workdir / "coordinator.log", ["--heartbeat-timeout", "2.0"]).start()
        try:
            yield replica.address
        finally:
            replica.stop()
    finally:
        etcd.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--launcher", choices=LAUNCHERS, default="torchrun")
    p.add_argument("--script", choices=SCRIPTS, default="plain", help="the unmodified script (default plain)")
    p.add_argument("--warmup", type=float, default=WARMUP_S,
                   help=f"seconds from the start to the first kill (default {WARMUP_S:g}: warm starts learn a rank's "
                        "imports 20 s into its life)")
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--nodes", type=int, default=1, help="torchrun agents on this machine, ranks/nodes workers each")
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument("--max-restarts", type=int, help="torchrun --max-restarts (default: 3 per kill)")
    p.add_argument("--share-store", action="store_true",
                   help="keep torchrun's default TCPStore sharing (restarted gloo groups fail with it)")
    p.add_argument("--workdir", type=Path, help="keep the logs and checkpoints here (default: a temporary directory)")
    args = p.parse_args()
    logs.configure("warning")
    result: dict = {"benchmark": "unmodified", "torch": torch.__version__}
    rc = 0
    with tempfile.TemporaryDirectory(prefix="muster-bench-unmodified-") as d:
        workdir = args.workdir or Path(d)
        workdir.mkdir(parents=True, exist_ok=True)
        try:
            with muster_coordinator(workdir) if args.launcher != "torchrun" else nullcontext("") as coordinator:
                kill_cycles(workdir, args.ranks, args.nodes, args.kills, args.step_sleep, args.checkpoint_every,
                            args.max_restarts or 3 * args.kills, args.share_store, result, args.launcher, coordinator,
                            SCRIPTS[args.script], args.warmup)
        except (RuntimeError, AssertionError) as exc:  # report what was measured, and why it stopped
            result["error"] = str(exc)
            rc = 1
    print(json.dumps(result, indent=2))
    return rc


if __name__ == "__main__":
    end_on_sigterm()
    sys.exit(main())
