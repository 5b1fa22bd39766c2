"""What is said when a slot is given up: a report in the manner of torchrun's root-cause summary,
with the job's last failure elsewhere when the slot only restarted for the maps it caused."""

from __future__ import annotations

import shlex
import signal
import time
from collections.abc import Sequence

from muster.v1 import muster_pb2 as pb
from muster.worker.agent.agent_config import AgentConfig
from muster.worker.agent.slot import Crash, Slot


def exit_words(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def failure_report(config: AgentConfig, slot: Slot, cause: str, crash: Crash | None, tail: Sequence[str],
                   elsewhere: pb.Event | None = None) -> str:
    """The plain report of a slot given up, in the manner of torchrun's root-cause summary: which
    rank, how it ended, what it said last."""
    c = config
    rank = crash.rank if crash is not None else slot.rank
    lines = [
        "=" * 72,
        f"slot {slot.index} of node {c.node_id!r} in job {c.job!r} is given up: {cause}, and its "
        f"{slot.restarts} restart(s) (--max-restarts {c.max_restarts}) are spent",
        f"  rank      : {rank if rank is not None else '-'} (local rank {slot.index})",
    ]
    if crash is not None:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(crash.at))
        lines.append(f"  last crash: {exit_words(crash.code)} (pid {crash.pid}, generation {crash.generation}, {when})")
        if crash.error:
            lines.append(f"  error     : {crash.error}")
    else:
        lines.append("  last crash: none here (restarted for new maps only: the job kept changing)")
    if elsewhere is not None:
        lines.append(f"  job's last failure: {elsewhere.kind} on {', '.join(repr(n) for n in elsewhere.nodes)} "
                     f"(generation {elsewhere.generation}): {elsewhere.reason}  [muster events --job {c.job}]")
    lines.append(f"  command   : {shlex.join(c.argv)}")
    where = "its log" if slot.log_path is not None else "its stderr"
    if tail:
        lines.append(f"  last {len(tail)} line(s) of {where}" + (f" ({slot.log_path})" if slot.log_path else "") + ":")
        lines.extend(f"    {line}" for line in tail)
    else:
        lines.append(f"  {where}: nothing written")
    lines.append("=" * 72)
    return "\n".join(lines)


FAILURES = frozenset({"rank_exited", "rank_silent", "rank_stalled", "node_silent", "process_exited",
                      "rank_restarted", "rank_not_formed", "group_broken", "group_not_formed"})


def last_failure(events: Sequence[pb.Event], node_id: str) -> pb.Event | None:
    """The job's last failure on another node (else on this one): a root cause seen from a node whose
    own ranks only restarted for the maps it caused."""
    failures = [e for e in events if e.kind in FAILURES]
    elsewhere = [e for e in failures if any(n != node_id for n in e.nodes)]
    return (elsewhere or failures or [None])[-1]
