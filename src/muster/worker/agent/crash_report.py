"""What is said when a slot is given up: a report in the manner of torchrun's root-cause summary."""

from __future__ import annotations

import shlex
import signal
import time
from collections.abc import Sequence

from muster.worker.agent.agent_config import AgentConfig
from muster.worker.agent.slot import Crash, Slot


def exit_words(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def failure_report(config: AgentConfig, slot: Slot, cause: str, crash: Crash, tail: Sequence[str]) -> str:
    """The plain report of a slot given up (only its own crashes spend its budget), in the manner of
    torchrun's root-cause summary: which rank, how it ended, what it said last."""
    c = config
    when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(crash.at))
    lines = [
        "=" * 72,
        f"slot {slot.index} of node {c.node_id!r} in job {c.job!r} is given up: {cause}, and its "
        f"{slot.charged} restart(s) (--max-restarts {c.max_restarts}) are spent",
        f"  rank      : {crash.rank if crash.rank is not None else '-'} (local rank {slot.index})",
        f"  last crash: {exit_words(crash.code)} (pid {crash.pid}, generation {crash.generation}, {when})",
    ]
    if crash.error:
        lines.append(f"  error     : {crash.error}")
    lines.append(f"  command   : {shlex.join(c.argv)}")
    where = "its log" if slot.log_path is not None else "its stderr"
    if tail:
        lines.append(f"  last {len(tail)} line(s) of {where}" + (f" ({slot.log_path})" if slot.log_path else "") + ":")
        lines.extend(f"    {line}" for line in tail)
    else:
        lines.append(f"  {where}: nothing written")
    lines.append("=" * 72)
    return "\n".join(lines)

