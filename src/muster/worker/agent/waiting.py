"""What a node without a place waits for: asked of the job's Status and history on any replica,
each query bounded (a frozen replica must not hold a node up)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence

import grpc

from muster.client import Coordinators
from muster.v1 import muster_pb2 as pb
from muster.worker.agent.agent_config import AgentConfig

QUERY_WAIT_S = 3.0  # for the job's status and history


async def waiting_for(c: AgentConfig, a: pb.Assignment | None) -> str:
    """What this node waits for, in words (from the job's Status and history)."""
    if a is not None and a.start_ranks:
        return f"starting ranks {list(a.down_local_ranks)}: they take a place in the running job once they report"
    try:
        status, events = await asyncio.wait_for(asyncio.to_thread(query, c), QUERY_WAIT_S)
    except Exception as exc:  # the coordinator is between leaders: say what is known
        error = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.RpcError) else type(exc).__name__
        return f"waiting for a place in job {c.job!r} (no answer to a status query: {error})"
    joined = len(status.nodes) if status else 0
    minimum = c.nodes[0] if c.nodes else None
    reason = ""
    for e in reversed(events):
        if e.kind == "waiting":
            reason = e.reason
            found = re.search(r"min_nodes=(\d+)", e.reason)
            if minimum is None and found:
                minimum = int(found.group(1))
            break
    phase = f"job {c.job!r} {status.phase if status else 'unknown'}"
    if a is None:
        return f"waiting for the leader's first assignment ({phase}, {joined} node(s) joined)"
    if minimum is not None and joined < minimum:
        more = minimum - joined
        return f"waiting for {more} more node{'s' if more != 1 else ''} ({joined} joined, min {minimum}; {phase})"
    if minimum is None:
        return f"waiting for more nodes ({joined} joined, below the job's min_nodes; {phase})"
    return (f"waiting for the job to form ({joined} joined, min {minimum}; {phase}"
            + (f"; {reason}" if reason else "") + ")")


def query(c: AgentConfig) -> tuple[pb.JobStatus | None, Sequence[pb.Event]]:
    """The job's Status (None: unknown job) and history, from any replica (blocking: a thread)."""
    with Coordinators(c.coordinators, timeout_s=2.0, security=c.security) as coordinators:
        try:
            events = coordinators.call("Events", pb.EventsRequest(job=c.job)).events
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return None, ()
            raise
        jobs = coordinators.call("Status", pb.StatusRequest(job=c.job)).jobs
        return (jobs[0] if jobs else None), events
