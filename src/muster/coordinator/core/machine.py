"""The generation state machine: (state, events, context) -> decision, with reasons.

Events of one tally are folded into at most one new generation. Unplanned changes (a rank
or node lost) publish g+1 marked "abort g"; planned ones (join, graceful leave, a slot
coming back) publish g+1 with a future `switch_at_step`. A leader that found no state (etcd
lost it) takes back the nodes that say they were members, then re-forms them all in one generation
above theirs: a planned switch where they all ran one generation, whole; an abort otherwise. No I/O, no clock reads.
"""

from __future__ import annotations

import math
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass, field, replace

from muster.coordinator.core.exits import HOLD_OUT_FAILURES
from muster.coordinator.core.kinds import FailureKind
from muster.coordinator.core.policy import MAX_NODES, MAX_STEP, InvalidPolicy, JobSpec, Timing
from muster.coordinator.core.rankmap import assign_ranks, excluded_ranks, rank0_address
from muster.coordinator.core.state import Event, JobState, Member, NodeKind, Outcome, Phase, RankMap
from muster.coordinator.errors import (AlreadyExists, FailedPrecondition, InvalidArgument, MusterError, NotFound,
                                       PermissionDenied, ResourceExhausted, RunEnded, Unavailable)


EVENT_NODES_MAX = 32  # nodes named in a generation event
# What a node may claim to have run while a lost state is rebuilt, below: a generation (or a join) a
# second for 136 years. A proven claim is bounded tighter at the edge (`claims`); an unproven one (no
# proof key) near MAX_GENERATION published a generation every library rank's frame is refused for, so
# the job keeps at least MAX_GENERATION - 2^32 generations to go.
MAX_CLAIMED = 2**32


@dataclass(frozen=True)
class Join:
    node_id: str
    host: str
    store_port: int
    slots: int
    kind: NodeKind = NodeKind.AGENT
    master_port: int = 0
    secret_hash: str = ""  # of the session secret the edge made for this member (never the secret)
    spec: JobSpec | None = None  # what the node asks for: adopted only while the job's spec is lost
    ticket: int = field(default=0, compare=False)  # its request's number (`Request`)


@dataclass(frozen=True)
class Rejoin:
    """A node that is no member streams as the member it was (etcd lost the job's state): while
    the leader rebuilds, it is taken back with its member_id (its seniority), the hash of the
    secret it presents and the generation it runs."""

    node_id: str
    member_id: int
    generation: int
    secret_hash: str
    host: str
    store_port: int
    slots: int
    kind: NodeKind = NodeKind.AGENT
    master_port: int = 0
    spec: JobSpec | None = None
    # When the run its secret proved it a member of started (`claims`; 0: unproven). A proven claim
    # keeps its seniority, and outranks a run made anew under the same number since.
    run_started_ms: int = 0
    world_size: int = 0  # of the generation it runs, and its own ranks in it (0: not said)
    local_world_size: int = 0
    ticket: int = field(default=0, compare=False)  # its request's number (`Request`)

    @property
    def proven(self) -> bool:
        return self.run_started_ms > 0


@dataclass(frozen=True)
class Leave:
    node_id: str
    immediate: bool
    reason: str
    finished: bool = False  # the job is ending: the others finish too, nothing to reform
    ticket: int = field(default=0, compare=False)  # its request's number (`Request`)


@dataclass(frozen=True)
class NodeLost:
    """The whole node is gone (silence, its process exited, its stream closed)."""

    node_id: str
    kind: FailureKind  # node_silent | process_exited | ...
    reason: str


@dataclass(frozen=True)
class SlotDown:
    """One rank of a node failed (exit, silence, stall); the node stays a member."""

    node_id: str
    slot: int
    kind: FailureKind  # rank_exited | rank_silent | rank_stalled
    reason: str


@dataclass(frozen=True)
class SlotsUp:
    node_id: str
    slots: tuple[int, ...]


@dataclass(frozen=True)
class Diverged:
    """Replicas hold different parameters: recorded in the history (no membership change)."""

    nodes: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class Straggling:
    """Ranks of a node compute persistently slower than the job's: recorded in the history (no
    membership change; under `replace` a Leave of the node follows)."""

    node_id: str
    reason: str


@dataclass(frozen=True)
class Regroup:
    """The running group is broken though nobody is found failed (its ranks hold after a failed
    collective, or it did not form in time), or a rank of a script without the library is being
    restarted in place by its agent: the same members re-form in an abort generation."""

    kind: FailureKind  # group_broken | group_not_formed | rank_restarted
    reason: str
    nodes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Finishing:
    """A rank of the node completed its script: the job is ending, nothing re-forms it any more."""

    node_id: str
    reason: str


@dataclass(frozen=True)
class Stop:
    """An operator stops the job: every node drains at one step, and the run ends `stopped`."""

    reason: str
    ticket: int = field(default=0, compare=False)  # its request's number (`Request`)


