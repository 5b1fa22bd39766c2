"""Whether the training thread has let go of a group an abort broke.

The abort thread makes the old group's collectives fail; the training thread notices at its next
collective (or its next wait on one) and reforms. Every rank of the new generation waits for the
last to arrive, so a training thread that is elsewhere for long (a CUDA synchronisation behind a
kernel the abort did not end, the script's own code between steps) delays them all. Past
UNWIND_LATE_S it is named, with where it is, once per abort. A thread still there after a few of
its longest recent steps (UNWIND_EXIT_STEPS, at least UNWIND_EXIT_MIN_S) is stuck in a call the
abort did not reach (a gloo wait on a pair closed before it was posted, seen once in a consecutive
suite run): the process exits, its agent starts a fresh one, and the others form without it rather
than wait for the leader's stall timeout. Not before MEASURED_STEPS steps (the first step, with its
one-off costs, sets the longest; one more is measured against it), nor in a declared long phase.
Early in a job matters: a partition five steps in left a healthy node's ranks in such a wait, and
the leader's stall timeout evicted that node too.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Callable

import structlog

from muster.worker.library.stuck import OnStuck, exit_stuck

log = structlog.get_logger(__name__)

UNWIND_LATE_S = 1.0
UNWIND_EXIT_STEPS = 3.0  # a stuck training thread: still there after this many of its longest steps
UNWIND_EXIT_MIN_S = 3.0
MEASURED_STEPS = 2
STACK_FRAMES = 8  # the innermost frames quoted


class Unwinding:
    def __init__(self, excused: Callable[[], bool] = lambda: False, on_stuck: OnStuck = exit_stuck) -> None:
        """`excused()`: a training thread not leaving an aborted group is not stuck (the worker is
        closing, or the script declared a long phase). `on_stuck(cause, waited_s)`: the process's end
        when it is (the Worker's: its state's hand-over, then the exit)."""
        self._excused = excused
        self._on_stuck = on_stuck
        self._changed = threading.Condition()
        self._left = -1  # the newest generation the training thread has begun to leave
        self.training_thread: int | None = None
        self.steps = 0
        self.longest_s = 0.0  # the longest recent step, decaying by 1% a step

    def stepped(self, us: int) -> None:
        """On the training thread, after each completed step (cheap: it is on the step's path)."""
        self.steps += 1
        self.longest_s = max(us / 1e6, self.longest_s * 0.99)

    def exit_after_s(self) -> float | None:
        """How long after an abort a training thread still in the old group is stuck (None: too
        few steps measured to tell)."""
        if self.steps < MEASURED_STEPS:
            return None
        return max(UNWIND_EXIT_MIN_S, UNWIND_EXIT_STEPS * self.longest_s)

    def began(self, generation: int) -> None:
        """On the training thread, as it starts to leave `generation`'s group."""
        self.training_thread = threading.get_ident()
        with self._changed:
            self._left = max(self._left, generation)
            self._changed.notify_all()

    def watch(self, generation: int, aborted_by: int) -> bool:
        """On the abort thread, after generation `aborted_by` aborted `generation`'s group: wait
        (bounded) for the training thread to leave it; False, and a log record of where it is,
        if it has not. Still there at `exit_after_s`, it is stuck: the process exits, unless excused."""
        started = time.monotonic()
        left = lambda: self._left >= generation  # noqa: E731
        with self._changed:
            if self._changed.wait_for(left, UNWIND_LATE_S):
                return True
        log.info("abort_not_yet_seen", generation=generation, aborted_by=aborted_by,
                 waited_s=round(time.monotonic() - started, 3), training_thread_at=where(self.training_thread))
        bound = self.exit_after_s()
        if bound is None:
            return False
        with self._changed:
            if self._changed.wait_for(left, max(0.0, bound - (time.monotonic() - started))):
                return True
        if not self._excused():
            at = " < ".join(reversed(where(self.training_thread)[-3:])) or "an unknown place"
            self._on_stuck(f"the training thread has not left generation {generation}'s group {bound:.1f}s after "
                       f"generation {aborted_by} aborted it (at {at})", bound)
        return False


def where(thread: int | None) -> list[str]:
    """A thread's innermost frames, innermost last, as 'file:line function'."""
    frame = sys._current_frames().get(thread) if thread is not None else None
    if frame is None:
        return []
    return [f"{f.filename}:{f.lineno} {f.name}" for f in traceback.extract_stack(frame)[-STACK_FRAMES:]]
