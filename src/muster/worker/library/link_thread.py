"""The rank's background thread as it acts on the rank: its link to the coordinator (`Link`: the
agent's socket, or the coordinator itself) and what it does when the coordinator speaks or is lost.

- a map that declares this process failed fences it out (FencedOut): its state is stale, and a
  fresh process takes the slot back;
- a map that aborts the generation (or a planned switch heard past its step) aborts the group the
  rank trains or syncs in, at once and off the link's loop, which must keep streaming;
- a link that failed for good aborts every group and leaves its error for the training thread,
  which raises it at its next boundary (`raise_error`); one that never gets there exits as stuck.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import structlog

from muster.v1 import muster_pb2 as pb
from muster.worker.errors import FencedOut, RunEnded, WorkerError
from muster.worker.library.step_guards import StepGuards
from muster.worker.library.stuck import OnStuck, exit_unless_raised
from muster.worker.library.unwinding import Unwinding
from muster.worker.link import Link

log = structlog.get_logger(__name__)


class LinkThread:
    def __init__(self, slot: int, guards: StepGuards, unwinding: Unwinding, on_stuck: OnStuck,
                 forming: Callable[[], bool]):
        """`guards`: the rank's (their views of its generation, step, group and closing are this
        thread's too); `forming`: whether the rank is forming a group."""
        self.slot = slot
        self.link = Link("muster-link", on_directive=self.on_directive, on_failure=self.fail)
        self.error: WorkerError | None = None  # the link's, for the training thread to raise
        self._raised = threading.Event()  # the training thread has raised it
        self._guards, self._unwinding, self._on_stuck, self._forming = guards, unwinding, on_stuck, forming
        self._generation, self._closing = guards.generation, guards.closing

    def on_directive(self, d: pb.Directive) -> None:
        """On the link thread, after the mailbox has it."""
        if d.HasField("assignment"):
            a = d.assignment
            generation = self._generation()
            if (generation or self._forming()) and self.slot in a.down_local_ranks:
                # This process held a place, or was forming one, and was declared failed (it hung, or
                # never formed): its state is stale. A fresh process (the agent restarts this one)
                # takes the slot back.
                self.fail(FencedOut(f"fenced out: local rank {self.slot} was declared failed ({a.reason})"))
                return
            # A planned switch heard past its step (a late map): the others left the group there; so does this rank.
            if a.abort_previous or 0 < generation < a.generation and 0 < a.switch_at_step <= self._guards.step():
                self.abort(a.generation)
            log.info("assignment_received", generation=a.generation, role=pb.Role.Name(a.role),
                     abort=a.abort_previous, switch_at_step=a.switch_at_step, reason=a.reason)
        elif d.HasField("drain"):
            log.info("drain_received", after_step=d.drain.after_step, reason=d.drain.reason)

    def fail(self, error: WorkerError, cause: BaseException | None = None) -> None:
        """The link ended for good (or the rank was fenced out): every group is left, and the
        training thread raises `error` at its next boundary, or the process exits as stuck."""
        if self._closing():
            return  # leaving anyway: nothing to abort
        error.__cause__ = cause
        self.error = error
        if isinstance(error, RunEnded):  # no fault: the training loop ends at its next boundary
            log.info("run_ended", outcome=error.outcome, reason=error.reason)
        else:
            log.error("worker_link_failed", error=str(error))
        self.abort(1 << 62)  # leave any collective: the training thread raises at the boundary
        self.link.changed.set()
        threading.Thread(target=exit_unless_raised, args=(str(error), self._raised, self._closing, self._on_stuck),
                         name="muster-fence", daemon=True).start()

    def abort(self, below_generation: int) -> None:
        """Off the link's loop, which must keep streaming while the training thread is watched."""
        self._guards.aborted(below_generation)  # the step in flight stops at its next module or gradient
        comm = self._guards.comm()
        # The group the training thread must leave: the one it steps in, or one formed that it syncs the
        # state in (a chaos run wedged there, on a gloo pair the abort missed, with nothing watching).
        broken = getattr(comm.spec, "generation", self._generation())

        def leave() -> None:
            comm.abort(below_generation)
            if 0 < broken < below_generation and not self._closing():  # the training thread must leave it now
                self._unwinding.watch(broken, below_generation)
        threading.Thread(target=leave, name="muster-abort", daemon=True).start()

    def raise_error(self, error: WorkerError | None = None) -> None:
        """On the training thread: raise the link's error (or `error`, which becomes it), if there is one."""
        if error is not None:
            self.error = error
        if self.error is not None:
            self._raised.set()
            raise self.error

    def abort_coming(self, wait_s: float) -> bool:
        """After a collective failed: is (or does, within wait_s) an abort of this generation come?"""
        deadline = time.monotonic() + wait_s
        while True:
            self.raise_error()
            latest = self.link.latest
            if latest is not None and latest.generation > self._generation() and latest.abort_previous:
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self.link.changed.wait(min(remaining, 0.05))
            self.link.changed.clear()