@dataclass(frozen=True)
class Verdict:
    """A fault that repeats (a slot's process failed with the same error at the same step as the one
    before it): restarting it again would only loop, so the run ends failed with this reason. Or
    (`kind`) a rank's training state lost beyond every tier: a restart would train from step 0."""

    node_id: str
    reason: str
    kind: str = "a fault that repeats"


STATE_LOST = "training state lost beyond every tier"  # Verdict.kind of a rank's StateLost
STATE_LOST_EVENT = "state_lost"  # the event a job whose spec says on_state_lost=restart notes instead


@dataclass(frozen=True)
class NodeFault:
    """A rank of the node failed of its own fault at `at_ms` (wall): kept with its member
    (`Member.faults_ms`), so that a new leader counts on toward holding the node out. No membership
    change: the exit's own event is that."""

    node_id: str
    at_ms: int


@dataclass(frozen=True)
class SlotError:
    """A process of the slot failed of `digest` (its error's, `exits.error_digest`; "": no error known,
    a streak broken) in `step`: kept with its member (`Member.last_errors`), so that a new leader
    still knows a restart that fails the same way as a repeat. No membership change either."""

    node_id: str
    local_rank: int
    digest: str
    step: int
    pid: int


@dataclass(frozen=True)
class Tick:
    """Nothing happened but time passed (forming and waiting deadlines)."""


MembershipEvent = (Join | Rejoin | Leave | NodeLost | SlotDown | SlotsUp | Diverged | Straggling | Regroup | Finishing
                   | NodeFault | SlotError | Stop | Verdict | Tick)
# The events a request waits on, the only ones `decide` refuses: each carries its request's ticket, a
# number the inbox gives it (0: nobody waits), so that a refusal reaches its request wherever the
# event stands in the batch.
Request = Join | Rejoin | Leave | Stop


@dataclass(frozen=True)
class Context:
    now: float  # monotonic seconds
    wall_ms: int  # for the history
    term: int
    timing: Timing
    max_step: int = 0  # highest completed step in the current generation (projected to `now` by the leader)
    step_time_s: float | None = None  # median step time, to turn switch_lead_s into steps
    # The running ranks use the worker library: an agent node joining the running job starts its
    # ranks first and takes a place once they report, so the others never wait for its start-up.
    prestart: bool = False
    max_members: int = MAX_NODES  # the job's members quota, spares included (`Limits.members_of`)
    step_lag_s: float = 0.0  # how far behind the ranks `max_step` may be (relays forward progress now and then)
    # Nodes of the map whose ranks never formed a group (`Assessment.unformed`), asked only as the job finishes
    unformed: frozenset[str] = frozenset()
    high_step: int = 0  # the highest step the job's ranks reported (`LeaderStats.high_step`): where a run ended


@dataclass(frozen=True)
class Decision:
    state: JobState
    persist: bool  # membership or map changed: write it (fenced) before acting
    new_generation: bool
    events: tuple[Event, ...]  # appended to the history
    evicted: tuple[tuple[str, int], ...] = ()  # (node_id, member_id) fenced out
    drains: tuple[tuple[str, int], ...] = ()  # (node_id, after_step) leaving at a step boundary
    joined: tuple[Member, ...] = ()
    rejected: Mapping[int, MusterError] = field(default_factory=dict)  # ticket -> why: nothing of it applied
    ended: bool = False  # this decision ended the run (its outcome is in `state`)


@dataclass
class _Fold:
    """What `decide` gathers over a batch of events: the members, the job's counters and flags as
    they change, and what to tell (events, evictions, joins, refusals by ticket)."""

    state: JobState
    ctx: Context
    members: dict[str, Member]
    in_map: Container[str]  # nodes of the running map: a change to them needs a new generation
    next_seq: int
    generation: int
    spec: JobSpec
    spec_lost: bool
    finishing: bool
    failure: str
    rebuilding: bool
    started_ms: int
    stop: Stop | None = None
    claims: dict[str, tuple[str, int, int, int]] = field(default_factory=dict)  # JobState.rebuild_claims
    verdict: str = ""  # a fault that repeats, or state lost: the run ends failed with it (`Verdict`)
    departed: str = ""  # how the last member to go went: "left", "left_now" (immediate) or "lost"
    log: list[Event] = field(default_factory=list)
    evicted: list[tuple[str, int]] = field(default_factory=list)
    leaving: list[str] = field(default_factory=list)
    joined: list[Member] = field(default_factory=list)
    rejected: dict[int, MusterError] = field(default_factory=dict)  # by the request's ticket
    unplanned: bool = False  # a change that aborts the running group
    planned: bool = False  # a change the group can switch to at a step
    changed: bool = False  # something to persist
    regroup: bool = False  # the same members, a group to form anew

    @classmethod
    def of(cls, state: JobState, ctx: Context) -> _Fold:
        # The map's own index (made once per map), not a set of 125k ids made per decision.
        in_map = state.rank_map.by_node if state.rank_map and state.phase is Phase.RUNNING else {}
        return cls(state, ctx, dict(state.members_by_node), in_map, state.next_seq, state.generation,
                   state.spec, state.spec_lost, state.finishing, state.failure, state.rebuilding, state.started_ms,
                   claims={c[0]: c for c in state.rebuild_claims})

    def note(self, kind: str, reason: str, *nodes: str) -> None:
        self.log.append(Event(self.state.generation, self.ctx.term, self.ctx.wall_ms, kind, reason, tuple(nodes)))

    def fail(self, failure: str) -> None:
        """The run fails as it finishes (the first cause is kept)."""
        self.failure = self.failure or failure


