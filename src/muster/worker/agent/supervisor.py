"""The node's rank processes, one per slot, each on its own: started with the environment a
torchrun script expects (from the current map only), cold through the orphan guard or forked warm
from the node's zygote; watched for its exit and for its script's completion (the runner's mark);
restarted within the slot's budget, with backoff in a crash loop, or given up with a report. A
rank that finished is never started again."""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Protocol

import structlog

from muster import rank_logs
from muster.v1 import muster_pb2 as pb
from muster.worker.rank import orphan_guard
from muster.worker.agent.agent_config import AgentConfig
from muster.worker.agent.crash_report import exit_words, failure_report
from muster.worker.rank.group_end import ENDED_SUFFIX, EndedFile
from muster.worker.agent.master_port import MasterPorts
from muster.worker.node_session import NodeSession
from muster.worker.agent.rank_env import base_env, rank_env
from muster.worker.rank.runner import python_program, runner_argv
from muster.worker.agent.slot import (Slot, StderrTail, crash_answered, crash_of, dying_signal, exit_of,
                                      outside_crash_loop)
from muster.worker.rank.step_probe import StepFile
from muster.worker.rank.zygote import WarmProcess, WarmStarts, ZygoteLost

log = structlog.get_logger(__name__)

COMPLETION_POLL_S = 0.1  # how often a running rank's completion mark is looked for (a stat)
DYING_POLL_S = 0.02  # how often a library rank is looked at for a kill under way (a read of its /proc stat)
EXIT_KILL_GRACE_S = 5.0  # after SIGTERM, before SIGKILL, for a rank hung in teardown
RESTART_ANSWER_WAIT_S = 10.0  # for the leader's answer to a crash: a rank restarted in place, or in a crash loop


class Node(Protocol):
    """What the supervisor needs of its node agent."""

    config: AgentConfig
    slots: list[Slot]
    assignment: pb.Assignment | None
    base: pb.Assignment | None  # the newest map formed at once (an abort, a first map)
    library: bool  # some rank of this node uses the worker library
    draining: bool
    drain: pb.Drain | None  # the leader's order to leave, once given
    session: NodeSession
    masters: MasterPorts
    reconciling: asyncio.Lock  # held while the ranks are brought in line with a map
    log: structlog.stdlib.BoundLogger  # bound to the job and the node

    def finishing(self) -> bool: ...

    def done(self) -> bool: ...

    def finish(self, code: int) -> None:
        """The agent ends with this exit code (the first one set wins)."""

    async def settle(self) -> None:
        """Every local slot retired and its process gone: the node leaves with its outcome."""


