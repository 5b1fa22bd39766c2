"""One slot of a node agent: the state of the rank process it runs, and what that process leaves
when it crashes (its exit, the error torch's @record wrote, the last lines of its stderr), kept for
the crash-loop backoff and the report of a slot given up."""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from muster.terminal import CONTROL
from muster.v1 import muster_pb2 as pb
from muster.worker.rank.step_probe import StepFile
from muster.worker.rank.zygote import WarmProcess

CRASH_LOOP_S = 30.0  # a process that crashes sooner after its start continues a crash loop (backoff)
TAIL_LINES = 20  # of a given-up slot's stderr, in its report
TAIL_BYTES = 64 * 1024
# A rank's line with no end yet (a prompt) is passed on after this. Not less: with PYTHONUNBUFFERED
# (common in containers) print() writes a line and its end in two calls, and on a loaded host 0.5 s
# between them was seen, the agent's next record then sharing the line.
PARTIAL_LINE_S = 2.0
MAX_ERROR_CHARS = 200  # of the exception a rank died of, in its exit report (RankExit.error)
# A library rank's states before its first step (the leader's `live_records.NOT_TRAINED`, as the wire has them)
NOT_TRAINED = frozenset({pb.RANK_STATE_STARTING, pb.RANK_STATE_FORMING, pb.RANK_STATE_HOLDING})
PF_EXITING = 0x4  # a task's flag from the start of its exit (include/linux/sched.h)


def outside_crash_loop(code: int, lived_s: float) -> bool:
    """A rank's exit that starts no crash loop (restarted at once): it ran past CRASH_LOOP_S, or
    it was SIGKILLed, which comes from outside the script (the OOM killer, an operator, a fault
    injector). Two kills of one slot seconds apart are two faults, not a script that cannot start;
    the restart budget still bounds a slot killed on every start."""
    return lived_s > CRASH_LOOP_S or code == -signal.SIGKILL


@dataclass(frozen=True)
class Crash:
    """A rank process that exited non-zero, as the failure report shows it."""

    code: int
    pid: int
    rank: int | None
    generation: int
    at: float  # wall clock
    tail: tuple[str, ...]  # the last lines of its stderr (or log)
    error: str = ""  # from its TORCHELASTIC_ERROR_FILE


@dataclass(eq=False)
class Slot:
    index: int
    proc: asyncio.subprocess.Process | WarmProcess | None = None
    starts: int = 0
    restarts: int = 0  # new processes after its first, whatever the cause (TORCHELASTIC_RESTART_COUNT)
    # Restarts for its own crashes: what --max-restarts bounds. A restart for a map that others'
    # changes made is not charged (as torchrun's membership restarts are not).
    charged: int = 0
    parked: bool = False  # its process ended while the node had no place: started with the map that places it
    finished: bool = False  # its script completed (exit 0, or the runner's mark): its process may still be tearing down
    given_up: bool = False  # crash-looped past the budget
    failed: bool = False  # ended without completing once the job was finishing: not restarted
    outrun: bool = False  # a replacement with no place yet as the job finished (never to get one): counted as finished
    generation: int = 0  # the generation its process was started for
    stopping: bool = False  # the agent is ending this process on purpose
    failed_pid: int = 0
    dying_pid: int = 0  # its process heard killed as its exit began, and reported so: not reported again once reaped
    crashed_in: int = 0  # the generation its last process crashed in: a replacement is no member of it
    crashes: int = 0  # in a row, each within CRASH_LOOP_S of its start: the backoff grows with them
    started_at: float = 0.0  # monotonic, its process's start
    restarting: bool = False  # crashed, and restarted in place once the leader has re-formed the job
    report: pb.RankReport | None = None  # last report of a library rank over the socket
    heard_at: float = 0.0
    connected: bool = False
    secret: str = field(default="", repr=False)  # of its current process: its stream to the agent presents it
    rank: int | None = None  # the global rank its process was started as (None: no place yet)
    log_path: Path | None = None  # with --log-dir: its process's output
    stderr: StderrTail | None = None  # without --log-dir: its process's stderr, passed through
    error_file: str = ""  # TORCHELASTIC_ERROR_FILE of its process (scripts using torch's @record)
    completed_file: str = ""  # created by the runner once its process's script completed
    imports_file: str = ""  # written by the runner: the packages its process imported (warm starts)
    steps: StepFile | None = None  # where its process's step probe writes (a script without the library)
    hung: bool = False  # its process outlived --exit-timeout after its script completed, and was ended
    frozen: bool = False  # its script destroyed its process group, then its process ran no Python for --exit-timeout
    # The process that outlived the node's rejoin: until the new member is placed, the leader lists
    # the slot as awaiting a process (start_ranks), which is not that one's failure (rank_hub).
    kept_pid: int = 0
    last_crash: Crash | None = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    @property
    def kept(self) -> bool:
        """Its process is the one that outlived the node's rejoin (not yet placed since)."""
        return self.alive and self.proc.pid == self.kept_pid

    @property
    def retired(self) -> bool:
        """Never started again: its script completed, it was given up, or it ended as the job finished."""
        return self.finished or self.given_up or self.failed or self.outrun

    @property
    def untrained(self) -> bool:
        """Its process replaces one that crashed and has not trained: it said nothing yet, or says it
        waits for a place in a group (starting, forming or holding, at step 0). Once the job is
        finishing it never gets one: a finishing job re-forms nothing, and the ranks that complete it
        do so without it. (`report` is its current process's: cleared at each start.)"""
        r = self.report
        return self.restarts > 0 and (r is None or r.state in NOT_TRAINED and r.step == 0)

    @property
    def untrained_replacement(self) -> bool:
        """`untrained`, its process running and heard from, not one the agent is ending."""
        return self.alive and self.connected and not self.stopping and not self.finished and self.untrained

    @property
    def named(self) -> str:
        """How messages name it: its rank and slot."""
        return f"rank {self.rank} (slot {self.index})" if self.rank is not None else f"slot {self.index}"


