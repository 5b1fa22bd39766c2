"""Muster on one machine: coordinator replicas, node agents and training ranks as child processes
(with their JSON logs read back), and simulated node agents over real gRPC. Shipped, not test-only:
`muster demo` and the benchmarks run on it, and so do the tests."""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

import grpc

from muster.client import Coordinators
from muster.names import job_name
from muster.v1 import muster_pb2 as pb
from muster.worker.node_session import Evicted, JobEnded, NodeIdentity, NodeSession

FAST = [
    "--heartbeat-interval", "0.05", "--heartbeat-timeout", "1.0", "--grace", "2.0",
    "--last-call", "0.3", "--session-ttl", "2", "--tick", "0.05",
]


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.02, diagnose=None):
    """The predicate's first truthy value; past `timeout_s`, AssertionError naming what was waited
    for (and what `diagnose()` says of why it did not come)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}" + (f"\n{diagnose()}" if diagnose else ""))


def end_on_sigterm() -> None:
    """SIGTERM (a `timeout`, a cancelled job) ends this program as Ctrl-C does, by an exception, so
    the `finally` blocks that stop what it started run: its coordinators, agents and etcd are in
    sessions of their own, which the signal to its process group does not reach. (Python's default
    ends the process at once, and they ran on for good with their ranks.) Call it from a main thread."""
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))


def carries_tag(pid: int, tag: str) -> bool:
    """Whether process `pid`'s environment holds `tag` ("NAME=value"): started by a run that set it."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return tag.encode() in f.read().split(b"\0")
    except OSError:  # gone, or not ours to read
        return False


def tagged_processes(tag: str) -> list[int]:
    """The live processes whose environment holds `tag`: what a run started with the tag in its
    environment left running, its children's children included."""
    return [int(name) for name in os.listdir("/proc")
            if name.isdigit() and carries_tag(int(name), tag) and process_alive(int(name))]


def process_alive(pid: int) -> bool:
    """True while `pid` runs; an exited process waiting to be reaped (a zombie) has exited."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


class _Child:
    """A process a test started: signalled, awaited and ended by its PID only."""

    proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def wait(self, timeout_s: float) -> int:
        return self.proc.wait(timeout_s)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # a stopped process must run to die
            self.proc.kill()  # an agent's ranks follow it (PR_SET_PDEATHSIG)
            self.proc.wait(5)


class Throttle:
    """Slow a process from outside, as a throttled GPU or a noisy neighbour would: SIGSTOP it for
    `stopped` of every `period_s`, SIGCONT it for the rest (any program can be slowed so; a short
    period keeps it well within any heartbeat timeout). `stop` leaves it running."""

    def __init__(self, pid: int, stopped: float = 0.6, period_s: float = 0.1):
        if not 0 < stopped < 1 or period_s <= 0:
            raise ValueError(f"a throttle stops a process for a share of its period in (0, 1), not {stopped}")
        self.pid, self.stopped, self.period_s = pid, stopped, period_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"throttle-{pid}", daemon=True)

    def start(self) -> Throttle:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            while not self._done.is_set():
                os.kill(self.pid, signal.SIGSTOP)
                self._done.wait(self.period_s * self.stopped)
                os.kill(self.pid, signal.SIGCONT)
                self._done.wait(self.period_s * (1 - self.stopped))
        except ProcessLookupError:
            pass
        finally:
            try:
                os.kill(self.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        self._done.set()
        self._thread.join(5)


class CoordinatorProcess(_Child):
    """`muster serve` on `listen` (default 127.0.0.1:0) against the given etcd (none: its private
    etcd); its address is read from its log."""

    def __init__(self, etcd_endpoints: list[str], log_path: Path, extra: list[str] | None = None,
                 listen: str = "127.0.0.1:0"):
        self.log_path = log_path
        etcd = ["--etcd", ",".join(etcd_endpoints)] if etcd_endpoints else []
        self.args = [sys.executable, "-m", "muster.cli", "--log-json", "serve", *etcd,
                     "--listen", listen, *FAST, *(extra or [])]
        self.proc: subprocess.Popen | None = None
        self.address = ""

    def start(self, timeout_s: float = 20.0) -> CoordinatorProcess:
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        serving = wait_until(lambda: self.find("coordinator_serving") or self._died(), timeout_s, "coordinator start")
        self.address = serving[0]["advertise"]
        return self

    def _died(self):
        if self.proc.poll() is not None:
            raise AssertionError(f"coordinator exited with {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
        return None

    def records(self) -> list[dict]:
        return json_lines(self.log_path, None)

    def find(self, event: str, **fields) -> list[dict]:
        return [r for r in self.records() if r.get("event") == event and all(r.get(k) == v for k, v in fields.items())]

    def stop(self, timeout_s: float = 10.0) -> None:
        """Gracefully (SIGTERM: it resigns), unlike other children."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        finally:
            self._log.close()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(5)
        self._log.close()

    def leads(self, job: str) -> bool:
        """Running, and answering as the job's live leader."""
        if self.proc.poll() is not None:
            return False
        try:
            with Coordinators([self.address], timeout_s=1) as c:
                status = c.call("Status", pb.StatusRequest(job=job, brief=True)).jobs[0]
        except Exception:  # down, starting, or between lives: not leading
            return False
        return status.live and status.leader == self.address


