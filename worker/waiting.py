"""What a node without a place waits for, and whether its job has finished: asked of the job's
Status and history on any replica, each query bounded (a frozen replica must not hold a node up)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence

import grpc

from muster.client import Coordinators
from muster.v1 import muster_pb2 as pb
from muster.worker.agent_config import AgentConfig

QUERY_WAIT_S = 3.0  # for the job's history or status (what a node waits for, whether the job finished)


async def waiting_for(c: AgentConfig, a: pb.Assignment | None) -> tuple[str, pb.Event | None]:
    """What this node waits for, in words (from the job's Status and history), and the event that
    ended the job if it has finished."""
    if a is not None and a.start_ranks:
        return (f"starting ranks {list(a.down_local_ranks)}: they take a place in the running job once "
                "they report", await check_finished(c))
    try:
        status, events = await asyncio.wait_for(asyncio.to_thread(query, c, True), QUERY_WAIT_S)
    except Exception as exc:  # the coordinator is between leaders: say what is known
        error = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.RpcError) else type(exc).__name__
        return f"waiting for a place in job {c.job!r} (no answer to a status query: {error})", None
    finished = finished_job(events, status.nodes if status else (), c.node_id)
    if finished is not None:
        return "", finished
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
        return f"waiting for the leader's first assignment ({phase}, {joined} node(s) joined)", None
    if minimum is not None and joined < minimum:
        more = minimum - joined
        return f"waiting for {more} more node{'s' if more != 1 else ''} ({joined} joined, min {minimum}; {phase})", None
    if minimum is None:
        return f"waiting for more nodes ({joined} joined, below the job's min_nodes; {phase})", None
    return (f"waiting for the job to form ({joined} joined, min {minimum}; {phase}"
            + (f"; {reason}" if reason else "") + ")", None)


def query(c: AgentConfig, with_status: bool) -> tuple[pb.JobStatus | None, Sequence[pb.Event]]:
    """The job's Status (None: unknown job) and history, from any replica (blocking: a thread)."""
    with Coordinators(c.coordinators, timeout_s=2.0, security=c.security) as coordinators:
        try:
            events = coordinators.call("Events", pb.EventsRequest(job=c.job)).events
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return None, ()
            raise
        if not with_status:
            return None, events
        jobs = coordinators.call("Status", pb.StatusRequest(job=c.job)).jobs
        return (jobs[0] if jobs else None), events


async def check_finished(c: AgentConfig) -> pb.Event | None:
    """The job ran and every other node left it as finished (None: it did not, or no coordinator
    answered). Asked before joining, and by a spare."""
    def check() -> pb.Event | None:
        _, events = query(c, False)
        if finished_job(events, (), c.node_id) is None:
            return None  # the common case, without the Status of a possibly large job
        status, events = query(c, True)
        return finished_job(events, status.nodes if status else (), c.node_id)

    try:  # bounded: a frozen replica must not hold the join up
        return await asyncio.wait_for(asyncio.to_thread(check), QUERY_WAIT_S)
    except Exception:
        return None


# Events that are no membership change of another node (a generation, a job waiting for nodes).
_NOT_A_DEPARTURE = frozenset({"generation", "formed", "waiting", "state_rebuilt", "replicas_diverged",
                              "rank_restarted"})


def finished_job(events: Sequence[pb.Event], members: Sequence[str], node_id: str) -> pb.Event | None:
    """The event that finished the job, if it has: no node but `node_id` is a member, and the last
    change of another node was leaving as finished (the ranks of a job finish together)."""
    if any(m != node_id for m in members):
        return None
    for e in reversed(events):
        if e.kind in _NOT_A_DEPARTURE or (e.nodes and set(e.nodes) <= {node_id}):
            continue
        return e if e.kind == "node_finished" else None
    return None
