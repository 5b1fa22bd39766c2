"""The last resort of a rank stuck in a C++ call that nothing can reach (a connect, an abort, a
teardown past its bound): the process exits with STUCK_EXIT_CODE, and its agent starts a fresh one
for the slot, rather than let the call hold the slot for its own timeout."""

from __future__ import annotations

import os

import structlog

log = structlog.get_logger(__name__)

STUCK_EXIT_CODE = 3  # a rank that exits stuck: its agent starts a fresh process for the slot


def exit_stuck(cause: str, waited_s: float) -> None:
    """The training thread is stuck in a C++ call that nothing reaches and would hold its slot for
    that call's own timeout: the process exits, and its agent starts a fresh one for the slot."""
    log.error("rank_exited_stuck", error=cause, waited_s=waited_s)
    os._exit(STUCK_EXIT_CODE)