EXAMPLE = Path(__file__).resolve().parent / "examples" / "train_ddp.py"


_RANK_IDS = itertools.count()


def rank_env(backend: str) -> dict[str, str]:
    """The environment of one more library rank on this machine, on `backend` (gloo, nccl,
    nccl-twin). NCCL refuses two ranks of one host on one GPU: a NCCL_HOSTID of its own makes each
    process a host of its own to NCCL (reached over its network transport), and the ranks take the
    visible GPUs in turn, so any number of ranks share them."""
    n = next(_RANK_IDS)
    env = {"MUSTER_BACKEND": backend, "NCCL_HOSTID": f"h{os.getpid()}-{n}"}
    if backend == "nccl":
        import torch  # here only: the rest of this module runs without it

        env["LOCAL_RANK"] = str(n % max(1, torch.cuda.device_count()))
    return env


class WarmPopen:
    """A rank forked by this process's `WarmRanks` zygote, as a `subprocess.Popen` shows a child:
    pid, returncode, poll(), wait(timeout), kill(), terminate(), send_signal()."""

    def __init__(self, rank, loop: asyncio.AbstractEventLoop, args: list[str]):
        self._rank, self._loop, self.args = rank, loop, args
        self.pid: int = rank.pid

    @property
    def returncode(self) -> int | None:
        return self._rank.returncode  # set on the zygote's loop when it reports the exit

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        waited = asyncio.run_coroutine_threadsafe(self._rank.wait(), self._loop)
        try:
            return waited.result(timeout)
        except concurrent.futures.TimeoutError:
            waited.cancel()
            raise subprocess.TimeoutExpired(self.args, timeout) from None

    def send_signal(self, sig: int) -> None:
        self._rank.send_signal(sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class WarmRanks:
    """One zygote for the library ranks this process starts (`TrainingProcess(warm=True)`), on an
    event loop of its own: forked from it, as `muster run` forks its ranks, a rank skips the
    interpreter's start and `import torch` (6 s of CPU where that import takes 3.4, most of what a
    test of a dozen ranks spends). It is also a host's zygote (`muster zygote`) at `socket_path`,
    for agents started with `--zygote-socket` (MUSTER_ZYGOTE_SOCKET); where that is set already, it
    is forked from the zygote listening there instead. Started at the first use; it
    dies with this process (the orphan guard), and its ranks with it (PDEATHSIG); the agents'
    zygotes it forked live as long as their agents. If it is lost, ranks start cold."""

    _shared: WarmRanks | None = None
    _lock = threading.Lock()

    @classmethod
    def shared(cls) -> WarmRanks:
        with cls._lock:
            if cls._shared is None:
                cls._shared = cls()
            return cls._shared

    def __init__(self):
        from muster.worker.rank import orphan_guard
        from muster.worker.rank.zygote import Zygote, ZygoteLost

        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="muster-warm-ranks", daemon=True).start()
        # Its own environment carries nothing of the caller's jobs (a rank's comes with each fork;
        # /proc/PID/environ of a forked rank shows this one).
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MUSTER_", "TORCHELASTIC_"))}
        host = os.environ.get("MUSTER_ZYGOTE_SOCKET", "")
        if host:  # forked from the host's zygote (a benchmark a test runs: its worker's), else its own
            try:
                self._zygote = self._call(Zygote.connect(host, env))
                self.socket_path = host
                return
            except (OSError, ZygoteLost):
                pass
        home = tempfile.mkdtemp(prefix="muster-zygote-")  # 0700: this user's agents only
        atexit.register(shutil.rmtree, home, ignore_errors=True)
        self.socket_path = os.path.join(home, "zygote.sock")
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as listener:
            listener.bind(self.socket_path)
            listener.listen(64)
            self._zygote = self._call(Zygote.start(env, orphan_guard.prefix(), listener=listener))

    @property
    def pid(self) -> int | None:
        """The zygote's process (None: forked by another's, the host's)."""
        return self._zygote.process.pid if self._zygote.process is not None else None

    @classmethod
    def reaped_cpu_s(cls) -> float:
        """The CPU seconds of the shared zygote's ranks that ended (0 before it started)."""
        return cls._shared._zygote.reaped_cpu_s if cls._shared is not None else 0.0

    def _call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def spawn(self, args: list[str], env: dict[str, str], out: int, cwd: str | None = None) -> WarmPopen | None:
        """`args` (this interpreter running a script or module) forked with `env`, its stdout and
        stderr on `out`, in `cwd` (this process's by default); None where it cannot be (another
        program, or the zygote is lost)."""
        from muster.worker.rank.runner import python_program
        from muster.worker.rank.zygote import ZygoteLost

        program = python_program(args)
        if program is None:
            return None
        with open(os.devnull, "rb") as stdin:
            try:
                rank = self._call(self._zygote.spawn(program, env, (stdin.fileno(), out, out), cwd=cwd))
            except ZygoteLost:
                return None
        return WarmPopen(rank, self._loop, args)


