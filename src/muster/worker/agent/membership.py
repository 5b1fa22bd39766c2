"""The node agent's membership of its job: joining within --join-timeout, saying what it waits for,
and joining again when the leader removed the node while it could not hear it. The Join tells the
run, and with it where --log-dir's files go (DIR/<job>/<run>/: src/muster/rank_logs.py)."""

from __future__ import annotations

import asyncio

import grpc

from muster import logs, rank_logs
from muster.client import TRANSIENT
from muster.worker.node_session import Evicted
from muster.worker.outcome import EXIT_FAILED
from muster.worker.agent.supervisor import Node, say

MAX_REJOINS = 3  # in a row, none of them heard as a member: a leader that keeps refusing ends the node


async def join(node: Node) -> bool:
    """Join within --join-timeout, saying what is awaited. False: the agent is done (a refusal,
    the timeout), its exit code set."""
    c = node.config
    loop = asyncio.get_running_loop()
    deadline = loop.time() + c.join_timeout_s
    addresses = ",".join(c.coordinators)
    attempts = 0
    while True:
        remaining = max(0.0, deadline - loop.time())
        attempts += 1
        try:
            # the first answer is awaited briefly: a coordinator that is not up yet is said at once
            await node.session.join(retry_for_s=min(remaining, c.wait_report_s if attempts > 1 else 0.5))
            return _logs_opened(node)
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in TRANSIENT:
                node.log.error("join_refused", code=exc.code().name, details=exc.details())
                say(f"the coordinator refused node {c.node_id!r} in job {c.job!r}: "
                    f"{exc.code().name}: {exc.details()}")
                node.finish(EXIT_FAILED)
                return False
            error = f"{exc.code().name}: {exc.details()}"
        except TimeoutError as exc:
            error = str(exc)
        remaining = deadline - loop.time()
        if remaining <= 0:
            node.log.error("join_timeout", join_timeout_s=c.join_timeout_s, error=error)
            say(f"no coordinator at {addresses} accepted node {c.node_id!r} in job {c.job!r} within "
                f"{c.join_timeout_s:g}s (--join-timeout); last error: {error}")
            node.finish(EXIT_FAILED)
            return False
        node.log.warning("join_waiting", coordinators=list(c.coordinators), error=error,
                         message=f"waiting for a coordinator to accept the join ({error}); "
                                 f"giving up in {remaining:.0f}s")


def _logs_opened(node: Node) -> bool:
    """With --log-dir: the joined run's directory made, and the agent's log copied there from now on
    (its lines so far first). Only then do ranks start, their files beside it. False: it cannot be
    made (the agent is done, its exit code set)."""
    c = node.config
    if c.log_dir is None:
        return True
    try:
        run = rank_logs.made_dir(c.log_dir, c.job, node.session.joined_run)
        logs.copy_to(rank_logs.agent_log(run, c.node_id))
    except OSError as exc:
        node.log.error("log_dir_unusable", log_dir=str(c.log_dir), run=node.session.joined_run, error=str(exc))
        say(f"--log-dir {c.log_dir}: {exc}; node {c.node_id!r} stops")
        node.finish(EXIT_FAILED)
        return False
    return True


async def rejoin(node: Node, evicted: Evicted, rejoins: int) -> bool:
    """After an eviction (the `rejoins`-th in a row, none heard as a member since): join again. The
    leader removes an agent's node only when it cannot hear it (node_silent: a partition, a frozen
    agent, a node reaching a new leader after its takeover grace once every coordinator was down;
    a straggler is drained instead), so the node is alive and its ranks hold: the job re-forms with
    them (their state from the most advanced rank). Not while the job finishes, nor into another
    run of the job: its ranks would run the script again. False: the agent is done, its exit code set."""
    c, run = node.config, node.session.joined_run
    if rejoins > MAX_REJOINS or node.finishing() or node.done():
        node.log.error("node_evicted", reason=str(evicted))
        node.finish(EXIT_FAILED)
        return False
    node.log.warning("node_rejoining", reason=str(evicted), member=node.session.member_id,
                     message="the leader no longer counts this node as a member: joining again, its ranks held")
    try:
        await node.session.join(retry_for_s=c.join_timeout_s)
    except (grpc.aio.AioRpcError, TimeoutError) as exc:
        error = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
        node.log.error("rejoin_failed", error=error)
        say(f"node {c.node_id!r} was removed from job {c.job!r} ({evicted}) and could not join again: {error}")
        node.finish(EXIT_FAILED)
        return False
    if node.session.joined_run != run:
        node.log.error("rejoin_into_new_run", run=run, new_run=node.session.joined_run)
        say(f"run {run} of job {c.job!r} ended while node {c.node_id!r} was out of it: it leaves run "
            f"{node.session.joined_run} at once (its ranks would run the script again)")
        try:
            await node.session.leave(immediate=True, reason=f"run {run} ended while this node was out of it")
        except Exception as exc:  # the leader sees the node go silent instead
            node.log.warning("leave_failed", error=str(exc))
        node.finish(EXIT_FAILED)
        return False
    for slot in node.slots:
        slot.kept_pid = slot.proc.pid if slot.alive else 0
    return True
