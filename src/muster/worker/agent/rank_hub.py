"""The agent's hub of its library ranks: each rank's stream over the agent's Unix socket (a
stream speaks for its own slot and process only: the secret handed to that process, its pid),
the leader's directives fanned out to them, and the node's frame aggregated from their reports
and from the processes themselves."""

from __future__ import annotations

import asyncio
import hmac

import grpc

from muster.v1 import muster_pb2 as pb
from muster.v1 import muster_pb2_grpc as pb_grpc
from muster.worker.link import immediate
from muster.worker.rank_link import SLOT_SECRET_ENV, SLOT_SECRET_METADATA
from muster.worker.agent.slot import Slot, crash_answered, process_state
from muster.worker.agent.supervisor import Node


class RankHub(pb_grpc.NodeAgentServicer):
    def __init__(self, node: Node):
        self.node = node
        self.queues: dict[asyncio.Queue, Slot] = {}  # each connected library rank's directives

    def deliver(self, d: pb.Directive) -> None:
        """A directive of the leader, to every library rank it is for."""
        for q, slot in self.queues.items():
            if _for_rank(d, slot):
                q.put_nowait(_group_gone(d) if slot.kept and d.HasField("assignment") else d)

    def reports(self) -> list[pb.RankReport]:
        """The node's frame: one report per slot, from its rank's stream or from its process."""
        node = self.node
        now = asyncio.get_running_loop().time()
        a = node.assignment
        if a is not None and a.start_ranks and not all(
                node.slots[s].connected for s in a.down_local_ranks if not node.slots[s].retired):
            return []  # starting: report the node's ranks together, so they enter the map in one generation
        reports = []
        for slot in node.slots:
            if slot.finished or slot.outrun:
                # The job is finishing, not failing (a drained rank's end is the drain's). A coordinator
                # that predates runs (JoinResponse.run 0) refuses the state: it is told nothing, as then.
                if node.session.joined_run and not node.draining:
                    reports.append(pb.RankReport(local_rank=slot.index, pid=slot.proc.pid, state=pb.RANK_STATE_FINISHED))
                continue
            if slot.failed_pid and slot.connected and not slot.stopping:
                # Its replacement is up, but no leader has answered the crash yet (an outage, a
                # failover): the slot still speaks of the dead process, so that the next leader
                # learns of the exit even if the report went down with the old one.
                reports.append(pb.RankReport(local_rank=slot.index, pid=slot.failed_pid, state=pb.RANK_STATE_EXITED))
            elif slot.connected and slot.report is not None:
                r = pb.RankReport()
                r.CopyFrom(slot.report)
                if _runnable(slot.proc.pid):
                    # Its process runs: a rank whose Python thread is held off the GIL by a long C++
                    # call (NCCL init or abort, a long kernel) is not silent; a deadlock shows as a stall.
                    slot.heard_at = now
                r.heard_ms_ago = int((now - slot.heard_at) * 1000)
                reports.append(r)
            elif slot.alive and not node.library:  # its steps, if its probe measures them, never judged for stalls
                step, step_time_us, compute_us = slot.steps.read() if slot.steps is not None else (0, 0, 0)
                reports.append(pb.RankReport(local_rank=slot.index, pid=slot.proc.pid, state=pb.RANK_STATE_UNMONITORED,
                                             step=step, step_time_us=step_time_us, compute_us=compute_us,
                                             generation=slot.generation,  # its recovery is over once it steps
                                             steps_unmeasured=slot.steps is None))  # (or, unmeasured, runs)
            elif slot.restarting:  # until its replacement starts: the job is to re-form with the slot
                reports.append(pb.RankReport(local_rank=slot.index, pid=slot.failed_pid, state=pb.RANK_STATE_RESTARTING,
                                             generation=slot.crashed_in))
            elif slot.failed_pid and not slot.stopping:  # crashed, or its replacement is not connected yet
                reports.append(pb.RankReport(local_rank=slot.index, pid=slot.failed_pid, state=pb.RANK_STATE_EXITED))
        for r in reports:  # whatever speaks for the slot, its agent counts its restarts
            r.restarts = node.slots[r.local_rank].restarts
        return reports

    async def RankSession(self, request_iterator, context):
        node = self.node
        presented = dict(context.invocation_metadata() or ()).get(SLOT_SECRET_METADATA, "")
        first = await anext(request_iterator, None)
        if first is None or first.local_rank >= len(node.slots):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "first report must name a local_rank of this node")
        slot = node.slots[first.local_rank]
        if not slot.alive or slot.proc.pid != first.pid:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"pid {first.pid} is not the process of slot {first.local_rank}")
        # The pid is self-reported: any process of the same user could name it. The secret was
        # handed to that process alone, in its environment at its start.
        if not hmac.compare_digest(slot.secret.encode(), presented.encode()):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"this stream does not carry the {SLOT_SECRET_METADATA} of slot {first.local_rank}'s "
                                f"process (the agent sets it in that process's environment, {SLOT_SECRET_ENV})")
        loop = asyncio.get_running_loop()
        slot.report, slot.heard_at, slot.connected = first, loop.time(), True
        if slot.failed_pid and crash_answered(node.assignment, slot):
            slot.failed_pid = 0  # the replacement speaks for the slot now: the leader places it at its next
            node.session.send_now()  # tally, not a frame interval later
        node.library = True
        queue: asyncio.Queue = asyncio.Queue()
        for a in told_on_connect(node.assignment, node.base, slot, first.generation):
            current = pb.Directive(term=node.session.term, generation=a.generation, assignment=a)
            if _for_rank(current, slot):
                queue.put_nowait(current)
        if node.drain is not None:
            queue.put_nowait(pb.Directive(term=node.session.term, drain=node.drain))
        self.queues[queue] = slot

        async def read() -> str:
            """Why the stream is refused ("": it ended): it speaks for its own slot and process only."""
            async for report in request_iterator:
                if report.local_rank != first.local_rank or report.pid != first.pid:
                    return (f"a report for local_rank {report.local_rank} pid {report.pid} on the stream of "
                            f"local_rank {first.local_rank} pid {first.pid}")
                # Connected again: a refused stream's end (below) may have said otherwise meanwhile.
                slot.report, slot.heard_at, slot.connected = report, loop.time(), True
            return ""

        reader = asyncio.create_task(read())
        try:
            while not reader.done():
                getter = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait([getter, reader], return_when=asyncio.FIRST_COMPLETED)
                if getter in done:
                    yield getter.result()
                else:
                    getter.cancel()
            if not reader.cancelled() and reader.exception() is None and reader.result():
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, reader.result())
        finally:
            reader.cancel()
            self.queues.pop(queue, None)
            if slot.report is not None and slot.report.pid == first.pid:
                slot.connected = False