def _on_rejoin(f: _Fold, ev: Rejoin) -> None:
    current = f.members.get(ev.node_id)
    if (f.rebuilding and current is not None and current.member_id == ev.member_id
            and current.admits(ev.secret_hash)):
        return  # the same incarnation again, from a second stream: nothing new
    if _made_anew(f, ev):
        f.note("state_made_anew", f"node {ev.node_id!r} proved it was member {ev.member_id} of this run as it ran "
                                  f"before etcd lost it: the members of the run made anew give way, and the job is "
                                  f"rebuilt from its nodes", *list(f.members)[:EVENT_NODES_MAX])
        for held in list(f.members.values()):
            _displace(f, held)
        f.rebuilding = f.spec_lost = f.changed = True
    refusal, displaced = _rejoin_refusal(f, ev)
    if refusal is None:
        f.spec, f.spec_lost, refusal = _restored_spec(f.spec, f.spec_lost, ev.spec)
    if refusal is not None:
        f.rejected[ev.ticket] = refusal
        return
    for held in displaced:
        f.note("member_displaced", f"member {held.member_id} ({held.node_id!r}) gave way to the proven claim of "
                                   f"member {ev.member_id} ({ev.node_id!r})", held.node_id)
        _displace(f, held)
    if ev.proven:
        f.started_ms = ev.run_started_ms  # the run the nodes ran, whenever this leader's state began
    # A proven claim keeps its age (its member id); an unproven one is as old as its claim: a claim of
    # member 1 may not take rank 0 (and the job's store) from the nodes that came back before it.
    seq = ev.member_id if ev.proven else f.next_seq
    f.members[ev.node_id] = Member(ev.node_id, ev.member_id, ev.host, ev.store_port, ev.slots, seq, ev.kind,
                                   master_port=ev.master_port, secret_hash=ev.secret_hash, proven=ev.proven)
    f.joined.append(f.members[ev.node_id])
    f.claims[ev.node_id] = (ev.node_id, ev.generation, ev.world_size, ev.local_world_size)
    f.next_seq = max(f.next_seq + (not ev.proven), ev.member_id + 1)
    f.generation = max(f.generation, ev.generation)
    f.changed = True


def _made_anew(f: _Fold, ev: Rejoin) -> bool:
    """The running state is a run made anew under the proven claim's run number (etcd lost the job,
    and a Join made it again before its nodes came back): young, and started at another moment."""
    return (not f.rebuilding and ev.proven and not f.finishing and not f.state.ended
            and ev.run_started_ms != f.started_ms and f.ctx.wall_ms - f.started_ms <= f.ctx.timing.grace_s * 1000)


def _displace(f: _Fold, held: Member) -> None:
    """A member gives way to a proven claim: it joins again as a new member (told FAILED_PRECONDITION)."""
    del f.members[held.node_id]
    f.evicted.append((held.node_id, held.member_id))
    f.changed = True


def _join_refusal(f: _Fold, ev: Join) -> MusterError | None:
    state, ctx = f.state, f.ctx
    if state.ended:
        return Unavailable(f"run {state.run} of job {state.job!r} has ended ({state.outcome.value}) and its nodes "
                           f"are draining; a join starts run {state.run + 1} once they are gone")
    if state.rebuilding and f.spec_lost:
        # etcd lost the job itself: its nodes restore its spec and ranks (a Join first would make
        # them its spares, and its host the job's store), then joins go on as usual.
        return Unavailable(f"job {state.job!r} is being rebuilt from its nodes after etcd lost it; join again "
                           f"in {ctx.timing.grace_s:g}s")
    if ev.node_id in f.members:
        return AlreadyExists(f"node {ev.node_id!r} is already a member of job {state.job!r} "
                             f"(member {f.members[ev.node_id].member_id}); leave first or use another node id")
    if len(f.members) >= ctx.max_members:
        return _members_quota(state, len(f.members), ctx)
    return None


def _members_quota(state: JobState, members: int, ctx: Context) -> ResourceExhausted:
    return ResourceExhausted(f"job {state.job!r} has {members} nodes, its members quota: its max_nodes and "
                             f"--max-spares-per-job spares, at most --max-nodes-per-job ({ctx.max_members}); "
                             f"--job-quota {state.job}:nodes=N raises it for this job")


def _repeated(f: _Fold, ev: Join) -> bool:
    """The Join is an attempt repeated of one that made the node's membership (its answer lost to a
    deadline while the leader admitted it): same join key, so same secret hash. Answered with that
    membership; anything else under the node's id stays refused (a second agent, a restarted one)."""
    held = f.members.get(ev.node_id)
    return held is not None and bool(held.secret_hash) and held.admits(ev.secret_hash)