def start_child(args: list[str], env: dict[str, str] | None, out, warm: bool,
                cwd: Path | None = None) -> subprocess.Popen | WarmPopen:
    """`args` with stdout and stderr on the file `out`: forked from this process's zygote where `warm`
    and it can be (`WarmRanks.spawn`), else started as a new session."""
    if warm:
        proc = WarmRanks.shared().spawn(args, env or dict(os.environ), out.fileno(), cwd=str(cwd or os.getcwd()))
        if proc is not None:
            return proc
    return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=cwd)


class TrainingProcess(_Child):
    """One rank of `examples/train_ddp.py` (or `script`, taking --steps and --step-sleep too) under
    the worker library (no agent), logging JSON lines. `warm`: forked from this process's zygote
    (`WarmRanks`) rather than started as `python SCRIPT`; the library runs the same either way. By
    default a rank is warm where the host has a zygote (MUSTER_ZYGOTE_SOCKET), as `muster run`'s
    ranks are: a benchmark run by a test forks its ranks from the test worker's."""

    def __init__(self, coordinators: list[str], job: str, log_path: Path, *, steps: int, step_sleep_s: float = 0.05,
                 min_nodes: int = 1, max_nodes: int = 0, env: dict[str, str] | None = None, args: tuple[str, ...] = (),
                 script: Path | str = EXAMPLE, warm: bool | None = None):
        self.log_path = log_path
        self.env = {**os.environ, "MUSTER_COORDINATOR": ",".join(coordinators), "MUSTER_JOB": job,
                    "MUSTER_MIN_NODES": str(min_nodes), "MUSTER_MAX_NODES": str(max_nodes), **(env or {})}
        self.args = [sys.executable, str(script), "--steps", str(steps), "--step-sleep", str(step_sleep_s), *args]
        self.warm = bool(os.environ.get("MUSTER_ZYGOTE_SOCKET")) if warm is None else warm
        self.proc: subprocess.Popen | WarmPopen | None = None

    def start(self) -> TrainingProcess:
        with open(self.log_path, "ab") as out:
            self.proc = start_child(self.args, self.env, out, self.warm)
        return self

    def records(self, event: str | None = None) -> list[dict]:
        return json_lines(self.log_path, event)

    def steps(self) -> list[dict]:
        return self.records("step")

    @property
    def last_step(self) -> int:
        steps = self.steps()
        return steps[-1]["step"] if steps else 0