def told_on_connect(latest: pb.Assignment | None, base: pb.Assignment | None, slot: Slot,
                    ran: int) -> list[pb.Assignment]:
    """The maps a rank that connects is told: the current one, and first the map formed at once that
    a pending planned switch leaves (`base`), where that places the slot and the rank never ran it
    (`ran`: the generation of its first report): its peers wait for it there and train in it up to
    the switch. Told the planned map alone, it would form that at once and wait there for them
    (the leader's side of this: `Streams.attach`)."""
    if latest is None:
        return []
    if (base is None or immediate(latest) or base.generation >= latest.generation or ran >= base.generation
            or slot.kept or base.role != pb.ROLE_ACTIVE or slot.index not in base.local_ranks):
        return [latest]
    return [base, latest]


def _for_rank(d: pb.Directive, slot: Slot) -> bool:
    """A replacement process is no member of the generation its predecessor crashed in (nor of an
    older one): while no coordinator has answered the crash (an outage), it waits for a newer one
    instead of trying to join a group whose others have long formed. A process kept across its
    node's rejoin is not told that its slot awaits a process (it would take itself for failed)."""
    if not d.HasField("assignment"):
        return True
    a = d.assignment
    return a.generation > slot.crashed_in and not (slot.kept and a.start_ranks and slot.index in a.down_local_ranks)


def _group_gone(d: pb.Directive) -> pb.Directive:
    """The assignment as a process kept across its node's rejoin reads it: its group is gone (the
    leader removed the node it could not hear, and the others aborted that group), so it leaves
    the group at once (abort_previous) instead of stepping on in it to a planned switch. A
    collective it is in may never end otherwise: a gloo wait on a pair its peer closed during the
    partition was seen to outlast the leader's stall timeout."""
    gone = pb.Directive()
    gone.CopyFrom(d)
    gone.assignment.abort_previous = True
    return gone


def _runnable(pid: int) -> bool:
    """The process exists and is neither stopped (SIGSTOP, a debugger) nor a zombie."""
    return process_state(pid) not in (None, "T", "t", "Z", "X")