def _on_join(f: _Fold, ev: Join) -> None:
    if not f.state.ended and _repeated(f, ev):
        return  # settled with the member it made: nothing changes
    refusal = _join_refusal(f, ev)
    if refusal is None:
        f.spec, f.spec_lost, refusal = _restored_spec(f.spec, f.spec_lost, ev.spec)
    if refusal is not None:
        f.rejected[ev.ticket] = refusal
        return
    prestart = f.ctx.prestart and ev.kind is NodeKind.AGENT and f.state.phase is Phase.RUNNING
    f.members[ev.node_id] = Member(ev.node_id, f.next_seq, ev.host, ev.store_port, ev.slots, f.next_seq, ev.kind,
                                   master_port=ev.master_port,
                                   down_slots=frozenset(range(ev.slots)) if prestart else frozenset(),
                                   secret_hash=ev.secret_hash)
    f.joined.append(f.members[ev.node_id])
    f.next_seq += 1
    f.note("node_joined", f"{ev.slots} slot(s) at {ev.host}" + ("; starting its ranks first" if prestart else ""),
           ev.node_id)
    f.planned = f.changed = True


def _on_leave(f: _Fold, ev: Leave) -> None:
    if ev.node_id not in f.members:
        f.rejected[ev.ticket] = NotFound(f"node {ev.node_id!r} is not a member of job {f.state.job!r}")
        return
    del f.members[ev.node_id]
    f.changed = True
    f.departed = "left_now" if ev.immediate else "left"
    if ev.finished:
        f.note("node_finished", ev.reason, ev.node_id)
        if not f.finishing and not f.state.ended:
            f.finishing = True
            f.note("finishing", f"node {ev.node_id!r} finished: the job is ending", ev.node_id)
        return
    mapped = ev.node_id in f.in_map
    if f.finishing and mapped:
        f.fail(f"node {ev.node_id!r} left before it finished: {ev.reason}")
    graceful = not ev.immediate and mapped
    f.note("node_left", ("graceful: " if graceful else "immediate: ") + ev.reason, ev.node_id)
    if graceful:
        f.leaving.append(ev.node_id)
        f.planned = True
    elif mapped:
        f.unplanned = True


def _on_lost(f: _Fold, ev: NodeLost) -> None:
    lost = f.members.pop(ev.node_id, None)
    if lost is None:
        return  # already gone: several signals for one failure
    f.evicted.append((lost.node_id, lost.member_id))
    f.note(ev.kind, ev.reason, ev.node_id)
    f.unplanned |= ev.node_id in f.in_map
    f.changed = True
    f.departed = "lost"
    if f.finishing and ev.node_id in f.in_map:
        f.fail(f"node {ev.node_id!r} was lost while the job finished ({ev.kind}: {ev.reason})")


def _on_slot_down(f: _Fold, ev: SlotDown) -> None:
    member = f.members.get(ev.node_id)
    if member is None or ev.slot in member.down_slots or ev.slot >= member.slots:
        return
    f.members[ev.node_id] = replace(member, down_slots=member.down_slots | {ev.slot})
    f.note(ev.kind, f"local rank {ev.slot}: {ev.reason}", ev.node_id)
    placement = f.state.rank_map.placement(ev.node_id) if ev.node_id in f.in_map else None
    mapped = placement is not None and ev.slot in placement.slots
    f.unplanned |= mapped
    f.changed = True
    if f.finishing and mapped:
        f.fail(f"rank {placement.rank_of(ev.slot)} (node {ev.node_id!r}, local rank {ev.slot}) "
               f"failed while the job finished ({ev.kind}: {ev.reason})")


def _on_slots_up(f: _Fold, ev: SlotsUp) -> None:
    member = f.members.get(ev.node_id)
    back = frozenset(ev.slots) & member.down_slots if member else frozenset()
    if not back:
        return
    f.members[ev.node_id] = replace(member, down_slots=member.down_slots - back)
    f.note("rank_recovered", f"local rank(s) {sorted(back)} running again", ev.node_id)
    f.planned = f.changed = True


def _on_node_fault(f: _Fold, ev: NodeFault) -> None:
    member = f.members.get(ev.node_id)
    if member is None:
        return
    f.members[ev.node_id] = replace(member, faults_ms=(*member.faults_ms, ev.at_ms)[-HOLD_OUT_FAILURES:])
    f.changed = True


def _on_slot_error(f: _Fold, ev: SlotError) -> None:
    member = f.members.get(ev.node_id)
    if member is None or not 0 <= ev.local_rank < member.slots:  # (kept: one a slot)
        return
    others = tuple(e for e in member.last_errors if e[0] != ev.local_rank)
    kept = (*others, (ev.local_rank, ev.digest, ev.step, ev.pid)) if ev.digest else others
    if kept != member.last_errors:
        f.members[ev.node_id] = replace(member, last_errors=kept)
        f.changed = True


def _on_diverged(f: _Fold, ev: Diverged) -> None:
    f.note("replicas_diverged", ev.reason, *ev.nodes)
    f.changed = True