def spare_victim_survivors(ranks: list[TrainingProcess], slot: int, coordinator: str,
                           job: str) -> tuple[TrainingProcess, TrainingProcess, list[TrainingProcess]]:
    """Of a sharded job's rank processes (their step records name their mesh slot): the one spare
    (no step yet), the one stepping in `slot`, and the others. The spare is first waited for as a
    member of `job`: a fault before it joined (a slow start on a loaded host) shrinks the mesh and
    grows it again, two reforms where the caller means one."""
    with Coordinators([coordinator], timeout_s=5, retry_for_s=5) as c:  # one client for the whole wait (UNAVAILABLE: an etcd blip)
        def spares() -> list[str]:
            try:
                status = c.call("Status", pb.StatusRequest(job=job))
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:  # (not yet: no rank has joined)
                    raise
                return []
            return list(status.jobs[0].spares) if status.jobs else []
        wait_until(spares, 60, f"a spare member of job {job!r}", interval_s=0.1)
    (spare,) = [p for p in ranks if not p.steps()]
    (victim,) = [p for p in ranks if p.steps() and p.steps()[-1]["slot"] == slot]
    return spare, victim, [p for p in ranks if p not in (victim, spare)]


def kill_and_finish(victim: TrainingProcess, finishing: list[TrainingProcess], wait_s: float,
                    sig: int = signal.SIGKILL) -> tuple[int, float]:
    """Signal `victim`, then wait for every process of `finishing` to exit 0 (failing with its log's
    tail); the generation the victim last stepped in and when it was signalled (Unix seconds)."""
    generation = victim.steps()[-1]["generation"]
    at = time.time()
    victim.signal(sig)
    for p in finishing:
        assert p.wait(wait_s) == 0, p.log_path.read_text()[-3000:]
    return generation, at


def resumed_at(survivors: list[TrainingProcess], generation: int) -> float:
    """When the first of `survivors` completed a step in a generation after `generation`."""
    return min(record_time(r) for p in survivors for r in p.steps() if r["generation"] > generation)


def final_digests(ranks: list[TrainingProcess], steps: int) -> dict[int, str]:
    """Each mesh slot's state fingerprint at the last step, once every rank logged step `steps`."""
    last = [p.steps()[-1] for p in ranks]
    assert all(r["step"] == steps for r in last), last
    return {r["slot"]: r["digest"] for r in last}


def recovery_from(address: str, job: str, tier: str, timeout_s: float = 90) -> dict:
    """The job's one recovery whose state came from `tier` (RecoveryRecord.tier), as `events --json`
    shows it; asked while the run lasts (a finished run's recoveries are not kept, and a run that
    resumed may be short), every 50 ms."""
    from muster.json_output import as_json

    found: list[dict] = []
    with Coordinators([address], timeout_s=5) as c:
        def shown() -> list[dict]:
            found[:] = [r for r in as_json(c.call("Events", pb.EventsRequest(job=job)))["recoveries"]
                        if r["tier"] == tier]
            return found
        wait_until(shown, timeout_s, f"a recovery from the {tier} tier in {job}'s events", interval_s=0.05)
    (one,) = found
    return one


