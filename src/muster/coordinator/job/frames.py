"""A node's Session stream as its job's leader reads it: who may join or open one (the member, with
its secret) and what its frames say. A frame is validated completely before liveness records it;
what needs a decision (an exit, a slot back, a script done) becomes an event for the tally."""

from __future__ import annotations

import signal
from collections.abc import Callable

from muster.coordinator import wire
from muster.coordinator.claims import check_rejoin, secret_hash
from muster.coordinator.core.kinds import FailureKind
from muster.coordinator.core.liveness import Liveness
from muster.coordinator.core.exits import HOLD_OUT_FAILURES, HOLD_OUT_WINDOW_S, error_digest
from muster.coordinator.core.machine import STATE_LOST as STATE_LOST_KIND
from muster.coordinator.core.machine import (Finishing, Leave, MembershipEvent, NodeFault, NodeLost, Regroup,
                                             SlotDown, SlotError, SlotsUp, Verdict, run_ended)
from muster.coordinator.core.policy import JobSpec
from muster.coordinator.core.state import JobState, Member, NodeKind
from muster.coordinator.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from muster.coordinator.job.leader_stats import LeaderStats
from muster.coordinator.job.streams import NodeStream
from muster.v1 import muster_pb2 as pb

# A rank's exit error naming these (muster.worker.errors) ends the run at once: no tier held
# its state, and its restart would form from `build` at step 0
STATE_LOST = ("StateLost: ", "ShardLost: ")
# ...and so does this refusal, deterministic by construction: the same script meets it at every restart
REFUSED = "ShardedStateRefused: "
# A rank's death by these is its own process's fault (a bad GPU or memory shows so too); SIGKILL,
# SIGTERM and SIGINT come from outside it (the OOM killer, an operator) and say nothing of its node.
CRASH_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT})
# ...and these errors are the worker library's answers to the job's decisions or a lost coordinator
DECIDED = ("FencedOut: ", "HoldExpired: ", "CoordinatorLost: ", "Drained: ", "RunEnded: ", "Evicted: ")


def check_joinable(state: JobState, requested: JobSpec) -> None:
    """A node joins the job as it exists: the sizes it asks for are the job's (unless its spec was lost)."""
    for name in ("min_nodes", "max_nodes", "world_size_multiple", "straggler_action", "straggler_factor",
                 "straggler_min_steps", "on_state_lost"):
        want = getattr(requested, name)
        if want and want != getattr(state.spec, name) and not state.spec_lost:
            raise FailedPrecondition(
                f"job {state.job!r} exists with {name}={getattr(state.spec, name)}; this node asks for {want}"
            )


def member_of(state: JobState, node_id: str, member_id: int) -> Member:
    member = state.member(node_id)
    if member is None and state.ended:
        # Its run ended as it left (the record not yet written): "join first" would make a new run
        raise run_ended(state)
    if member is None:
        raise NotFound(f"node {node_id!r} is not a member of job {state.job!r}: join first")
    if member.member_id != member_id:
        raise FailedPrecondition(
            f"member {member_id} of node {node_id!r} is stale (current member {member.member_id}); "
            "it was evicted or replaced: rejoin"
        )
    return member


def authenticate(member: Member, secret: bytes) -> None:
    """Only the node that joined as this member holds its secret: a stranger who guessed the
    member_id may not replace its stream or make it leave."""
    if not member.admits(secret_hash(secret)):
        presented = "presented another secret" if secret else "presented none"
        raise PermissionDenied(f"node {member.node_id!r} did not present the session secret of member "
                               f"{member.member_id} ({presented}); only the node that joined as it may use it")


def check_first(first: pb.NodeFrame, state: JobState) -> None:
    """A session's first frame, before the leader looks its node up."""
    wire.check_node(first.node_id)
    check_rejoin(first)
    if first.run and first.run != state.run:
        raise FailedPrecondition(f"run {first.run} of job {state.job!r} has ended; the job's name runs run "
                                 f"{state.run} now")