def _on_straggling(f: _Fold, ev: Straggling) -> None:
    f.note("straggler", ev.reason, ev.node_id)
    f.changed = True


def _on_finishing(f: _Fold, ev: Finishing) -> None:
    if not f.finishing and not f.state.ended:
        f.finishing = f.changed = True
        f.note("finishing", ev.reason, ev.node_id)


def _on_stop(f: _Fold, ev: Stop) -> None:
    if f.state.ended or f.stop is not None:
        f.rejected[ev.ticket] = FailedPrecondition(
            f"run {f.state.run} of job {f.state.job!r} has ended already ({f.state.outcome.value})")
        return
    f.stop = ev
    f.changed = True


def _on_verdict(f: _Fold, ev: Verdict) -> None:
    if ev.kind == STATE_LOST and f.spec.on_state_lost == "restart":
        # The operator allowed it: the ranks (restarted by their agents) begin again at step 0; said once a
        # generation, in the events and (_outcome) in the run's outcome
        said = (e for e in (*f.state.history, *f.log) if e.kind == STATE_LOST_EVENT and e.generation == f.state.generation)
        if not f.state.ended and next(said, None) is None:
            f.note(STATE_LOST_EVENT, f"{ev.reason}; on_state_lost=restart: the ranks begin again at step 0", ev.node_id)
            f.changed = True
        return
    if not f.state.ended and f.stop is None and not f.verdict:
        f.verdict = f"{ev.kind}: {ev.reason}"
        f.changed = True


def _on_regroup(f: _Fold, ev: Regroup) -> None:
    if f.state.phase is not Phase.RUNNING or f.finishing:
        return
    if not any(e.kind == ev.kind and e.nodes == ev.nodes[:EVENT_NODES_MAX] for e in f.log):
        f.note(ev.kind, ev.reason, *ev.nodes[:EVENT_NODES_MAX])  # an exit and its report: one fault
    f.regroup = f.unplanned = f.changed = True


_FOLD = {Rejoin: _on_rejoin, Join: _on_join, Leave: _on_leave, NodeLost: _on_lost, SlotDown: _on_slot_down,
         SlotsUp: _on_slots_up, Diverged: _on_diverged, Straggling: _on_straggling, Finishing: _on_finishing,
         NodeFault: _on_node_fault, SlotError: _on_slot_error, Stop: _on_stop, Regroup: _on_regroup, Verdict: _on_verdict}


def decide(state: JobState, events: Sequence[MembershipEvent], ctx: Context) -> Decision:
    """The next state of the job after `events`: each folded in turn (a refusal is kept by its
    request's ticket), then at most one new generation, then the run's end if it ends now."""
    f = _Fold.of(state, ctx)
    for ev in events:
        fold = _FOLD.get(type(ev))
        if fold is not None:  # a Tick changes nothing but the clock
            fold(f, ev)
    nxt = replace(state.with_members(tuple(f.members.values())), next_seq=f.next_seq, generation=f.generation,
                  spec=f.spec, spec_lost=f.spec_lost, finishing=f.finishing, failure=f.failure,
                  rebuilding=f.rebuilding, started_ms=f.started_ms or ctx.wall_ms,
                  rebuild_claims=tuple(c for n, c in f.claims.items() if n in f.members) if f.rebuilding else ())
    nxt, new_generation, drains = _regenerate(f, nxt)
    nxt = replace(nxt, waiting_deadline=_waiting_deadline(state, nxt, ctx))
    ending = None if nxt.ended else _outcome(state, nxt, f.stop, f.verdict, f.departed, ctx)
    if ending is not None:
        outcome, reason = ending
        nxt = replace(nxt, outcome=outcome, outcome_reason=reason, ended_ms=ctx.wall_ms, waiting_deadline=None)
        f.log.append(Event(nxt.generation, ctx.term, ctx.wall_ms, outcome.value, reason))
        if f.stop is not None:  # every node drains at one step (a node out of the map at once)
            switch_at = _switch_at(state, ctx) if state.rank_map and state.phase is Phase.RUNNING else 0
            drains = tuple((m.node_id, switch_at if m.node_id in f.in_map else 0) for m in nxt.members)
        f.changed = True
    log = [replace(e, generation=nxt.generation) for e in f.log] if new_generation else f.log
    history = (state.history + tuple(log))[-ctx.timing.history_limit :]
    return Decision(
        state=replace(nxt, history=history, term=ctx.term),
        persist=f.changed or new_generation,
        new_generation=new_generation,
        events=tuple(log),
        evicted=tuple(f.evicted),
        drains=drains,
        joined=tuple(f.joined),
        rejected=f.rejected,
        ended=ending is not None,
    )


