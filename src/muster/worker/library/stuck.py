"""The last resort of a rank stuck in a C++ call that nothing can reach (a connect, an abort, a
teardown past its bound): the process exits with STUCK_EXIT_CODE, and its agent starts a fresh one
for the slot, rather than let the call hold the slot for its own timeout. What the process alone holds
(a sharded state's peer snapshots) it first leaves for the slot's next process: the `hand_over` its
Worker passes to each watch that may end the process (the registered StateTransfer's)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import structlog

log = structlog.get_logger(__name__)

STUCK_EXIT_CODE = 3  # a rank that exits stuck: its agent starts a fresh process for the slot
STUCK_EXIT_S = 10.0  # a fenced rank whose training thread does not raise within this long exits

OnStuck = Callable[[str, float], None]  # (cause, waited_s): what a watch does when the process is stuck


def exit_stuck(cause: str, waited_s: float, hand_over: Callable[[], None] = lambda: None) -> None:
    """The training thread is stuck in a C++ call that nothing reaches and would hold its slot for
    that call's own timeout: the process exits, and its agent starts a fresh one for the slot.
    `hand_over()` first: what only this process holds, written for the slot's next process."""
    log.error("rank_exited_stuck", error=cause, waited_s=waited_s)
    try:
        hand_over()
    except Exception as exc:  # the exit must happen whatever: the slot's next process starts without it
        log.error("leave_behind_failed", error=f"{type(exc).__name__}: {str(exc)[:200]}")
    os._exit(STUCK_EXIT_CODE)


def exit_unless_raised(error: str, raised: threading.Event, closing: Callable[[], bool],
                       on_stuck: OnStuck = exit_stuck) -> None:
    """A rank whose training thread cannot get to its error (stuck in a C++ call that no abort
    reaches, e.g. gloo connecting to a peer that died mid-init) would hold its slot forever: it
    exits, and its agent starts a fresh process for the slot."""
    if raised.wait(STUCK_EXIT_S) or closing():
        return
    on_stuck(error, STUCK_EXIT_S)