def admit(first: pb.NodeFrame, state: JobState, current: NodeStream | None) -> Member:
    """The member a session's first frame opens a stream for (`current`: the node's stream now)."""
    member = member_of(state, first.node_id, first.member_id)
    authenticate(member, first.session_secret)
    if (current is not None and current.member_id == member.member_id and first.stream_seq
            and current.seq > first.stream_seq):
        # A first frame a relay still held from before the node moved on: the newer stream stays.
        raise FailedPrecondition(f"stream {first.stream_seq} of node {member.node_id!r} is stale: "
                                 f"its stream {current.seq} is newer")
    return member


class FrameReader:
    """Every frame of one job's streams, under one leader's term."""

    def __init__(self, term: int, live: Liveness, stats: LeaderStats, clock: Callable[[], float],
                 wall: Callable[[], float]):
        self.term = term
        self.live = live
        self.stats = stats
        self._clock, self._wall = clock, wall
        self._finishing_asked = False

    def read(self, stream: NodeStream, frame: pb.NodeFrame, state: JobState) -> list[MembershipEvent]:
        """Validate one frame completely, then record it; the events it calls for."""
        if frame.job != stream.job or frame.node_id != stream.node_id or frame.member_id != stream.member_id:
            raise InvalidArgument("every frame of a session must carry the job, node_id and member_id of its first")
        member = member_of(state, frame.node_id, frame.member_id)
        # The hot path: a frame that only advances steps is read for three fields a rank.
        fast = (frame.steps_only and not frame.exits and stream.local_ranks is not None
                and len(frame.ranks) == len(stream.local_ranks))
        steps = wire.frame_steps(frame) if fast else None
        reports = None if fast else wire.check_frame_ranks(frame, member)
        if frame.term > max(self.term, stream.term_ahead):
            # Not trusted blindly (a bad client could depose the leader): were this leader stale,
            # its session and fenced writes would tell it.
            raise FailedPrecondition(f"frame term {frame.term} is ahead of this leader's term {self.term}")
        if frame.generation > state.generation:
            raise FailedPrecondition(
                f"frame generation {frame.generation} is ahead of the job's generation {state.generation}"
            )
        now = self._clock()
        self.stats.framed()
        vouch = stream.link.vouch if stream.link is not None else None
        vouched = vouch is not None
        if fast:
            if self.live.advance(member.node_id, frame.generation, stream.local_ranks, steps, now, vouched=vouched,
                                 vouch=vouch):
                self.stats.stepped(self.live.nodes[member.node_id].top_step)
                return []
            reports = wire.check_frame_ranks(frame, member)  # not the ranks it had: read it all
        if frame.exits:
            self.stats.signalled(now)
        events: list[MembershipEvent] = []
        if reached := self.stats.reported(member.node_id, frame, now):
            last = f" (the last one lost: {self.stats.last_exit})" if self.stats.last_exit else ""
            events.append(Verdict(member.node_id, f"the job's ranks began again at step 0 with nothing "
                                                  f"restored, after it had reached step {reached}: "
                                                  f"every rank that held the training state was lost{last}, and no "
                                                  "checkpoint held it (muster run --checkpoint-dir)",
                                  STATE_LOST_KIND))
        if not self._finishing_asked and not state.frozen:
            done = next((r for r in reports if r.state == "finished"), None)
            if done is not None:
                self._finishing_asked = True
                events.append(Finishing(member.node_id, f"local rank {done.local_rank} (pid {done.pid}) of node "
                                                        f"{member.node_id!r} completed its script: the job is ending"))
        recovered = self.live.observe(member.node_id, frame.generation, reports, now, vouched=vouched, vouch=vouch)
        self.stats.stepped(self.live.nodes[member.node_id].top_step)
        stream.local_ranks = tuple(r.local_rank for r in reports)
        if frame.exits:
            events += self._exits(member, frame, state)
        if recovered:
            events.append(SlotsUp(member.node_id, tuple(recovered)))
        return events

    def _exits(self, member: Member, frame: pb.NodeFrame, state: JobState) -> list[MembershipEvent]:
        rm = state.rank_map
        placement = rm.placement(member.node_id) if rm else None
        events: list[MembershipEvent] = self._held_out(member, frame, state)
        for e in frame.exits:
            how = f"killed by signal {-e.exit_code}" if e.exit_code < 0 else f"exit code {e.exit_code}"
            rank = f"rank {placement.rank_of(e.local_rank)} " if placement and e.local_rank in placement.slots else ""
            who = f"{rank}(node {member.node_id!r}, local rank {e.local_rank})"
            where = f"in step {e.step}" if e.step else "before any step it reported"
            repeated = False
            if not e.error.startswith((*STATE_LOST, REFUSED)):  # (ends of their own, below)
                digest = error_digest(e.error)
                repeated = self.live.exits.repeated(member.node_id, e.local_rank, e.pid, digest, e.step)
                events.append(SlotError(member.node_id, e.local_rank, digest, e.step, e.pid))
            if e.error.startswith(STATE_LOST):  # the worker library's StateLost (ShardLost): no tier holds the state
                events.append(Verdict(member.node_id, f"{who} {where}: {e.error}", STATE_LOST_KIND))
            elif e.error.startswith(REFUSED):
                events.append(Verdict(member.node_id, f"{who} {where}, refused as every restart would be: {e.error}"))
            elif repeated:
                events.append(Verdict(member.node_id, f"{who} failed again {where} with the same error after a "
                                                      f"restart: {e.error}"))
            elif at_start := self.live.all_at_start(member.node_id, e.local_rank, e.error, e.step, state):
                generation, ranks = at_start
                events.append(Verdict(member.node_id, f"every rank of generation {generation} ({ranks}) failed "
                                                      f"{where if e.step else 'before any step'} with the same "
                                                      f"error: {e.error}"))
            if e.error:
                how += f": {e.error}"
            self.stats.last_exit = f"{who}{' ' + where if e.step else ''}, {how}"
            if member.kind is NodeKind.PROCESS:
                events.append(NodeLost(member.node_id, FailureKind.PROCESS_EXITED, f"pid {e.pid} {how}"))
            elif e.restarting and placement is not None and e.local_rank in placement.slots:
                # Restart semantics (a script without the library): the job re-forms once, with the
                # replacement in the same place. A node still on an older generation is restarted by
                # the newer map already: its rank's exit is no new fault.
                if frame.generation == state.generation:
                    events.append(Regroup(FailureKind.RANK_RESTARTED, f"local rank {e.local_rank}: pid {e.pid} "
                                          f"{how}; its agent restarts it in place", (member.node_id,)))
            else:
                self.live.exits.mark_failed(member.node_id, e.local_rank, e.pid)
                events.append(SlotDown(member.node_id, e.local_rank, FailureKind.RANK_EXITED, f"pid {e.pid} {how}"))
        return events

    def _held_out(self, member: Member, frame: pb.NodeFrame, state: JobState) -> list[MembershipEvent]:
        """A Leave (at once) of a node whose ranks failed of their own fault (an error, a
        crash signal) HOLD_OUT_FAILURES times within the window while no other node's did, unless the
        job would fall below min_nodes: its restarts would only fail the job's reforms again. (A
        script's peers that die of its fault fail too: no node is held out then.) Each such failure
        is kept with the member too (`NodeFault`): a new leader counts on from it."""
        own = [e for e in frame.exits
               if e.error and not e.error.startswith(DECIDED) or not e.error and -e.exit_code in CRASH_SIGNALS]
        if not own or state.frozen:
            return []
        at_ms = int(self._wall() * 1000)
        for e in own:
            count = self.live.exits.node_fault(member.node_id, at_ms, (m.node_id for m in state.members))
        events: list[MembershipEvent] = [NodeFault(member.node_id, at_ms)] * len(own)
        if count < HOLD_OUT_FAILURES or len(state.members) - 1 < state.spec.min_nodes:
            return events
        last = e.error or f"killed by signal {-e.exit_code}"
        return events + [Leave(member.node_id, True, f"held out: its ranks failed {count} times within "
                                                     f"{HOLD_OUT_WINDOW_S:g} s while no other node's did "
                                                     f"(the last: {last})")]