def _regenerate(f: _Fold, nxt: JobState) -> tuple[JobState, bool, tuple[tuple[str, int], ...]]:
    """At most one new generation for what the batch changed: (state, whether one was published,
    the planned leavers' drains at its switch step)."""
    state, ctx = f.state, f.ctx
    if nxt.frozen or f.stop is not None or f.verdict:
        return nxt, False, ()  # the job is ending: nothing re-forms it
    if nxt.rebuilding:
        nxt, formed = _rebuild(nxt, ctx, f.log)
        return nxt, formed, ()
    if state.phase is Phase.FORMING:
        nxt, formed = _maybe_form(nxt, ctx, f.log)
        return nxt, formed, ()
    if not (f.planned or f.unplanned):
        return nxt, False, ()
    previous = state.rank_map if state.phase is Phase.RUNNING else None
    assignment = assign_ranks(nxt.members, previous, nxt.spec)
    if state.phase is Phase.RUNNING and assignment.placements == state.rank_map.placements and not f.regroup:
        return nxt, False, ()  # e.g. a spare joined or a spare left
    if not assignment.runnable:
        if state.phase is not Phase.RUNNING:
            return nxt, False, ()
        nxt = replace(_publish(nxt, (), 0, abort=True, switch_at=0), phase=Phase.WAITING)
        f.log.append(Event(nxt.generation, ctx.term, ctx.wall_ms, "waiting", assignment.reason, (), 0))
        return nxt, True, ()
    abort = f.unplanned or state.phase is Phase.WAITING
    switch_at = 0 if abort else _switch_at(state, ctx)
    excluded = excluded_ranks(previous, assignment.placements) if abort else ()
    nxt = replace(_publish(nxt, assignment.placements, assignment.world_size, abort=abort, switch_at=switch_at,
                           shrink=(previous.generation, excluded) if excluded else (0, ()),
                           left_out=assignment.left_out),
                  phase=Phase.RUNNING)
    mode = "abort" if abort else f"switch after step {switch_at}"
    f.log.append(Event(nxt.generation, ctx.term, ctx.wall_ms, "generation", f"{mode}; {assignment.reason}",
                       _named(nxt.rank_map.node_ids), assignment.world_size))
    return nxt, True, tuple((node_id, switch_at) for node_id in f.leaving if not abort)


def _waiting_deadline(before: JobState, state: JobState, ctx: Context) -> float | None:
    """When the run ends for want of nodes, if it waits for them: below what it needs after it ran
    (waiting_timeout_s), or with no member at all (form_timeout_s; a run whose last member went ends at
    once, so this is one that never had one): the Join that created the job never reached it (its
    deadline passed meanwhile) and its node did not come back."""
    if state.ended or state.rebuilding:
        return None
    if state.phase is Phase.WAITING:
        timeout = ctx.timing.waiting_timeout_s
    elif not state.members:
        timeout = ctx.timing.form_timeout_s
    else:
        return None
    return before.waiting_deadline or ctx.now + timeout


def _outcome(before: JobState, state: JobState, stop: Stop | None, verdict: str, departed: str,
             ctx: Context) -> tuple[Outcome, str] | None:
    """How the run ends now, if it does: stopped by an operator; a fault that repeats; every node of
    its map finished (succeeded, unless a rank failed meanwhile); its last member gone; below
    min_nodes too long; or no node ever joined."""
    if stop is not None:
        return Outcome.STOPPED, stop.reason
    if verdict:
        return Outcome.FAILED, verdict
    rm = state.rank_map
    # A finishing job re-forms nothing: a node placed by a switch its ranks never reached (it joined
    # as the job finished) has nothing to finish, and is told the outcome with the others.
    if state.finishing and not any(state.member(n) and n not in ctx.unformed for n in (rm.node_ids if rm else ())):
        if state.failure:
            return Outcome.FAILED, state.failure
        if rm is None:
            return Outcome.SUCCEEDED, "every node finished"
        late = [n for n in rm.node_ids if state.member(n)]
        lost = [e.generation for e in state.history if e.kind == STATE_LOST_EVENT]
        again = (f"; its training state was lost beyond every tier and begun again from step 0 (on_state_lost="
                 f"restart) at generation(s) {', '.join(map(str, lost))}") if lost else ""
        switch = 0 if rm.abort_previous else rm.switch_at_step
        if late:
            done = (f"every rank that trained completed its script; node(s) {', '.join(map(repr, late))} placed at "
                    f"generation {rm.generation} never trained: the job finished first")
        elif switch and ctx.high_step <= switch:  # e.g. a replacement's place: its agent ended it (`outrun`)
            done = (f"every rank that trained completed its script before generation {rm.generation}'s switch "
                    f"after step {switch}: the ranks it placed anew never trained")
        else:
            done = f"every rank of generation {rm.generation} completed its script (world size {rm.world_size})"
        return Outcome.SUCCEEDED, done + again
    if before.members and not state.members and not state.rebuilding:
        if departed == "left":
            return Outcome.STOPPED, "every node left (drained)"
        return Outcome.FAILED, ("every node left before the job finished" if departed == "left_now"
                                else "every node was lost")
    if state.waiting_deadline is not None and ctx.now >= state.waiting_deadline:
        if not state.members:
            return Outcome.FAILED, (f"no node joined within {ctx.timing.form_timeout_s:g}s of the job's creation "
                                    f"(the Join that created it did not complete, and its node did not try again)")
        waiting = next((e.reason for e in reversed(state.history) if e.kind == "waiting"), "below min_nodes")
        return Outcome.FAILED, f"waited {ctx.timing.waiting_timeout_s:g}s below what the job needs: {waiting}"
    return None


