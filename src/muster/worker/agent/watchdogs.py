"""The node agent's two watchdogs: nothing waits in silence, and nothing waits forever."""

from __future__ import annotations

import asyncio

from muster.v1 import muster_pb2 as pb
from muster.worker.outcome import EXIT_FAILED
from muster.worker.agent.supervisor import Node, say
from muster.worker.agent.waiting import waiting_for

async def watch_coordinator(node: Node) -> None:
    """Hold while no coordinator answers (an etcd or coordinator outage must not cost the ranks),
    but not forever: past the hold timeout the agent exits, and its ranks with it."""
    warned = False
    while not node.done():
        await asyncio.sleep(1.0)
        silent_s = node.session.silent_s()
        if silent_s > 2 * node.session.heartbeat_timeout_s and not warned:
            warned = True
            node.log.warning("coordinator_unreachable", silent_s=round(silent_s, 1),
                             hold_timeout_s=node.config.hold_timeout_s, coordinators=list(node.config.coordinators))
        elif silent_s <= node.session.heartbeat_timeout_s and warned:
            warned = False
            node.log.info("coordinator_reachable")
        if silent_s > node.config.hold_timeout_s:
            node.log.error("hold_expired", silent_s=round(silent_s, 1), hold_timeout_s=node.config.hold_timeout_s,
                           message=f"no coordinator answered for {silent_s:.0f}s; giving up with the ranks")
            node.finish(EXIT_FAILED)


async def watch_place(node: Node) -> None:
    """Nobody waits in silence: while the node has no place in a generation, say what it waits
    for (after a second, then every wait_report_s); past --form-timeout give up. A hot spare
    waits on (a failure elsewhere promotes it, the end of the run ends it: JobEnd)."""
    c = node.config
    loop = asyncio.get_running_loop()
    idle: float | None = None  # without a place in a generation since
    since: float | None = None  # ...and not a spare either: the form timeout counts from here
    reported_at: float | None = None
    spare_said = False
    while not node.done():
        await asyncio.sleep(0.25)
        a = node.assignment
        now = loop.time()
        if node.draining or (a is not None and a.role == pb.ROLE_ACTIVE):
            idle = since = reported_at = None
            spare_said = False
            continue
        # A node whose ranks started before it had a place (start_ranks) and all report waits like
        # a spare: it enters at the next switch, or stays a spare when the map is full.
        ready = a is not None and a.start_ranks and all(
            node.slots[i].connected or node.slots[i].retired for i in a.down_local_ranks)
        spare = a is not None and ((a.role == pb.ROLE_SPARE and not a.start_ranks) or ready)
        idle = now if idle is None else idle
        since = None if spare else now if since is None else since  # a spare has its place
        due = now - idle >= 1.0 if reported_at is None else now - reported_at >= c.wait_report_s
        if due and spare:
            reported_at = now
            if not spare_said:
                spare_said = True
                node.log.info("waiting", role="spare", message=f"hot spare: waiting for a place (generation "
                              f"{a.generation} has world size {a.world_size}; a failure or the next switch "
                              "promotes this node)")
        elif due:
            reported_at = now
            what = await waiting_for(node.config, node.assignment)
            node.log.info("waiting", message=what, waited_s=round(now - since, 1), form_timeout_s=c.form_timeout_s)
        if since is not None and now - since > c.form_timeout_s:
            what = await waiting_for(node.config, node.assignment)
            node.log.error("form_timeout", form_timeout_s=c.form_timeout_s, message=what)
            say(f"no place in job {c.job!r} for node {c.node_id!r} within {c.form_timeout_s:g}s "
                 f"(--form-timeout): {what}")
            try:
                await node.session.leave(immediate=True, reason="no place within --form-timeout", retry_for_s=5)
            except Exception as exc:
                node.log.warning("leave_failed", error=str(exc))
            node.finish(EXIT_FAILED)
            return