class StderrTail:
    """A rank's stderr without --log-dir: a thread passes it through to the agent's stderr (never
    the agent's loop: a slow reader of the agent's output must not stall its frames) and keeps its
    last bytes for the report of a slot given up."""

    def __init__(self, fd: int):
        self._fd = fd
        self._tail = bytearray()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._pump, name="muster-rank-stderr", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        # Whole lines only, so that a rank's line never shares one with the agent's own records
        # (they go to the same stderr); one with no end yet is passed on after PARTIAL_LINE_S.
        pending = b""
        readable = select.poll()
        readable.register(self._fd, select.POLLIN)
        try:
            while True:
                if not readable.poll(PARTIAL_LINE_S * 1000 if pending else None):
                    _write_out(pending)
                    pending = b""
                    continue
                chunk = os.read(self._fd, 65536)
                if not chunk:
                    break
                with self._lock:
                    self._tail += chunk
                    if len(self._tail) > 2 * TAIL_BYTES:
                        del self._tail[:-TAIL_BYTES]
                data = pending + chunk
                end = max(data.rfind(b"\n"), data.rfind(b"\r")) + 1
                if len(data) - end >= TAIL_BYTES:  # a line too long to hold back: passed on as it is
                    end = len(data)
                _write_out(data[:end])
                pending = data[end:]
        except OSError:
            pass
        finally:
            _write_out(pending)
            os.close(self._fd)

    def lines(self, n: int, wait_s: float = 1.0) -> tuple[str, ...]:
        """Its last n lines, once its process has exited and the pipe is drained (bounded wait: a
        child of the rank may hold the pipe open)."""
        self._thread.join(wait_s)
        with self._lock:
            return last_lines(bytes(self._tail[-TAIL_BYTES:]), n)


def _write_out(data: bytes) -> None:
    """Pass bytes on to the agent's stderr. If it is gone they are dropped: the pipe is drained on,
    the rank must not block on it."""
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(2, view):]
    except OSError:
        pass


def last_lines(data: bytes, n: int) -> tuple[str, ...]:
    lines = data.decode("utf-8", "replace").replace("\r\n", "\n").split("\n")
    while lines and not lines[-1].strip():
        lines.pop()
    return tuple(line.rstrip() for line in lines[-n:])