class RankSupervisor:
    def __init__(self, node: Node, files: str, socket_path: str):
        self.node = node
        self.files = files  # the agent's private directory: the ranks' error and completion files
        self.socket_path = socket_path  # the agent's socket, where library ranks stream their progress
        # Python programs run through the runner, which marks their completion; others as they are.
        self.program = python_program(node.config.argv)
        self.argv = runner_argv(self.program) if self.program is not None else list(node.config.argv)
        self.warm: WarmStarts | None = None

    @property
    def log(self):
        return self.node.log

    async def start_zygote(self) -> None:
        """Warm starts: the zygote's imports run while the node joins."""
        c = self.node.config
        if c.warm_start and self.program is not None:
            self.warm = WarmStarts(base_env(c), orphan_guard.prefix(), c.preload, c.host_zygote)
            await self.warm.start()

    def close(self) -> None:
        if self.warm is not None:
            self.warm.close()

    def placed(self, slot: Slot) -> bool:
        """The slot has a rank in the current map."""
        a = self.node.assignment
        return a is not None and a.role == pb.ROLE_ACTIVE and slot.index in a.local_ranks

    async def start_placed(self, slot: Slot) -> None:
        """Start the slot's next process, under the reconcile lock, where the map gives it a rank: a
        script without the library started with no place would fail on its missing RANK and burn
        the slot's budget while the job waits. Parked, it starts with the map that places it."""
        # The master first: a map that comes while its port is looked up (the job fell below its
        # minimum) decides the place, and `start` reads the map with no wait in between.
        master = await self.node.masters.current()
        if not self.node.library and not self.placed(slot):
            slot.parked = True
            self.log.info("rank_parked", slot=slot.index, generation=self.node.assignment.generation,
                          message="no place in this generation: started again when a map places it")
            return
        await self.start(slot, master)

    async def start(self, slot: Slot, master: tuple[str, str] | None = None) -> None:
        c = self.node.config
        slot.restarts += 1 if slot.starts else 0
        slot.starts += 1
        slot.parked = False
        slot.secret = secrets.token_hex(16)  # its process's alone: what it presents on the agent's socket
        slot.error_file = os.path.join(self.files, f"error-slot{slot.index}-{slot.starts}.json")
        if self.program is not None:  # the runner marks its completion there
            slot.completed_file = os.path.join(self.files, f"completed-slot{slot.index}-{slot.starts}")
        # and, for warm starts, says which packages it imported: later starts fork with them loaded
        slot.imports_file = os.path.join(self.files, f"imports-slot{slot.index}-{slot.starts}") if self.warm else ""
        slot.steps = StepFile(os.path.join(self.files, f"steps-slot{slot.index}-{slot.starts}")) \
            if self.program is not None and c.step_probe and not self.node.library else None
        env = rank_env(c, self.node.assignment, slot, master, library=self.node.library,
                       socket_path=self.socket_path, files=self.files)
        generation = self.node.assignment.generation  # the map its environment is from (a newer may come below)
        slot.rank = int(env["RANK"]) if "RANK" in env else None
        out = err = None
        slot.log_path = slot.stderr = None
        if c.log_dir is not None:  # in its run's directory, made at the Join (a rank starts after it)
            run = rank_logs.run_dir(c.log_dir, c.job, self.node.session.joined_run)
            slot.log_path = rank_logs.slot_log(run, c.node_id, slot.index, slot.starts)
            out = rank_logs.open_log(slot.log_path)
        else:
            # stdout stays the agent's; stderr passes through the agent, which keeps its last lines
            # for the report should the slot be given up.
            read_end, err = os.pipe()
            slot.stderr = StderrTail(read_end)
        try:
            slot.proc = None
            if self.warm is not None:
                stdio = (0, out if out is not None else 1, out if out is not None else err)  # as a child would inherit
                try:
                    slot.proc = await self.warm.spawn(self.program, env, stdio)
                except ZygoteLost as exc:
                    self.log.warning("warm_start_off", why=str(exc), message="starting ranks cold from now on")
                    self.warm.close()
                    self.warm = None
            if slot.proc is None:
                slot.proc = await asyncio.create_subprocess_exec(
                    *orphan_guard.prefix(), *self.argv, env=env, stdout=out,
                    stderr=subprocess.STDOUT if out is not None else err)
        finally:
            if out is not None:
                os.close(out)
            if err is not None:
                os.close(err)
        # Not the map current now: one that arrived while the process started must find it stale
        # and restart it, or it would wait for good on the older generation's MASTER_PORT.
        slot.generation = generation
        slot.started_at = time.monotonic()
        slot.stopping = False
        if slot.restarting:  # its replacement speaks for the slot now
            slot.restarting = False
            slot.failed_pid = 0
        slot.connected = False
        slot.report = None
        self.log.info("rank_started", slot=slot.index, pid=slot.proc.pid, generation=slot.generation,
                      start=slot.starts, rank=slot.rank, restart_count=slot.restarts,
                      warm=isinstance(slot.proc, WarmProcess), log=str(slot.log_path) if slot.log_path else None)
        asyncio.ensure_future(self._watch(slot, slot.proc))

    async def _watch(self, slot: Slot, proc: asyncio.subprocess.Process | WarmProcess) -> None:
        code = await self._exit_of(slot, proc)
        if slot.stopping or proc is not slot.proc:
            return
        self.log.info("rank_exited", slot=slot.index, pid=proc.pid, code=code)
        slot.connected = False
        if code == 0 or slot.finished or (slot.completed_file and os.path.exists(slot.completed_file)):
            # Finished: its script completed, whatever its process did in teardown after. Not a failure,
            # never restarted; the job is ending (the ranks of a job finish together).
            slot.finished = True
            if code != 0 or slot.hung:
                self.log.warning("rank_finished_then_died", slot=slot.index, rank=slot.rank, pid=proc.pid, code=code,
                                 hung=slot.hung)
                say(finished_then(slot, code, self.node.config.exit_timeout_s))
            await self.node.settle()
            return
        if self.node.finishing() and not self.node.draining:
            if self.node.library and slot.untrained:  # a replacement with no place yet: nothing of it is lost
                self._outrun(slot, proc.pid)
            else:
                self._lost_as_finishing(slot, proc.pid, code, report=slot.dying_pid != proc.pid)
                slot.last_crash = await crash_of(slot, proc.pid, code)
            await self.node.settle()
            return
        a = self.node.assignment
        if not self.node.library and a is not None and slot.generation < a.generation and not self.node.draining:
            # A process of an older map (its peer died first): the newer map restarts it anyway, so
            # its exit is no new fault, and not charged. Restarted now, unless the reconcile already did.
            async with self.node.reconciling:
                if not slot.alive and not slot.given_up and not slot.parked:
                    await self.start_placed(slot)
            return
        # Restart semantics (a script without the library) restart a crashed rank in its place: the
        # leader re-forms the job once, with its replacement (never a map without the slot first).
        in_place = (not self.node.library and not self.node.draining and slot.charged < self.node.config.max_restarts
                    and self.placed(slot))
        if slot.dying_pid != proc.pid:  # (else reported as it began to die)
            self._report_exit(slot, proc.pid, code, in_place)
        slot.last_crash = await crash_of(slot, proc.pid, code)
        if self.node.draining:
            return
        if not await self.restart_allowed(slot, f"its process ended ({exit_words(code)})"):
            return
        # The first crash restarts at once (as torchrun does); a crash loop backs off.
        delay = self.node.config.restart_backoff_s * 2 ** (slot.crashes - 2) if slot.crashes > 1 else 0.0
        self.log.info("rank_restart_scheduled", slot=slot.index, in_s=delay, restart=slot.restarts, in_place=in_place)
        await asyncio.sleep(delay)
        if in_place:  # its replacement starts once, into the map that re-forms the job with it
            await self._until_crash_answered(slot, lambda: self.node.assignment.generation > slot.crashed_in)
        elif self.node.library and slot.crashes > 1:
            # A crash loop: the leader judges first whether the fault repeats (its verdict ends the run),
            # so that no process starts only to be stopped with the run, however late the verdict.
            await self._until_crash_answered(slot, lambda: crash_answered(self.node.assignment, slot))
        if self.node.finishing() and not self.node.draining and not self.node.done():
            # It began finishing meanwhile: no restart (the leader hears so, if it was told otherwise).
            if self.node.library:  # its crash came first, and the job's other ranks completed it without it
                self._outrun(slot, proc.pid)
            else:  # restart semantics: the job was to re-form with this slot's replacement
                self._lost_as_finishing(slot, proc.pid, code, report=in_place)
            await self.node.settle()
            return
        if not self.node.draining and not self.node.done() and not slot.alive and not slot.given_up:
            # a library rank rejoins at a step boundary; a plain one is restarted again with its new map
            async with self.node.reconciling:
                if not slot.alive and not slot.parked:
                    # Charged only when it restarts with a place: a crash the job answered by leaving
                    # this node out (a peer node lost) was the others' change, not the slot's fault.
                    slot.charged += 1 if self.node.library or self.placed(slot) else 0
                    await self.start_placed(slot)

    def _report_exit(self, slot: Slot, pid: int, code: int, in_place: bool) -> None:
        slot.failed_pid = pid  # reported exited (or restarting) until a replacement speaks for the slot
        a = self.node.assignment
        slot.crashed_in = a.generation if a else 0
        slot.restarting = in_place
        slot.crashes = 1 if outside_crash_loop(code, time.monotonic() - slot.started_at) else slot.crashes + 1
        self.node.session.exits.append(exit_of(slot, pid, code, in_place))
        self.node.session.send_now()  # the leader hears of it within milliseconds

    async def watch_library_ranks(self) -> None:
        """The library ranks, looked at every DYING_POLL_S (one loop for the node: a wake-up costs more
        than the reads): for a kill under way; once the job is finishing, for replacements that will
        never get a place (`_outrun`)."""
        while not self.node.done():
            await asyncio.sleep(DYING_POLL_S)
            if not self.node.library or self.node.draining:
                continue
            finishing = self.node.finishing()
            for slot in self.node.slots:
                if finishing and slot.untrained_replacement:
                    self._outrun(slot, slot.proc.pid)
                    await self.stop(slot)
                    await self.node.settle()
                elif (not finishing and slot.alive and slot.dying_pid != slot.proc.pid and not slot.stopping
                      and not slot.finished):
                    self._heard_dying(slot, slot.proc)

    def _outrun(self, slot: Slot, pid: int) -> None:
        """A library slot whose replacement had no place yet as the job began finishing (its crash came
        first): the job's other ranks complete it without this one, so the slot counts as finished. Its
        replacement is not started, or is ended (`watch_library_ranks`), rather than left to hold for
        --hold-timeout and then fail the run that completed."""
        slot.outrun = True
        self.log.info("rank_outrun", slot=slot.index, pid=pid, restarts=slot.restarts,
                      message="a replacement with no place yet as the job finishes: ended, counted as finished")

    def _heard_dying(self, slot: Slot, proc: asyncio.subprocess.Process | WarmProcess) -> None:
        """A library rank being killed (a signal, its exit begun) is reported at once: its memory, GBs
        for a big model, is freed before its sockets close and its exit can be reaped, which held
        everyone's recovery that long. It speaks no more; its slot restarts once it is reaped."""
        sig = dying_signal(proc.pid)
        if not sig or slot.completed_file and os.path.exists(slot.completed_file):
            return
        slot.dying_pid, slot.connected = proc.pid, False
        self.log.info("rank_dying", slot=slot.index, pid=proc.pid, signal=sig)
        self._report_exit(slot, proc.pid, -sig, in_place=False)

    async def _exit_of(self, slot: Slot, proc: asyncio.subprocess.Process | WarmProcess) -> int:
        """Its process's exit code. While it runs, its script's completion (the runner's mark) is
        looked for: a process still running --exit-timeout after it is hung in interpreter teardown
        (a destructor, a thread never joined), and is sent SIGTERM, then SIGKILL; so is one frozen
        --exit-timeout after its script destroyed its process group (group_end)."""
        timeout_s = self.node.config.exit_timeout_s
        exited = asyncio.ensure_future(proc.wait())
        ended = EndedFile(slot.completed_file + ENDED_SUFFIX) if slot.completed_file else None
        while not slot.finished:
            done, _ = await asyncio.wait([exited], timeout=COMPLETION_POLL_S)
            if done:
                return exited.result()
            if slot.completed_file and os.path.exists(slot.completed_file):
                slot.finished = True
                self.log.info("rank_completed", slot=slot.index, rank=slot.rank, pid=proc.pid)
                self.node.session.send_now()  # the leader hears at once that the job is finishing
            elif ended is not None and ended.frozen_s() > timeout_s:  # its work done, then it froze
                slot.finished = slot.frozen = True
                self.log.warning("rank_frozen_after_its_work", slot=slot.index, rank=slot.rank, pid=proc.pid)
                self.node.session.send_now()
            if slot.imports_file and os.path.exists(slot.imports_file):
                self._learn(slot)
        escalation = ((None, 0.0 if slot.frozen else timeout_s), (proc.terminate, EXIT_KILL_GRACE_S), (proc.kill, None))
        for send, wait_s in escalation:
            if send is not None:
                slot.hung = True
                self.log.warning("rank_exit_timeout", slot=slot.index, pid=proc.pid, sending=send.__name__,
                                 exit_timeout_s=timeout_s)
                send()
            done, _ = await asyncio.wait([exited], timeout=wait_s)
            if done:
                break
        return exited.result()

    def _learn(self, slot: Slot) -> None:
        """The modules a rank imported, for the zygote's successor (read once: the slot stops
        looking for its file)."""
        path, slot.imports_file = slot.imports_file, ""
        modules = read_imports(path)
        if self.warm is not None:
            self.warm.learn(modules)

    def _lost_as_finishing(self, slot: Slot, pid: int, code: int, *, report: bool) -> None:
        """A rank that ended without completing its script once the job was finishing: reported as
        exited (not restarting) and retired; the node will exit 1."""
        slot.failed, slot.restarting, slot.failed_pid = True, False, pid
        if report:
            self.node.session.exits.append(pb.RankExit(local_rank=slot.index, pid=pid, exit_code=code))
            self.node.session.send_now()
        self.log.error("rank_lost_finishing", slot=slot.index, rank=slot.rank, pid=pid, code=code,
                       message="ended without completing its script as the job was finishing: not restarted")

    async def _until_crash_answered(self, slot: Slot, answered: Callable[[], bool]) -> None:
        """Wait (bounded) until the leader has `answered` the slot's crash. A coordinator outage is the
        hold watchdog's."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + RESTART_ANSWER_WAIT_S
        while not answered() and not self.node.done() and not self.node.finishing():
            if loop.time() > deadline and self.node.session.silent_s() < self.node.session.heartbeat_timeout_s:
                self.log.warning("restart_unanswered", slot=slot.index, generation=slot.crashed_in,
                                 waited_s=RESTART_ANSWER_WAIT_S, message="the leader did not answer the crash; "
                                 "restarting the rank in the current map")
                return
            await asyncio.sleep(0.01)

    async def restart_allowed(self, slot: Slot, cause: str) -> bool:
        """Whether the slot may restart after its own crash, or give it up when its budget is spent:
        a crash loop ends with a verdict."""
        if slot.charged < self.node.config.max_restarts:
            return True
        await self._give_up(slot, cause)
        return False

    async def _give_up(self, slot: Slot, cause: str) -> None:
        """After its own crash (its exit is reported already): the slot is retired, with a report."""
        c = self.node.config
        slot.given_up = True
        slot.stopping = False
        crash = slot.last_crash
        self.log.error("slot_given_up", slot=slot.index, restarts=slot.charged, max_restarts=c.max_restarts,
                       last_code=crash.code, rank=crash.rank, cause=cause)
        say(failure_report(c, slot, cause, crash, crash.tail))
        await self.node.settle()

    async def stop(self, slot: Slot, grace_s: float = 5.0) -> None:
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


def read_imports(path: str) -> list[str]:
    """The modules in a rank's imports file, which goes ([] if it cannot be read)."""
    try:
        with open(path) as f:
            modules = f.read().split()
        os.unlink(path)
    except OSError:
        return []
    return modules


def finished_then(slot: Slot, code: int, exit_timeout_s: float) -> str:
    """What a finished rank's process did after its work, for the person at the terminal."""
    how = (f"hung (no Python ran for --exit-timeout {exit_timeout_s:g}s after its destroy_process_group()), ended"
           if slot.frozen else
           f"hung in interpreter teardown, ended after --exit-timeout {exit_timeout_s:g}s" if slot.hung else
           "died in interpreter teardown")
    return f"{slot.named} finished its script, then {how} ({exit_words(code)}): counted as finished"


def say(message: str) -> None:
    """A plain line (or block) for the person at the terminal, beside the structured log."""
    prefix = "muster run: "
    print("\n".join(prefix + line for line in message.split("\n")), file=sys.stderr, flush=True)
