"""The node agent behind `muster run`: one per host. It joins the job for its node, starts one
rank per slot with the environment a torchrun script expects, and supervises each rank on its
own: one rank's death is reported at once and does not stop the others (torchrun's local agent
stops every local worker when one exits; this agent replaces it). Ranks using the worker library
stream their progress over a Unix socket and reform in-process; other scripts are restarted with
the new map on every membership change. A crashed rank is restarted with backoff within a budget.
The ranks die with the agent (PR_SET_PDEATHSIG). SIGTERM (or Ctrl-C) drains the node at a step
boundary. While no coordinator answers the agent keeps its ranks (they hold, see the worker library)
for up to its hold timeout, then exits with a message.

Nothing ends in silence: every restart of a slot counts against its budget, and a slot given up is
reported with its exit code and the last lines of its stderr (kept even without --log-dir); an agent
without a place says what it waits for and gives up after --join-timeout/--form-timeout.

A job ends once. A rank whose script completed (the runner's mark, or exit 0) has finished, even if
its process then dies or hangs in interpreter teardown (ended after --exit-timeout): it is never
restarted. Once a local rank finished, or the leader says the job is finishing, no rank is restarted
and no new map restarts any: a rank that ends without completing is reported, and the node exits 1.
A library rank's replacement with no place yet then never gets one: it is ended, its slot counted
as finished (its survivors re-formed without it and completed the job).
The exit status tells the outcome (muster.worker.outcome, `muster run --help`):
  0      succeeded: every local rank completed (or the run ended succeeded)
  1      failed: a slot given up, a rank ended without completing as the job finished, the run
         failed, the coordinator refused or evicted the node, the hold timeout expired
  3      stopped: an operator stopped the job (Drain.stop, JobEnd stopped) or drained this node
  128+N  a signal N drained the node (143 after SIGTERM, 130 after Ctrl-C)
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import tempfile
from datetime import timedelta

import grpc
import structlog

from muster.net import free_port
from muster.v1 import muster_pb2 as pb
from muster.v1 import muster_pb2_grpc as pb_grpc
from muster.worker.agent.agent_config import AgentConfig
from muster.worker.agent.crash_report import exit_words
from muster.worker.agent.master_port import MasterPorts
from muster.worker.agent.membership import join, rejoin
from muster.worker.link import immediate
from muster.worker.node_session import Evicted, JobEnded, NodeIdentity, NodeSession, evicted, job_spec
from muster.worker.outcome import EXIT_FAILED, EXIT_STOPPED, EXIT_SUCCEEDED, exit_code
from muster.worker.agent.slot import Slot, crash_answered, process_state
from muster.worker.agent.rank_hub import RankHub
from muster.worker.agent.supervisor import RankSupervisor, say
from muster.worker.agent.watchdogs import watch_coordinator, watch_place
from muster.worker.store import serve_soon

log = structlog.get_logger(__name__)


class NodeAgent:
    def __init__(self, config: AgentConfig):
        self.config = config
        self.slots = [Slot(i) for i in range(config.slots)]
        self.assignment: pb.Assignment | None = None
        self.base: pb.Assignment | None = None  # the newest map formed at once (an abort, a first map)
        self.drain: pb.Drain | None = None
        self.library = False  # some rank of this node uses the worker library
        self.draining = False
        self._leaving = False  # every local slot is retired: the node leaves (once)
        self.session: NodeSession | None = None
        self.ranks: RankSupervisor | None = None  # the rank processes, once the agent runs
        self.hub = RankHub(self)  # the library ranks' streams, and the node's frame
        self._done: asyncio.Future | None = None
        self.reconciling = asyncio.Lock()
        self._signal = 0  # the signal that ends the agent (SIGTERM, SIGINT): exit 128 + it
        self.masters = MasterPorts(config.host, library=lambda: self.library, assignment=lambda: self.assignment,
                                   ended=self.done,
                                   planted=self._store_key_planted)
        self.log = log.bind(job=config.job, node=config.node_id)

    # ---- lifecycle -------------------------------------------------------------------

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self._done = loop.create_future()
        c = self.config
        store_port, self.masters.store = serve_soon(c.host, timedelta(seconds=300))  # it outlives the node's ranks
        master_port = free_port(c.host)
        _remove_stale_socket_dirs()
        sockets = tempfile.mkdtemp(prefix=f"{SOCKET_DIR_PREFIX}{os.getpid()}-")
        socket_path = os.path.join(sockets, "ranks.sock")
        self.ranks = RankSupervisor(self, sockets, socket_path)
        await self.ranks.start_zygote()
        server = grpc.aio.server()
        pb_grpc.add_NodeAgentServicer_to_server(self.hub, server)
        server.add_insecure_port(f"unix:{socket_path}")
        await server.start()
        spec = job_spec(*(c.nodes or (0, 0)), c.world_size_multiple, c.stragglers, c.on_state_lost)
        self.session = NodeSession(
            c.coordinators,
            NodeIdentity(c.job, c.node_id, c.slots, c.host, store_port, spec, agent_pid=os.getpid(),
                         master_port=master_port),
            reports=self.hub.reports,
            on_directive=self._on_directive,
            security=c.security,
        )
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        if c.job_id and c.job_id != c.job:
            self.log.info("job_name_mapped", job_id=c.job_id, message=f"job id {c.job_id!r} is job {c.job!r} at "
                          "the coordinator (its job names are 1-63 of [a-z0-9._-])")
        streaming = watchdogs = None
        try:
            joining = asyncio.ensure_future(join(self))
            await asyncio.wait([joining, self._done], return_when=asyncio.FIRST_COMPLETED)
            if not joining.done():
                joining.cancel()  # a signal while joining
            elif joining.result():
                streaming = asyncio.create_task(self._stream())
                watchdogs = [asyncio.create_task(watch_coordinator(self)), asyncio.create_task(watch_place(self)),
                             asyncio.create_task(self.ranks.watch_library_ranks())]
            return await self._done
        finally:
            for task in watchdogs or ():
                task.cancel()
            for slot in self.slots:
                await self.ranks.stop(slot, grace_s=2.0)
            self.ranks.close()
            await self.session.stop()
            if streaming is not None:
                await asyncio.wait([streaming], timeout=5)
            await server.stop(grace=0.5)
            shutil.rmtree(sockets, ignore_errors=True)
            self.log.info("agent_stopped", code=self._done.result() if self._done.done() else None)

    def _on_signal(self, sig: int) -> None:
        """The first SIGTERM/SIGINT drains the node (a planned leave); a second one stops it now.
        Either way the agent exits 128 + the signal (130 after Ctrl-C, 143 after SIGTERM), as a shell
        reports a process ended by it: non-zero like torchrun's exit, so a scheduler never counts a
        drained node as done."""
        name = signal.Signals(sig).name
        if self._signal or not self.session.member_id or self._done.done():
            self._signal = self._signal or sig
            say(f"{name}: stopping node {self.config.node_id!r} now")
            self.finish(128 + self._signal)
            return
        self._signal = sig
        say(f"{name}: draining node {self.config.node_id!r} at a step boundary ({name} again stops it at once)")
        asyncio.ensure_future(self._drain_node())

    async def _stream(self) -> None:
        rejoins = 0  # in a row, none heard as a member since
        while True:
            try:
                await self.session.run()
                return
            except JobEnded as exc:  # the run ended (succeeded, failed, stopped): its ranks stop with the agent
                end = exc.end
                # a node draining on a signal ends the run itself when it is the last: its exit says the signal
                code = 128 + self._signal if self._signal else exit_code(end.outcome)
                self.log.info("job_ended", run=end.run, outcome=end.outcome, reason=end.reason, code=code)
                say(f"job {self.config.job!r} (run {end.run}) ended: {end.outcome}"
                    + (f" ({end.reason})" if end.reason else "") + f"; node {self.config.node_id!r} exits {code}")
                self.finish(code)
                return
            except Evicted as exc:
                if self.drain is not None:  # its leave was planned: gone from the job as ordered, not evicted
                    self.log.info("drain_left", reason=str(exc))  # _drain_node exits once its ranks are done
                    return
                rejoins = 0 if self.session.heard_as_member else rejoins + 1
                if not await rejoin(self, exc, rejoins):
                    return
            except grpc.aio.AioRpcError as exc:
                self.log.error("coordinator_refused", code=exc.code().name, details=exc.details())
                self.finish(EXIT_FAILED)
                return
            except Exception:  # a bug must not leave the node joined and silent until the hold timeout
                self.log.exception("stream_failed")
                self.finish(EXIT_FAILED)
                return

    def _store_key_planted(self, generation: int, exc: Exception) -> None:
        """Rank 0's key of a generation was there before it published: the node stops, loudly."""
        self.log.error("store_key_planted", generation=generation, error=str(exc))
        say(f"generation {generation}: {exc}; stopping this node")
        self.finish(EXIT_FAILED)

    def done(self) -> bool:
        """The agent has its exit code: it is stopping."""
        return self._done is not None and self._done.done()

    def finish(self, code: int) -> None:
        if not self._done.done():
            self._done.set_result(code)

    # ---- directives ------------------------------------------------------------------

    def _on_directive(self, d: pb.Directive) -> None:
        if evicted(d) is not None:
            return  # the session raises Evicted next: the node joins again or ends (_stream), its ranks held
        self.hub.deliver(d)
        if d.HasField("end"):
            return  # the session ends with JobEnded: _stream exits with the outcome
        if d.HasField("drain"):
            self.drain = d.drain
            if not self.draining:  # not the answer to this node's own leave: an operator's stop or drain
                asyncio.ensure_future(self._drain_node(d.drain))
            return
        a = d.assignment
        if self.assignment is not None and a.generation < self.assignment.generation:
            return
        self.assignment = a
        if immediate(a):
            self.base = a
        self.session.generation = a.generation
        self.session.sizes = (a.world_size, len(a.local_ranks) if a.role == pb.ROLE_ACTIVE else 0)
        for slot in self.slots:
            if slot.failed_pid and slot.connected and crash_answered(a, slot):
                slot.failed_pid = 0  # its replacement speaks for the slot from now on
        if a.start_ranks:
            self.library = True  # the leader asks for it only when the job's ranks use the library
        else:
            for slot in self.slots:
                slot.kept_pid = 0  # placed: a slot listed down from now on is a failure (rank_hub)
        if not self.draining and not self.finishing():  # a finishing job is never re-formed
            if a.role == pb.ROLE_ACTIVE and not self.library:
                asyncio.ensure_future(self.masters.of(a))  # published (or fetched) at once
            asyncio.ensure_future(self._reconcile())

    def finishing(self) -> bool:
        """The job is ending: a local rank finished its script, or the leader says one did. From
        then on no rank is restarted, for a crash or a new map: it would run the script again."""
        return self.session.finishing or any(s.finished for s in self.slots)

    async def _reconcile(self) -> None:
        """Bring the local ranks in line with the newest assignment."""
        async with self.reconciling:
            # Once a warm start forks at once (the zygote's first imports take seconds): the map read
            # below is then current as the ranks fork, not one a node that joined meanwhile replaced.
            if self.ranks.warm is not None:
                await self.ranks.warm.ready()
            a = self.assignment
            # A node joining a running job starts its ranks before it has a place (start_ranks).
            wanted = set(a.local_ranks) if a.role == pb.ROLE_ACTIVE else set(a.down_local_ranks) if a.start_ranks else set()
            # Before stopping anything: the node of rank 0 publishes the generation's port at once.
            master = await self.masters.of(a) if wanted else None
            for slot in self.slots:
                if slot.retired:
                    continue
                if slot.alive and not self.library and slot.generation != a.generation:
                    # Restart semantics for scripts without the library: the new map means new ranks,
                    # at once (a stale rank 0 would serve an outdated env:// store). Until one of its
                    # ranks reaches the socket the node cannot tell a library rank that is still
                    # importing, so that one is restarted too: it costs a start, never correctness.
                    await self.ranks.stop(slot)
                # A first start, one the agent stopped itself, or one parked without a place; crashes
                # restart in the supervisor, with backoff. Only a slot's own crashes spend its
                # budget: a restart for a map that others' changes made is not charged.
                if not slot.alive and slot.index in wanted and (slot.starts == 0 or slot.stopping or slot.parked):
                    if self.assignment is not a:
                        return  # a newer map came meanwhile: its own reconcile starts the ranks
                    await self.ranks.start(slot, master)

    # ---- leaving ---------------------------------------------------------------------

    async def settle(self) -> None:
        """Once every local slot is retired and its process gone: leave, and exit with the node's
        outcome. A node whose ranks finished leaves as finished (a rank lost meanwhile is in the exit
        reports: the leader records the failure); one with a slot given up does not."""
        if self.draining or self._leaving or self._done.done() or not all(s.retired and not s.alive for s in self.slots):
            return
        self._leaving = True
        given_up = any(s.given_up for s in self.slots)
        # A node giving up leaves now, not at a step boundary like a drain: the leader must not take
        # the job's last node going for an operator's drain (the run ended "stopped", and this agent
        # exited 3 when that news beat its own verdict).
        if all(s.finished for s in self.slots):
            reason = "every local rank completed"
        elif all(s.finished or s.outrun for s in self.slots):
            outrun = ", ".join(str(s.index) for s in self.slots if s.outrun)
            reason = ("every local rank completed, or was a replacement with no place yet as the job finished "
                      f"(slot(s) {outrun})")
        else:
            reason = "every local slot finished, ended or was given up"
        await self._leave(reason, finished=not given_up and any(s.finished or s.outrun for s in self.slots),
                          immediate=given_up)

    async def _leave(self, reason: str, *, finished: bool, immediate: bool = False) -> None:
        try:
            await self.session.leave(reason=reason, finished=finished, immediate=immediate)
        except Exception as exc:  # the coordinator will see the node go silent instead
            self.log.warning("leave_failed", error=str(exc))
        c = self.config
        given_up = [s for s in self.slots if s.given_up]
        if given_up:
            say(f"node {c.node_id!r} of job {c.job!r} gives up: "
                 + ", ".join(f"slot {s.index} ({exit_words(s.last_crash.code) + ', ' if s.last_crash else ''}"
                             f"{s.restarts} restart(s))" for s in given_up)
                 + "; the report of each is above")
        lost = [s for s in self.slots if s.failed]
        if lost:
            say(f"node {c.node_id!r} of job {c.job!r} failed: "
                 + ", ".join(f"{s.named} ended ({exit_words(s.last_crash.code) if s.last_crash else 'exited'}) "
                             "without completing its script" for s in lost)
                 + " as the job was finishing (not restarted: that would run the script again)")
        self.finish(EXIT_FAILED if given_up or lost else EXIT_SUCCEEDED)

    async def _drain_node(self, order: pb.Drain | None = None) -> None:
        """Leave at a step boundary: on SIGTERM or SIGINT (exit 128 + the signal), or on the
        coordinator's order (an operator stopped the job, or drained this node: exit 3), which has
        planned the leave already. Library ranks get the Drain directive and stop after its step;
        other ranks are terminated now."""
        if self.draining or self._done.done():
            return
        self.draining = True
        self.log.info("drain_started", ordered=order is not None, stop=order.stop if order else None)
        if order is None:
            try:
                response = await self.session.leave(reason=f"drain ({signal.Signals(self._signal).name})")
                self.log.info("drain_planned", after_step=response.switch_at_step, generation=response.generation)
            except Exception as exc:
                self.log.warning("leave_failed", error=str(exc))
        else:
            what = "stopped by an operator" if order.stop else "drained by the coordinator"
            say(f"node {self.config.node_id!r} of job {self.config.job!r} {what}: {order.reason or 'no reason given'}"
                 f" (after step {order.after_step})")
        for slot in self.slots:
            if slot.alive and not slot.connected:
                await self.ranks.stop(slot)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.drain_timeout_s
        while any(s.alive for s in self.slots) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        code = EXIT_STOPPED if order is not None else 128 + self._signal
        self.log.info("drained", code=code)
        self.finish(code)


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
            if not pid.isdigit() or os.stat(path).st_uid != os.getuid() or process_state(int(pid)) is not None:
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        log.info("stale_socket_dir_removed", path=path)