class AgentProcess(_Child):
    """`muster run` for one node, running the packaged src/muster/examples/train_ddp.py (or `command`) on
    its slots; each rank's output goes to log_dir/<job>/<run>/<node>-slot<K>-<start>.log. `wrap` prefixes the
    command line (e.g. `ip netns exec NS`, which execs: the PID stays the agent's). `warm`: forked from
    this process's zygote (`WarmRanks`) rather than started as `python -m muster.cli run`; by default
    where the host has a zygote (MUSTER_ZYGOTE_SOCKET) and nothing wraps the command."""

    # Shipped in the package (not read from a checkout): `muster demo` works after a pip install.
    SCRIPT = Path(__file__).resolve().parent / "examples" / "train_ddp.py"

    def __init__(self, coordinators: list[str], job: str, node_id: str, log_dir: Path, *, slots: int = 2,
                 nodes: str = "1:2", steps: int = 100, step_sleep_s: float = 0.05, host: str = "127.0.0.1",
                 command: list[str] | None = None, extra: list[str] | None = None, wrap: list[str] | None = None,
                 env: dict[str, str] | None = None, cwd: Path | None = None, warm: bool | None = None):
        self.job = job_name(job)  # the name its files are kept under (a job id maps onto one)
        self.node_id = node_id
        self.cwd = cwd  # its ranks' too (what they write to relative paths)
        self.env = {**os.environ, **env} if env else None  # the agent's, which its ranks inherit
        self.log_dir = log_dir
        self.log_path = log_dir / f"agent-{node_id}.log"
        command = command or [sys.executable, str(self.SCRIPT), "--steps", str(steps), "--step-sleep",
                              str(step_sleep_s)]
        self.args = [*(wrap or []), sys.executable, "-m", "muster.cli", "--log-json", "run",
                     "--coordinator", ",".join(coordinators), "--job", job, "--nodes", nodes, "--slots", str(slots),
                     "--node-id", node_id, "--host", host,
                     "--log-dir", str(log_dir), "--restart-backoff", "0.2", *(extra or []), "--", *command]
        # (warm: the same `muster run` without its interpreter's start and `import torch`, for its
        # TCPStore: ~2 s of CPU a node, start and exit)
        self.warm = bool(os.environ.get("MUSTER_ZYGOTE_SOCKET")) and not wrap if warm is None else warm
        self.proc: subprocess.Popen | WarmPopen | None = None

    def start(self) -> AgentProcess:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            self.proc = start_child(self.args, self.env, out, self.warm, self.cwd)
        return self

    def records(self, event: str | None = None) -> list[dict]:
        return json_lines(self.log_path, event)

    def rank_logs(self, slot: int) -> list[Path]:
        """A slot's files, of every run the node joined, oldest first."""
        return sorted(self.log_dir.glob(f"{self.job}/*/{self.node_id}-slot{slot}-*.log"),
                      key=lambda p: (int(p.parent.name), int(p.stem.rsplit("-", 1)[1])))

    def rank_records(self, slot: int, event: str | None = None, start: int = -1) -> list[dict]:
        """The JSON records of one of a slot's rank logs (by default its latest process's)."""
        logs = self.rank_logs(slot)
        return json_lines(logs[start], event) if logs else []

    def steps(self, slot: int, start: int = -1) -> list[dict]:
        return self.rank_records(slot, "step", start)

    def rank_pids(self, slot: int) -> list[int]:
        return [r["pid"] for r in self.records("rank_started") if r["slot"] == slot]


def record_time(record: dict) -> float:
    """The wall-clock time (Unix seconds) of a JSON log record."""
    return datetime.fromisoformat(record["timestamp"].replace("Z", "+00:00")).timestamp()


_RECORD = json.JSONDecoder()


def json_lines(path: Path, event: str | None = None) -> list[dict]:
    """The JSON records of a log file (other lines skipped), optionally of one event. A record may
    share its line with another thread's output: a rank's script prints its record and the newline
    in two writes, and the library's log line (the user's structlog config: console text on stdout)
    can land between them, or before the record (a CI run lost a step record so)."""
    out = []
    for line in path.read_text(errors="replace").splitlines():
        at = 0 if line.startswith("{") else line.find('{"')
        if at < 0:
            continue
        try:
            record, _ = _RECORD.raw_decode(line, at)
        except ValueError:
            continue
        if not isinstance(record, dict) or (at and "event" not in record):  # (text holding JSON: no record)
            continue
        if event is None or record.get("event") == event:
            out.append(record)
    return out


