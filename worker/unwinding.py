"""Whether the training thread has let go of a group an abort broke.

The abort thread makes the old group's collectives fail; the training thread notices at its next
collective (or its next wait on one) and reforms. Every rank of the new generation waits for the
last to arrive, so a training thread that is elsewhere for long (a CUDA synchronisation behind a
kernel the abort did not end, the script's own code between steps) delays them all. Past
UNWIND_LATE_S it is named, with where it is, once per abort.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback

import structlog

log = structlog.get_logger(__name__)

UNWIND_LATE_S = 1.0
STACK_FRAMES = 8  # the innermost frames quoted


class Unwinding:
    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._left = -1  # the newest generation the training thread has begun to leave
        self.training_thread: int | None = None

    def began(self, generation: int) -> None:
        """On the training thread, as it starts to leave `generation`'s group."""
        self.training_thread = threading.get_ident()
        with self._changed:
            self._left = max(self._left, generation)
            self._changed.notify_all()

    def watch(self, generation: int, aborted_by: int) -> bool:
        """On the abort thread, after generation `aborted_by` aborted `generation`'s group: wait
        (bounded) for the training thread to leave it; False, and a log record of where it is,
        if it has not."""
        started = time.monotonic()
        with self._changed:
            if self._changed.wait_for(lambda: self._left >= generation, UNWIND_LATE_S):
                return True
        log.info("abort_not_yet_seen", generation=generation, aborted_by=aborted_by,
                 waited_s=round(time.monotonic() - started, 3), training_thread_at=where(self.training_thread))
        return False


def where(thread: int | None) -> list[str]:
    """A thread's innermost frames, innermost last, as 'file:line function'."""
    frame = sys._current_frames().get(thread) if thread is not None else None
    if frame is None:
        return []
    return [f"{f.filename}:{f.lineno} {f.name}" for f in traceback.extract_stack(frame)[-STACK_FRAMES:]]