def error_of(path: str) -> tuple[str, int]:
    """The first line of what torch's @record (or the runner) wrote to TORCHELASTIC_ERROR_FILE, and the
    step the runner says it was raised in: ('', 0) when nothing."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return "", 0
    if not isinstance(doc, dict):
        return "", 0
    message = doc.get("message", "")
    if isinstance(message, dict):
        message = message.get("message", "")
    step = doc.get("muster_step", 0)
    first = str(message).strip().splitlines()[0] if str(message).strip() else ""
    return first, step if isinstance(step, int) and step > 0 else 0


def dying_signal(pid: int) -> int:
    """The signal killing `pid`, read as its exit begins: its /proc stat's flags say PF_EXITING and
    its exit code a signal, both set before the kernel frees its memory, which it does before it
    closes its sockets and lets it be reaped (a 1.6 GB process here: 0.1 ms against 88 ms; a GPU
    rank's driver teardown comes before its reap too). 0 while it runs, where it exits by itself,
    or where /proc does not say (the exit code is shown only to a process that may trace it)."""
    fields = stat_fields(pid)
    if fields is None or len(fields) < 50:
        return 0
    flags, code = int(fields[6]), int(fields[49])  # fields 9 and 52
    return code & 0x7F if flags & PF_EXITING else 0


def process_state(pid: int) -> str | None:
    """The process's state letter from /proc (R, S, D, T, Z, ...), or None when there is none."""
    fields = stat_fields(pid)
    return fields[0] if fields else None


def stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields from the third (the state) on; None where there is no such process.
    (The name in the second may hold anything, parentheses and spaces included.)"""
    data = _STATS.read(pid)
    try:
        return data.rsplit(b")", 1)[1].decode().split() if data is not None else None
    except IndexError:
        return None


class StatFiles:
    """/proc/PID/stat read through a descriptor kept open for the process: an agent reads each
    rank's 50 times a second (a kill under way, `dying_signal`) and at every frame, and a pread
    costs a quarter of an open, read and close (8 us against 34 here). A descriptor reads its own
    process only, so one that says it is gone (reaped) is closed and the pid opened anew (it may be
    another process by now, as a path read would find); the most recent KEEP are kept."""

    KEEP = 64

    def __init__(self):
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()

    def read(self, pid: int) -> bytes | None:
        with self._lock:
            return self._read(pid)

    def _read(self, pid: int) -> bytes | None:
        fd = self._fds.pop(pid, None)
        data = _pread_or_close(fd) if fd is not None else None
        if data is None:  # never opened, or its process is gone: the pid's process now, if any
            try:
                fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return None
            if (data := _pread_or_close(fd)) is None:
                return None
            while len(self._fds) >= self.KEEP:
                os.close(self._fds.pop(next(iter(self._fds))))
        self._fds[pid] = fd  # (the most recent last)
        return data


def _pread_or_close(fd: int) -> bytes | None:
    try:
        return os.pread(fd, 4096, 0)
    except OSError:
        os.close(fd)
        return None


_STATS = StatFiles()


def crash_answered(a: pb.Assignment | None, slot: Slot) -> bool:
    """The leader has acted on the slot's last crash: a generation after the one it crashed in, or
    the slot listed as down; or the slot was in no map, so its crash changed nothing."""
    return (a is None or a.generation > slot.crashed_in or slot.index in a.down_local_ranks
            or slot.index not in a.local_ranks)


def exit_of(slot: Slot, pid: int, code: int, restarting: bool) -> pb.RankExit:
    """Its process's exit as the leader hears it: with the exception it died of (one line, without
    control characters, 200 characters at most: the wire's bounds) and the step it was in, where
    known (the library's word in the error file, else its last report or the step probe's + 1)."""
    error, step = error_of(slot.error_file) if slot.error_file else ("", 0)
    if error and not step:
        if slot.steps is not None:
            step = slot.steps.read()[0] + 1
        elif slot.report is not None:
            step = slot.report.step + 1
    return pb.RankExit(local_rank=slot.index, pid=pid, exit_code=code, restarting=restarting,
                       error=CONTROL.sub("?", error)[:MAX_ERROR_CHARS], step=step if error else 0)


def read_tail(slot: Slot) -> tuple[str, ...]:
    """The last lines its current process wrote to stderr (or its log) (blocking: a thread)."""
    if slot.stderr is not None:
        return slot.stderr.lines(TAIL_LINES)
    if slot.log_path is not None:
        try:
            with open(slot.log_path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - TAIL_BYTES))
                return last_lines(f.read(), TAIL_LINES)
        except OSError:
            pass
    return ()


async def crash_of(slot: Slot, pid: int, code: int) -> Crash:
    """Its process's non-zero exit, as the failure report shows it (the tail read on a thread)."""
    return Crash(code, pid, slot.rank, slot.generation, time.time(), await asyncio.to_thread(read_tail, slot),
                 error_of(slot.error_file)[0])
