"""The last resort of a rank stuck in a C++ call that nothing can reach (a connect, an abort, a
teardown past its bound): the process exits with STUCK_EXIT_CODE, and its agent starts a fresh one
for the slot, rather than let the call hold the slot for its own timeout."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import structlog

log = structlog.get_logger(__name__)

STUCK_EXIT_CODE = 3  # a rank that exits stuck: its agent starts a fresh process for the slot
STUCK_EXIT_S = 10.0  # a fenced rank whose training thread does not raise within this long exits


def exit_stuck(cause: str, waited_s: float) -> None:
    """The training thread is stuck in a C++ call that nothing reaches and would hold its slot for
    that call's own timeout: the process exits, and its agent starts a fresh one for the slot."""
    log.error("rank_exited_stuck", error=cause, waited_s=waited_s)
    os._exit(STUCK_EXIT_CODE)


def exit_unless_raised(error: str, raised: threading.Event, closing: Callable[[], bool]) -> None:
    """A rank whose training thread cannot get to its error (stuck in a C++ call that no abort
    reaches, e.g. gloo connecting to a peer that died mid-init) would hold its slot forever: it
    exits, and its agent starts a fresh process for the slot."""
    if raised.wait(STUCK_EXIT_S) or closing():
        return
    exit_stuck(error, STUCK_EXIT_S)