def run_ended(state: JobState) -> RunEnded:
    """How the state's run ended, as a node of it is told (it ends the same way)."""
    return RunEnded(state.job, state.run, state.outcome.value, state.outcome_reason)


def _rejoin_refusal(f: _Fold, ev: Rejoin) -> tuple[MusterError | None, list[Member]]:
    """Why a node claiming membership is not taken back (None: it is), and the members its proven
    claim displaces: those holding its node id or member id that nobody proved. A refusal a real node
    may get is one it answers by joining again (FAILED_PRECONDITION), never one that ends its agent."""
    state, members, ctx = f.state, f.members, f.ctx
    if state.ended:  # (as a replica that forgot the run answers, Runs.refuse_ended: never "join first")
        return run_ended(state), []
    if not f.rebuilding or not ev.generation or not ev.member_id:
        return NotFound(f"node {ev.node_id!r} is not a member of job {state.job!r}: join first"), []
    if ev.generation >= MAX_CLAIMED or ev.member_id >= MAX_CLAIMED:
        return InvalidArgument(f"a node taken back claims generation {ev.generation} and member_id "
                               f"{ev.member_id}: each must be below {MAX_CLAIMED}"), []
    if ev.proven and ev.run_started_ms != f.started_ms and any(m.proven for m in members.values()):
        return FailedPrecondition(f"member {ev.member_id} ({ev.node_id!r}) ran another run of job {state.job!r} "
                                  f"than the one being rebuilt: join again"), []
    current = members.get(ev.node_id)
    holder = next((m for m in members.values() if m.member_id == ev.member_id and m.node_id != ev.node_id), None)
    held = [m for m in (current, holder) if m is not None]
    if ev.proven and not any(m.proven for m in held):
        displaced = held
    elif current is not None and current.member_id != ev.member_id:
        return FailedPrecondition(f"member {ev.member_id} of node {ev.node_id!r} is stale (current member "
                                  f"{current.member_id}); it was evicted or replaced: rejoin"), []
    elif current is not None:
        return PermissionDenied(f"node {ev.node_id!r} did not present the session secret of member "
                                f"{current.member_id}"), []
    elif holder is not None:
        return FailedPrecondition(f"member {ev.member_id} of job {state.job!r} is node {holder.node_id!r}'s, taken "
                                  f"back before node {ev.node_id!r} claimed it: join again"), []
    else:
        displaced = []
    if len(members) - len(displaced) >= ctx.max_members:
        return _members_quota(state, len(members), ctx), []
    return None, displaced


def _restored_spec(spec: JobSpec, lost: bool, asked: JobSpec | None) -> tuple[JobSpec, bool, MusterError | None]:
    """While the job's spec is lost (`spec` holds the coordinator's default), the first node taken
    in restores it with what it asks for, as its Join created the job."""
    if not lost or asked is None:
        return spec, lost, None
    try:
        return asked.merged_over(spec).validate(), False, None
    except InvalidPolicy as exc:
        return spec, lost, InvalidArgument(str(exc))


def _rebuild(state: JobState, ctx: Context, log: list[Event]) -> tuple[JobState, bool]:
    """Nodes are taken back until the deadline (the new leader's grace), then one generation above
    every generation they ran re-forms them all (a planned switch if their group is whole, `_whole`): a generation every node accepts, after
    which the state sync brings all ranks to the highest completed step. A job that nobody
    claims (a new one) forms as usual, which ends the rebuild as well."""
    deadline = state.rebuild_deadline if state.rebuild_deadline is not None else ctx.now + ctx.timing.grace_s
    if not state.rebuilt_members:
        state, formed = _maybe_form(state, ctx, log)
        if formed or ctx.now >= deadline:
            return replace(state, rebuilding=False, rebuild_deadline=None), formed
        return replace(state, rebuild_deadline=deadline), False
    if ctx.now < deadline:
        return replace(state, rebuild_deadline=deadline), False
    state = _proven_first(state)
    rebuilt = replace(state, rebuilding=False, rebuild_deadline=None)
    node_ids = tuple(m.node_id for m in state.members)
    log.append(Event(state.generation, ctx.term, ctx.wall_ms, "state_rebuilt",
                     f"the job's state was lost in etcd: rebuilt from the {len(node_ids)} node(s) that reconnected "
                     f"within {ctx.timing.grace_s:g}s, above the highest generation they ran ({state.generation})",
                     _named(node_ids)))
    assignment = assign_ranks(state.members, None, state.spec)
    if not assignment.runnable:
        rebuilt = replace(_publish(rebuilt, (), 0, abort=True, switch_at=0), phase=Phase.WAITING)
        log.append(Event(rebuilt.generation, ctx.term, ctx.wall_ms, "waiting", assignment.reason, (), 0))
        return rebuilt, True
    # Every node ran one generation, whole: its group is healthy, so it trains on to a planned switch
    # (an abort would cut its collectives mid-step for nothing: it met gloo's half-read wait in CI).
    kept = _whole(state)
    switch_at = _switch_at(state, ctx) if kept else 0
    rebuilt = _publish(rebuilt, assignment.placements, assignment.world_size, abort=not kept, switch_at=switch_at,
                       left_out=assignment.left_out)
    rebuilt = replace(rebuilt, phase=Phase.RUNNING)
    mode = f"switch after step {switch_at} (every node taken back ran generation {state.generation}, whole)" \
        if kept else "abort"
    log.append(Event(rebuilt.generation, ctx.term, ctx.wall_ms, "generation", f"{mode}; {assignment.reason}",
                     _named(rebuilt.rank_map.node_ids), assignment.world_size))
    return rebuilt, True


