"""The last resort of a rank stuck in a C++ call that nothing can reach (a connect, an abort, a
teardown past its bound): the process exits with STUCK_EXIT_CODE, and its agent starts a fresh one
for the slot, rather than let the call hold the slot for its own timeout. What the process alone holds
(a sharded state's peer snapshots) it first leaves for the slot's next process (`leave_behind`)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import structlog

log = structlog.get_logger(__name__)

STUCK_EXIT_CODE = 3  # a rank that exits stuck: its agent starts a fresh process for the slot
STUCK_EXIT_S = 10.0  # a fenced rank whose training thread does not raise within this long exits

# Called before a stuck exit: what only this process holds, written for the slot's next process. One
# per process, as the exit is the process's (the registered state's, src/muster/worker/library/snapshots.py).
_leave: Callable[[], None] | None = None


def leave_behind(what: Callable[[], None] | None) -> None:
    """Have a stuck exit call `what` first (None: nothing)."""
    global _leave
    _leave = what


def exit_stuck(cause: str, waited_s: float) -> None:
    """The training thread is stuck in a C++ call that nothing reaches and would hold its slot for
    that call's own timeout: the process exits, and its agent starts a fresh one for the slot."""
    log.error("rank_exited_stuck", error=cause, waited_s=waited_s)
    if _leave is not None:
        try:
            _leave()
        except Exception as exc:  # the exit must happen whatever: the slot's next process starts without it
            log.error("leave_behind_failed", error=f"{type(exc).__name__}: {str(exc)[:200]}")
    os._exit(STUCK_EXIT_CODE)


def exit_unless_raised(error: str, raised: threading.Event, closing: Callable[[], bool]) -> None:
    """A rank whose training thread cannot get to its error (stuck in a C++ call that no abort
    reaches, e.g. gloo connecting to a peer that died mid-init) would hold its slot forever: it
    exits, and its agent starts a fresh process for the slot."""
    if raised.wait(STUCK_EXIT_S) or closing():
        return
    exit_stuck(error, STUCK_EXIT_S)