def progress_gap(records: list[dict]) -> str | None:
    """Where a rank's log breaks training progress, or None. Its completed steps follow each other,
    except that a reform may bring it forward to the step another rank completed (the state sync
    takes the highest: a survivor whose step failed adopts the peer's that completed), never
    backwards. A planned switch forms the new group inside the step's end, so its record follows
    the group's."""
    done, switched = None, False  # the step this process's state is at
    for r in records:
        if r.get("event") == "group_formed":
            if done is not None and r["step"] < done:
                return f"went back from step {done} to {r['step']}"
            done, switched = r["step"], True
        elif r.get("event") == "step":
            if done is not None and r["step"] != done + 1 and not (switched and r["step"] == done):
                return f"completed step {r['step']} after step {done}"
            done, switched = r["step"], False
    return None


class SimulatedNode:
    """A simulated node agent over the real protocol (`NodeSession`): its active ranks complete one
    step per frame. `silent = True` makes it hang (frames stop, the stream stays open)."""

    def __init__(self, addresses: list[str], job: str, node_id: str, *, slots: int = 2, spec: pb.JobSpec | None = None,
                 is_process: bool = False, interval_s: float | None = None, store_port: int = 29500,
                 security=None):
        self.session = NodeSession(
            addresses,
            NodeIdentity(job, node_id, slots, "127.0.0.1", store_port, spec or pb.JobSpec(), is_process, os.getpid()),
            reports=self._reports,
            on_directive=self._directive,
            security=security,
        )
        self.node_id = node_id
        self.interval_s = interval_s
        self.step = 0
        self.finished = False  # its ranks completed their script: they report so
        self.directives: list[pb.Directive] = []
        self.errors: list[BaseException] = []
        self._task: asyncio.Task | None = None
        self._changed = asyncio.Event()

    # the session's view, for tests
    member_id = property(lambda self: self.session.member_id)
    term = property(lambda self: self.session.term)
    generation = property(lambda self: self.session.generation)
    leader = property(lambda self: self.session.leader)

    @property
    def silent(self) -> bool:
        return self.session.paused

    @silent.setter
    def silent(self, value: bool) -> None:
        self.session.paused = value

    @property
    def exits(self) -> list[pb.RankExit]:
        return self.session.exits

    async def join(self) -> pb.JoinResponse:
        response = await self.session.join(retry_for_s=10)
        if self.interval_s:
            self.session.heartbeat_interval_s = self.interval_s
        return response

    def assignment(self) -> pb.Assignment:
        for d in reversed(self.directives):
            if d.HasField("assignment"):
                return d.assignment
        return pb.Assignment()

    def _reports(self) -> list[pb.RankReport]:
        asg = self.assignment()
        if asg.role != pb.ROLE_ACTIVE:
            # joining a running job: like an agent, start the ranks first; they report, then get a place
            return [pb.RankReport(local_rank=s, pid=10_000 + s, state=pb.RANK_STATE_STARTING)
                    for s in asg.down_local_ranks] if asg.start_ranks else []
        self.step += not self.finished
        return [pb.RankReport(local_rank=s, pid=10_000 + s, step=self.step, step_time_us=50_000,
                              state=pb.RANK_STATE_FINISHED if self.finished else pb.RANK_STATE_RUNNING)
                for s in asg.local_ranks]

    def _directive(self, d: pb.Directive) -> None:
        self.directives.append(d)
        if d.HasField("assignment"):
            a = d.assignment  # (what an agent tells its session: a rebuilt leader keeps a whole group)
            self.session.generation = d.generation
            self.session.sizes = (a.world_size, len(a.local_ranks) if a.role == pb.ROLE_ACTIVE else 0)
        self._changed.set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        try:
            await self.session.run()
        except (Evicted, JobEnded, grpc.aio.AioRpcError) as exc:
            self.errors.append(exc)

    async def wait_for(self, predicate, timeout_s: float, what: str):
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not predicate(self):
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                raise AssertionError(f"{self.node_id}: timed out waiting for {what}; last {self.assignment()}")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), min(remaining, 0.1))
            except TimeoutError:
                pass
        return self.assignment()

    async def stop(self) -> None:
        await self.session.stop()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, 5)
            except (TimeoutError, asyncio.CancelledError):
                pass
