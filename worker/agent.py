"""The node agent behind `muster run`: one per host. It joins the job for its node, starts one
rank per slot with the environment a torchrun script expects, and supervises each rank on its
own: one rank's death is reported at once and does not stop the others (torchrun's local agent
stops every local worker when one exits; this agent replaces it). Ranks using the worker library
stream their progress over a Unix socket and reform in-process; other scripts are restarted with
the new map on every membership change. A crashed rank is restarted with backoff within a budget.
The ranks die with the agent (PR_SET_PDEATHSIG). SIGTERM drains the node at a step boundary.
While no coordinator answers the agent keeps its ranks (they hold, see the worker library) for up
to its hold timeout, then exits with a message.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import structlog

from muster.coordinator.auth import ClientSecurity
from muster.coordinator.etcd_server import free_port
from muster.v1 import muster_pb2 as pb
from muster.v1 import muster_pb2_grpc as pb_grpc
from muster.worker.node_session import Evicted, NodeIdentity, NodeSession

log = structlog.get_logger(__name__)

@dataclass(frozen=True)
class AgentConfig:
    coordinators: tuple[str, ...]
    job: str
    node_id: str
    slots: int
    argv: tuple[str, ...]  # what runs on each slot
    host: str = "127.0.0.1"  # the address other nodes reach this node at
    nodes: tuple[int, int] | None = None  # (min, max) nodes when this agent creates the job
    world_size_multiple: int = 0
    max_restarts: int = 3  # per slot; beyond it the slot is given up
    restart_backoff_s: float = 1.0  # doubled on each restart of a slot
    log_dir: Path | None = None  # each rank's output to LOG_DIR/<node>-slot<K>-<n>.log
    drain_timeout_s: float = 120.0
    hold_timeout_s: float = 300.0  # no coordinator heard for this long: give up (the ranks with the agent)
    env: dict[str, str] = field(default_factory=dict)
    security: ClientSecurity = field(default_factory=ClientSecurity.from_env)  # token, TLS


@dataclass(eq=False)
class Slot:
    index: int
    proc: asyncio.subprocess.Process | None = None
    starts: int = 0
    restarts: int = 0
    finished: bool = False  # exited 0
    given_up: bool = False  # crash-looped past the budget
    generation: int = 0  # the generation its process was started for
    stopping: bool = False  # the agent is ending this process on purpose
    failed_pid: int = 0
    crashed_in: int = 0  # the generation its last process crashed in: a replacement is no member of it
    report: pb.RankReport | None = None  # last report of a library rank over the socket
    heard_at: float = 0.0
    connected: bool = False

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None


class NodeAgent:
    def __init__(self, config: AgentConfig):
        self.config = config
        self.slots = [Slot(i) for i in range(config.slots)]
        self.assignment: pb.Assignment | None = None
        self.drain: pb.Drain | None = None
        self.library = False  # some rank of this node uses the worker library
        self.draining = False
        self.session: NodeSession | None = None
        self.socket_path = ""
        self._queues: dict[asyncio.Queue, Slot] = {}  # each connected library rank's directives
        self._done: asyncio.Future | None = None
        self._reconciling = asyncio.Lock()
        self.log = log.bind(job=config.job, node=config.node_id)

    # ---- lifecycle -------------------------------------------------------------------

    async def run(self) -> int:
        import torch.distributed as dist  # the node's store outlives its ranks

        loop = asyncio.get_running_loop()
        self._done = loop.create_future()
        c = self.config
        store = dist.TCPStore(c.host, 0, is_master=True, wait_for_workers=False)
        master_port = free_port(c.host)
        _remove_stale_socket_dirs()
        sockets = tempfile.mkdtemp(prefix=f"{SOCKET_DIR_PREFIX}{os.getpid()}-")
        self.socket_path = os.path.join(sockets, "ranks.sock")
        server = grpc.aio.server()
        pb_grpc.add_NodeAgentServicer_to_server(_RankSessions(self), server)
        server.add_insecure_port(f"unix:{self.socket_path}")
        await server.start()
        spec = pb.JobSpec(min_nodes=c.nodes[0] if c.nodes else 0, max_nodes=c.nodes[1] if c.nodes else 0,
                          world_size_multiple=c.world_size_multiple)
        self.session = NodeSession(
            c.coordinators,
            NodeIdentity(c.job, c.node_id, c.slots, c.host, store.port, spec, agent_pid=os.getpid(),
                         master_port=master_port),
            reports=self._reports,
            on_directive=self._on_directive,
            security=c.security,
        )
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(self._drain_node()))
        streaming = watchdog = None
        try:
            await self.session.join()
            streaming = asyncio.create_task(self._stream())
            watchdog = asyncio.create_task(self._watch_coordinator())
            return await self._done
        finally:
            if watchdog is not None:
                watchdog.cancel()
            for slot in self.slots:
                await self._stop_rank(slot, grace_s=2.0)
            await self.session.stop()
            if streaming is not None:
                await asyncio.wait([streaming], timeout=5)
            await server.stop(grace=0.5)
            for path in (self.socket_path, sockets):
                try:
                    os.remove(path) if path == self.socket_path else os.rmdir(path)
                except OSError:
                    pass
            self.log.info("agent_stopped")

    async def _stream(self) -> None:
        try:
            await self.session.run()
        except Evicted as exc:
            self.log.error("node_evicted", reason=str(exc))
            self._finish(1)
        except grpc.aio.AioRpcError as exc:
            self.log.error("coordinator_refused", code=exc.code().name, details=exc.details())
            self._finish(1)

    async def _watch_coordinator(self) -> None:
        """Hold while no coordinator answers (an etcd or coordinator outage must not cost the ranks),
        but not forever: past the hold timeout the agent exits, and its ranks with it."""
        warned = False
        while not self._done.done():
            await asyncio.sleep(1.0)
            silent_s = self.session.silent_s()
            if silent_s > 2 * self.session.heartbeat_timeout_s and not warned:
                warned = True
                self.log.warning("coordinator_unreachable", silent_s=round(silent_s, 1),
                                 hold_timeout_s=self.config.hold_timeout_s, coordinators=list(self.config.coordinators))
            elif silent_s <= self.session.heartbeat_timeout_s and warned:
                warned = False
                self.log.info("coordinator_reachable")
            if silent_s > self.config.hold_timeout_s:
                self.log.error("hold_expired", silent_s=round(silent_s, 1), hold_timeout_s=self.config.hold_timeout_s,
                               message=f"no coordinator answered for {silent_s:.0f}s; giving up with the ranks")
                self._finish(1)

    def _finish(self, code: int) -> None:
        if not self._done.done():
            self._done.set_result(code)

    # ---- directives ------------------------------------------------------------------

    def _on_directive(self, d: pb.Directive) -> None:
        for q, slot in self._queues.items():
            if _for_rank(d, slot):
                q.put_nowait(d)
        if d.HasField("drain"):
            self.drain = d.drain
            return
        a = d.assignment
        if self.assignment is not None and a.generation < self.assignment.generation:
            return
        self.assignment = a
        self.session.generation = a.generation
        if a.start_ranks:
            self.library = True  # the leader asks for it only when the job's ranks use the library
        if a.role == pb.ROLE_EVICTED:
            self.log.error("node_evicted", reason=a.reason)
            self._finish(1)
            return
        if not self.draining:
            asyncio.ensure_future(self._reconcile())

    async def _reconcile(self) -> None:
        """Bring the local ranks in line with the newest assignment."""
        async with self._reconciling:
            a = self.assignment
            # A node joining a running job starts its ranks before it has a place (start_ranks).
            wanted = set(a.local_ranks) if a.role == pb.ROLE_ACTIVE else set(a.down_local_ranks) if a.start_ranks else set()
            for slot in self.slots:
                if slot.finished or slot.given_up:
                    continue
                if slot.alive and not self.library and slot.generation != a.generation:
                    # Restart semantics for scripts without the library: the new map means new ranks,
                    # at once (a stale rank 0 would serve an outdated env:// store). Until one of its
                    # ranks reaches the socket the node cannot tell a library rank that is still
                    # importing, so that one is restarted too: it costs a start, never correctness.
                    await self._stop_rank(slot)
                # A first start, or one the agent stopped itself; crashes restart in _watch_rank,
                # with backoff and within the budget.
                if not slot.alive and slot.index in wanted and (slot.starts == 0 or slot.stopping):
                    await self._start_rank(slot)

    # ---- ranks -----------------------------------------------------------------------

    def _rank_env(self, slot: Slot) -> dict[str, str]:
        a = self.assignment
        c = self.config
        env = {**os.environ, **c.env, "LOCAL_RANK": str(slot.index), "MUSTER_AGENT_SOCKET": self.socket_path,
               "MUSTER_JOB": c.job, "MUSTER_NODE_ID": c.node_id, "MUSTER_HOST": c.host,
               "MUSTER_GENERATION": str(a.generation), "TORCHELASTIC_RUN_ID": c.job,
               "MUSTER_HOLD_TIMEOUT": str(c.hold_timeout_s),
               "TORCHELASTIC_RESTART_COUNT": str(a.generation), "TORCHELASTIC_MAX_RESTARTS": str(c.max_restarts),
               "LOCAL_WORLD_SIZE": str(a.local_world_size), "WORLD_SIZE": str(a.world_size),
               "GROUP_RANK": str(a.node_rank), "GROUP_WORLD_SIZE": str(a.num_nodes),
               "ROLE_WORLD_SIZE": str(a.world_size), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        if slot.index in a.local_ranks:
            rank = str(a.rank_offset + list(a.local_ranks).index(slot.index))
            env.update(RANK=rank, ROLE_RANK=rank, GROUP_RANK=str(a.node_rank))
        if a.master_address:
            host, _, port = a.master_address.rpartition(":")
            env.update(MASTER_ADDR=host.strip("[]"), MASTER_PORT=port)
        return env

    async def _start_rank(self, slot: Slot) -> None:
        c = self.config
        slot.starts += 1
        out = None
        if c.log_dir is not None:
            c.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(c.log_dir / f"{c.node_id}-slot{slot.index}-{slot.starts}.log", "ab")
        # Ranks die with the agent, even on SIGKILL (see orphan_guard).
        guard = [sys.executable, "-m", "muster.worker.orphan_guard", str(os.getpid())]
        slot.proc = await asyncio.create_subprocess_exec(
            *guard, *c.argv, env=self._rank_env(slot), stdout=out, stderr=asyncio.subprocess.STDOUT if out else None)
        if out is not None:
            out.close()
        slot.generation = self.assignment.generation
        slot.stopping = False
        slot.connected = False
        slot.report = None
        self.log.info("rank_started", slot=slot.index, pid=slot.proc.pid, generation=slot.generation,
                      start=slot.starts)
        asyncio.ensure_future(self._watch_rank(slot, slot.proc))

    async def _watch_rank(self, slot: Slot, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        if slot.stopping or proc is not slot.proc:
            return
        self.log.info("rank_exited", slot=slot.index, pid=proc.pid, code=code)
        slot.connected = False
        if code == 0:  # finished: the job is ending (the ranks of a job finish together); not a failure
            slot.finished = True
            if all(s.finished or s.given_up for s in self.slots):
                await self._leave("all local ranks finished", finished=True)
            return
        slot.failed_pid = proc.pid  # reported exited until a replacement speaks for the slot
        slot.crashed_in = self.assignment.generation if self.assignment else 0
        self.session.exits.append(pb.RankExit(local_rank=slot.index, pid=proc.pid, exit_code=code))
        self.session.send_now()  # the leader hears of it within milliseconds
        if self.draining:
            return
        if slot.restarts >= self.config.max_restarts:
            slot.given_up = True
            self.log.error("slot_given_up", slot=slot.index, restarts=slot.restarts, last_code=code)
            if all(s.finished or s.given_up for s in self.slots):
                await self._leave("every local slot finished or was given up", finished=False)  # exits 1
            return
        slot.restarts += 1
        delay = self.config.restart_backoff_s * 2 ** (slot.restarts - 1)
        self.log.info("rank_restart_scheduled", slot=slot.index, in_s=delay, restart=slot.restarts)
        await asyncio.sleep(delay)
        if not self.draining and not self._done.done() and not slot.alive:
            # a library rank rejoins at a step boundary; a plain one is restarted again with its new map
            async with self._reconciling:
                await self._start_rank(slot)

    async def _stop_rank(self, slot: Slot, grace_s: float = 5.0) -> None:
        proc = slot.proc
        if proc is None or proc.returncode is not None:
            return
        slot.stopping = True
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), grace_s)
        except TimeoutError:
            proc.kill()
            await proc.wait()

    # ---- aggregation -----------------------------------------------------------------

    def _reports(self) -> list[pb.RankReport]:
        now = asyncio.get_running_loop().time()
        a = self.assignment
        if a is not None and a.start_ranks and not all(
                self.slots[s].connected for s in a.down_local_ranks if not (self.slots[s].given_up or self.slots[s].finished)):
            return []  # starting: report the node's ranks together, so they enter the map in one generation
        reports = []
        for slot in self.slots:
            if slot.finished:
                continue  # done: neither a failure nor a rank to watch
            if slot.connected and slot.report is not None:
                r = pb.RankReport()
                r.CopyFrom(slot.report)
                if _runnable(slot.proc.pid):
                    # Its process runs: a rank whose Python thread is held off the GIL by a long C++
                    # call (NCCL init or abort, a long kernel) is not silent; a deadlock shows as a stall.
                    slot.heard_at = now
                r.heard_ms_ago = int((now - slot.heard_at) * 1000)
                reports.append(r)
            elif slot.alive and not self.library:
                reports.append(pb.RankReport(local_rank=slot.index, pid=slot.proc.pid,
                                             state=pb.RANK_STATE_UNMONITORED))
            elif slot.failed_pid and not slot.stopping:  # crashed, or its replacement is not connected yet
                reports.append(pb.RankReport(local_rank=slot.index, pid=slot.failed_pid, state=pb.RANK_STATE_EXITED))
        return reports

    # ---- leaving ---------------------------------------------------------------------

    async def _leave(self, reason: str, *, finished: bool) -> None:
        try:
            await self.session.leave(reason=reason, finished=finished)
        except Exception as exc:  # the coordinator will see the node go silent instead
            self.log.warning("leave_failed", error=str(exc))
        self._finish(1 if any(s.given_up for s in self.slots) else 0)

    async def _drain_node(self) -> None:
        """SIGTERM: leave at a step boundary. Library ranks get the Drain directive and stop
        after its step; other ranks are terminated now."""
        if self.draining or self._done.done():
            return
        self.draining = True
        self.log.info("drain_started")
        try:
            response = await self.session.leave(reason="drain (SIGTERM)")
            self.log.info("drain_planned", after_step=response.switch_at_step, generation=response.generation)
        except Exception as exc:
            self.log.warning("leave_failed", error=str(exc))
        for slot in self.slots:
            if slot.alive and not slot.connected:
                await self._stop_rank(slot)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.drain_timeout_s
        while any(s.alive for s in self.slots) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        self._finish(0)


class _RankSessions(pb_grpc.NodeAgentServicer):
    """The agent's side of each library rank's stream."""

    def __init__(self, agent: NodeAgent):
        self.agent = agent

    async def RankSession(self, request_iterator, context):
        agent = self.agent
        first = await anext(request_iterator, None)
        if first is None or first.local_rank >= len(agent.slots):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "first report must name a local_rank of this node")
        slot = agent.slots[first.local_rank]
        if not slot.alive or slot.proc.pid != first.pid:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"pid {first.pid} is not the process of slot {first.local_rank}")
        loop = asyncio.get_running_loop()
        slot.report, slot.heard_at, slot.connected = first, loop.time(), True
        slot.failed_pid = 0  # the replacement speaks for the slot now
        agent.library = True
        queue: asyncio.Queue = asyncio.Queue()
        if agent.assignment is not None:
            current = pb.Directive(term=agent.session.term, generation=agent.assignment.generation,
                                   assignment=agent.assignment)
            if _for_rank(current, slot):
                queue.put_nowait(current)
        if agent.drain is not None:
            queue.put_nowait(pb.Directive(term=agent.session.term, drain=agent.drain))
        agent._queues[queue] = slot

        async def read():
            async for report in request_iterator:
                slot.report, slot.heard_at = report, loop.time()

        reader = asyncio.create_task(read())
        try:
            while not reader.done():
                getter = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait([getter, reader], return_when=asyncio.FIRST_COMPLETED)
                if getter in done:
                    yield getter.result()
                else:
                    getter.cancel()
        finally:
            reader.cancel()
            agent._queues.pop(queue, None)
            if slot.report is not None and slot.report.pid == first.pid:
                slot.connected = False


def _for_rank(d: pb.Directive, slot: Slot) -> bool:
    """A replacement process is no member of the generation its predecessor crashed in (nor of an
    older one): while no coordinator has answered the crash (an outage), it waits for a newer one
    instead of trying to join a group whose others have long formed."""
    return not d.HasField("assignment") or d.assignment.generation > slot.crashed_in


def _runnable(pid: int) -> bool:
    """The process exists and is neither stopped (SIGSTOP, a debugger) nor a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("T", "t", "Z", "X")


SOCKET_DIR_PREFIX = "muster-agent-"


def _remove_stale_socket_dirs() -> None:
    """The socket directories of agents that were SIGKILLed (their pid is in the name): nothing
    else removes them."""
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        if not name.startswith(SOCKET_DIR_PREFIX):
            continue
        pid = name[len(SOCKET_DIR_PREFIX):].split("-", 1)[0]
        path = os.path.join(root, name)
        try:
            if not pid.isdigit() or os.stat(path).st_uid != os.getuid() or _pid_alive(int(pid)):
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        log.info("stale_socket_dir_removed", path=path)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's
    return True
