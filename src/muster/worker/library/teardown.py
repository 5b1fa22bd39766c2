"""The teardown of aborted NCCL groups, off the reform's path.

`ncclCommAbort` sets the communicator's abort flag at once (its kernels end, so a training thread
waiting on one is released) and then joins the communicator's proxy threads, which look at that
flag only every 500 ms (NCCL's src/proxy.cc): half a second on an H200 in which the next
generation needs nothing from the old communicator. torch's `ProcessGroupNCCL::abort()` runs the
whole call, under the communicator's own mutex, with the GIL released. So the aborting thread
only takes the groups out of torch's registry (the next generation's group may form at once) and
hands them here: one daemon thread aborts each group once, then, when the training thread has let
go of them too (`release`, at its reform), shuts them down (joins their watchdog, GIL released)
and drops them. Dropped before the shutdown, the last reference could be DDP's reducer, whose
dealloc (GIL held) joins a watchdog that waits for the GIL: a deadlock (seen on the twin).

Bounded: a teardown call still running TEARDOWN_EXIT_S after it began is stuck in NCCL (with this
process's NCCL state): the process exits and its agent starts a fresh one, rather than keep a
communicator's GPU memory for good and queue every later teardown behind it.
"""

from __future__ import annotations

import atexit
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

log = structlog.get_logger(__name__)

TEARDOWN_EXIT_S = 60.0  # ncclCommAbort takes ~0.5 s; a minute is a call that will not return
# At the process's exit, the teardowns still pending get this long: a daemon thread inside
# ncclCommAbort while the interpreter and then CUDA's driver shut down made ranks that had
# finished their script die of std::terminate ("driver shutting down"; H200, torch 2.11).
AT_EXIT_S = 10.0


@dataclass
class _Batch:
    generation: int
    groups: list
    number: int  # in the order submitted
    submitted: float = field(default_factory=time.monotonic)
    abort_s: float = 0.0


class Teardown:
    def __init__(self, abort: Callable[[list], None], on_stuck: Callable[[str, float], None], *,
                 exit_s: float = TEARDOWN_EXIT_S):
        """`abort(groups)`: the backend's abort of one generation's groups (blocking; any thread).
        `on_stuck(cause, waited_s)`: what a call past `exit_s` does (the process exits)."""
        self._abort = abort
        self._exit_s = exit_s
        self._on_stuck = on_stuck
        self._cond = threading.Condition()
        self._queue: deque[_Batch] = deque()  # submitted, not yet aborted
        self._held: list[_Batch] = []  # aborted, waiting for the training thread's release
        self._in_flight: set[int] = set()  # ids of the groups held here: none is aborted twice
        self._thread: threading.Thread | None = None
        self._busy = 0  # batches submitted and not yet dropped
        self._submitted = 0  # batches ever submitted
        self._released = 0  # the training thread let go of the batches numbered up to this

    def submit(self, generation: int, groups: list) -> None:
        """Abort `groups` (out of torch's registry already) in the background. Returns at once."""
        with self._cond:
            fresh = [g for g in groups if id(g) not in self._in_flight]
            if len(fresh) < len(groups):
                log.warning("group_abort_repeated", generation=generation, groups=len(groups) - len(fresh))
            if not fresh:
                return
            self._in_flight.update(id(g) for g in fresh)
            self._submitted += 1
            self._queue.append(_Batch(generation, fresh, self._submitted))
            self._busy += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="muster-teardown", daemon=True)
                self._thread.start()
                atexit.register(self.finish, AT_EXIT_S)
            self._cond.notify_all()

    def release(self) -> None:
        """The training thread has let go of every group submitted so far: they may be shut down."""
        with self._cond:
            self._released = self._submitted
            self._cond.notify_all()

    def finish(self, timeout_s: float) -> bool:
        """At exit: nothing uses the groups any more; end every teardown (bounded) before the
        interpreter and CUDA go away. False if some did not end in time."""
        self.release()
        if self.idle(timeout_s):
            return True
        log.warning("group_teardown_unfinished_at_exit", waited_s=timeout_s)
        return False

    def idle(self, timeout_s: float) -> bool:
        """Wait (bounded) until every submitted group is torn down; False if some still are not."""
        with self._cond:
            return self._cond.wait_for(lambda: self._busy == 0, timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or any(b.number <= self._released for b in self._held))
                batch = self._queue.popleft() if self._queue else None
                done = [b for b in self._held if b.number <= self._released] if batch is None else []
                self._held = [b for b in self._held if b not in done]
            if batch is not None:
                batch.abort_s = self._call(batch, "abort", lambda: self._abort(batch.groups))
                with self._cond:
                    self._held.append(batch)
            for b in done:
                shutdown_s = self._call(b, "shutdown", lambda: _shutdown(b.groups))
                log.info("group_torn_down", generation=b.generation, groups=len(b.groups),
                         abort_s=round(b.abort_s, 4), shutdown_s=round(shutdown_s, 4),
                         seconds=round(time.monotonic() - b.submitted, 4))
                with self._cond:  # (while they live: no other object has their ids)
                    self._in_flight.difference_update(id(g) for g in b.groups)
                b.groups.clear()  # the last references, dropped here once their threads are joined
                with self._cond:
                    self._busy -= 1
                    self._cond.notify_all()

    def _call(self, batch: _Batch, what: str, call: Callable[[], None]) -> float:
        """Seconds `call` took; past the bound, on_stuck."""
        started = time.monotonic()
        cause = f"the {what} of generation {batch.generation}'s aborted group"
        watch = threading.Timer(self._exit_s, self._on_stuck, args=(cause, self._exit_s))
        watch.daemon = True
        watch.start()
        try:
            call()
        except Exception as exc:  # the group is gone either way: nothing left to tear down
            log.warning("group_teardown_failed", generation=batch.generation, step=what, error=str(exc)[:200])
        finally:
            watch.cancel()
            watch.join()  # (no thread outlives its call)
        return time.monotonic() - started


def _shutdown(groups: list) -> None:
    """End the aborted groups' threads (shutdown releases the GIL; after an abort NCCL has nothing
    left to finalize or destroy)."""
    for group in groups:
        try:
            group.shutdown()
        except Exception as exc:  # already ended: nothing left to release
            log.debug("group_release_failed", error=str(exc)[:200])