def _whole(state: JobState) -> bool:
    """Every member was taken back running the job's generation (the highest claimed), with one world
    size, their ranks in it adding up to it: no node of its group is missing, so its group is healthy."""
    claims = state.rebuild_claims
    if not claims or len(claims) != len(state.members):
        return False  # (a node that joined meanwhile claims nothing)
    slots = {m.node_id: m.slots for m in state.members}
    world_size = claims[0][2]
    return (world_size > 0 and all(g == state.generation and w == world_size and local <= slots.get(n, 0)
                                   for n, g, w, local in claims)
            and sum(local for *_, local in claims) == world_size)


def _proven_first(state: JobState) -> JobState:
    """The members taken back on proven claims are the oldest (rank 0 and the store are theirs);
    the others (joined meanwhile, or taken back unproven) age from now, in their order."""
    proven = [replace(m, proven=False) for m in state.members if m.proven]
    others = [replace(m, seq=state.next_seq + i) for i, m in enumerate(m for m in state.members if not m.proven)]
    return replace(state.with_members(tuple(proven + others)), next_seq=state.next_seq + len(others))


def _maybe_form(state: JobState, ctx: Context, log: list[Event]) -> tuple[JobState, bool]:
    """Form generation 1 when max_nodes are here, or once the last call after min_nodes ends. The map is
    made only when it may form: not at every tick while thousands of nodes gather (25 ms at 12,500)."""
    spec = state.spec
    usable = sum(1 for m in state.members if m.usable_slots)
    if usable < spec.min_nodes:  # no map places min_nodes on fewer nodes
        return replace(state, forming_deadline=None), False
    deadline = state.forming_deadline if state.forming_deadline is not None else ctx.now + ctx.timing.last_call_s
    waiting = usable < spec.max_nodes and ctx.now < deadline
    if waiting and spec.world_size_multiple == 1:  # runnable: every usable node is placed
        return replace(state, forming_deadline=deadline), False
    assignment = assign_ranks(state.members, None, spec)
    if not assignment.runnable:
        return replace(state, forming_deadline=None), False
    if waiting:
        return replace(state, forming_deadline=deadline), False
    formed = _publish(state, assignment.placements, assignment.world_size, abort=False, switch_at=0,
                      left_out=assignment.left_out)
    formed = replace(formed, phase=Phase.RUNNING, forming_deadline=None)
    log.append(Event(formed.generation, ctx.term, ctx.wall_ms, "formed", assignment.reason,
                     _named(formed.rank_map.node_ids), assignment.world_size))
    return formed, True


def _switch_at(state: JobState, ctx: Context) -> int:
    """A step far enough ahead that every rank hears of the change before reaching it. A planned
    switch not yet reached keeps its step: the ranks that heard only it leave their group there, and
    those that hear this map first must leave with them (the group they would stay in is gone)."""
    pending = state.rank_map.switch_at_step if state.rank_map and not state.rank_map.abort_previous else 0
    if pending > ctx.max_step:
        return pending
    lead = 2
    if ctx.step_time_s:
        lead = max(lead, math.ceil((ctx.timing.switch_lead_s + ctx.step_lag_s) / ctx.step_time_s) + 1)
    # Capped: steps come from the nodes, and the step must stay in the wire's uint64.
    return min(ctx.max_step + lead, MAX_STEP)


def _publish(state: JobState, placements, world_size: int, *, abort: bool, switch_at: int,
             shrink: tuple[int, tuple[int, ...]] = (0, ()), left_out: int = 0) -> JobState:
    generation = state.generation + 1
    rank_map = RankMap(
        generation=generation,
        world_size=world_size,
        placements=tuple(placements),
        store_address=rank0_address(state.members, placements),
        master_address=rank0_address(state.members, placements, master=True),
        abort_previous=abort,
        switch_at_step=switch_at,
        shrink_of=shrink[0],
        excluded_ranks=shrink[1],
        left_out=left_out,
    )
    return replace(state, generation=generation, rank_map=rank_map)


def _named(node_ids: tuple[str, ...]) -> tuple[str, ...]:
    """The nodes a generation event lists: all of a small job's; none of a large one's, whose
    history (persisted with the state) would otherwise outgrow etcd's request limit."""
    return node_ids if len(node_ids) <= EVENT_NODES_MAX else ()
