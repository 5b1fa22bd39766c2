"""Translation between the wire (muster.v1 protobuf) and the core, with validation.

Every request is checked here before anything touches state: bad values become
InvalidArgument with a message naming the field and quoting client input bounded (`shown`).
"""

from __future__ import annotations

import hmac
import ipaddress
import re

from muster.coordinator.core.liveness import RankReport
from muster.coordinator.core.policy import MAX_GENERATION, MAX_SLOTS, MAX_STEP, JobSpec
from muster.coordinator.core.state import Event, JobState, Member, NodeKind, Phase, RankMap
from muster.coordinator.errors import InvalidArgument
from muster.names import JOB_NAME, NODE_ID
from muster.terminal import CONTROL
from muster.v1 import muster_pb2 as pb

MAX_DIGEST_BYTES = 64
MAX_SECRET_BYTES = 64
MIN_JOIN_KEY_BYTES = 16  # JoinRequest.join_key: random, so that nobody else can repeat the join
MAX_HOST_CHARS = 253
MAX_PHASE_CHARS = 128
MAX_EXIT_ERROR_CHARS = 200  # RankExit.error: the exception a rank died of, one line
MAX_REASON_CHARS = 256  # a Leave's reason is kept in the job's persisted history
# RFC 1123, plus "_": container runtimes (Docker Compose) name hosts with it and resolvers accept it.
HOST_LABEL = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")
RANK_STATES = {
    pb.RANK_STATE_STARTING: "starting",
    pb.RANK_STATE_RUNNING: "running",
    pb.RANK_STATE_LONG_PHASE: "long_phase",
    pb.RANK_STATE_EXITED: "exited",
    pb.RANK_STATE_UNMONITORED: "script",  # a script without the library, running: not an alarm
    pb.RANK_STATE_FORMING: "forming",
    pb.RANK_STATE_HOLDING: "holding",
    pb.RANK_STATE_RESTARTING: "restarting",
    pb.RANK_STATE_FINISHED: "finished",
}


def shown(value: str, limit: int = 64) -> str:
    """`value` quoted in a message: its repr, cut to `limit` characters. A refusal travels in the
    grpc-message header, whose size the peer bounds; echoing 10k characters would turn it into
    RESOURCE_EXHAUSTED."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}… ({len(value)} chars)"


def check_job(job: str) -> str:
    if not JOB_NAME.fullmatch(job):
        raise InvalidArgument(f"job name {shown(job)} is invalid: use 1-63 of [a-z0-9._-], "
                              "starting with a letter or digit")
    return job


def check_node(node_id: str) -> str:
    if not NODE_ID.fullmatch(node_id):
        raise InvalidArgument(f"node_id {shown(node_id)} is invalid: use 1-128 of [A-Za-z0-9._:@-]")
    return node_id


def is_host(host: str) -> bool:
    """A hostname (RFC 1123) or an IP literal. The host ends up in every node's store address and
    MASTER_ADDR, so nothing else passes: no option ("-o…"), space, bracket or NUL."""
    if "%" in host:  # an IPv6 scope id names an interface of the joining node, meaningless to others
        return False
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return len(host) <= MAX_HOST_CHARS and all(HOST_LABEL.fullmatch(label) for label in host.split("."))


def check_secret(secret: bytes) -> None:
    if len(secret) > MAX_SECRET_BYTES:
        raise InvalidArgument(f"session_secret is {len(secret)} bytes; at most {MAX_SECRET_BYTES}")


def check_join(req: pb.JoinRequest) -> None:
    check_job(req.job)
    check_node(req.node_id)
    if not 1 <= req.slots <= MAX_SLOTS:
        raise InvalidArgument(f"slots must be in 1..{MAX_SLOTS}, got {req.slots}")
    if not is_host(req.host):
        raise InvalidArgument(f"host {shown(req.host)} is invalid: give the hostname (RFC 1123) or IP address "
                              "other nodes reach this node at")
    if not 1 <= req.store_port <= 65535:
        raise InvalidArgument(f"store_port must be in 1..65535, got {req.store_port}")
    if req.master_port > 65535:
        raise InvalidArgument(f"master_port must be in 0..65535, got {req.master_port}")
    if req.join_key and not MIN_JOIN_KEY_BYTES <= len(req.join_key) <= MAX_SECRET_BYTES:
        raise InvalidArgument(f"join_key is {len(req.join_key)} bytes: give {MIN_JOIN_KEY_BYTES}-{MAX_SECRET_BYTES} "
                              "random bytes, the same on every attempt of one join (or none)")


def check_leave(req: pb.LeaveRequest) -> None:
    check_job(req.job)
    check_node(req.node_id)
    check_reason(req.reason)
    check_secret(req.session_secret)


def check_reason(reason: str) -> str:
    if len(reason) > MAX_REASON_CHARS:
        raise InvalidArgument(f"reason is {len(reason)} characters; at most {MAX_REASON_CHARS}")
    if CONTROL.search(reason):  # it is shown in operators' terminals (events, status)
        raise InvalidArgument(f"reason {shown(reason)} holds a control character: give one line of text")
    return reason


def spec_of(msg: pb.JobSpec) -> JobSpec:
    return JobSpec(msg.min_nodes, msg.max_nodes, msg.world_size_multiple, msg.straggler_action,
                   round(msg.straggler_factor, 4), msg.straggler_min_steps,  # a float32 on the wire
                   msg.on_state_lost)


def check_frame_ranks(frame: pb.NodeFrame, member: Member) -> list[RankReport]:
    """The frame's rank reports, checked. The hot path of every leader: each field is read once."""
    slots = member.slots
    if len(frame.ranks) > slots:
        raise InvalidArgument(f"frame reports {len(frame.ranks)} ranks but node {member.node_id!r} has {slots} slots")
    reports = []
    for r in frame.ranks:
        local_rank, step, digest_step, generation = r.local_rank, r.step, r.digest_step, r.generation
        phase, digest, state = r.phase, r.digest, RANK_STATES.get(r.state)
        if (local_rank >= slots or step > MAX_STEP or digest_step > MAX_STEP or generation > MAX_GENERATION
                or len(phase) > MAX_PHASE_CHARS or (phase and CONTROL.search(phase))
                or len(digest) > MAX_DIGEST_BYTES or state is None):
            _refuse_rank(r, slots)
        reports.append(RankReport(local_rank, r.pid, step, r.step_time_us / 1e6, state, r.heard_ms_ago, phase,
                                  digest_step, digest, generation, r.compute_us / 1e6, r.restarts,
                                  r.snapshot_every, r.snapshot_bytes, r.steps_unmeasured))
    for e in frame.exits:
        if e.local_rank >= member.slots:
            raise InvalidArgument(f"exit of local_rank {e.local_rank} is out of range for {member.slots} slots")
        if len(e.error) > MAX_EXIT_ERROR_CHARS or CONTROL.search(e.error) or e.step > MAX_STEP:
            # (the error reaches operators' terminals in a run's outcome)
            raise InvalidArgument(f"exit of local_rank {e.local_rank}: error must be one line of at most "
                                  f"{MAX_EXIT_ERROR_CHARS} characters without control characters, step at most {MAX_STEP}")
    return reports


def frame_steps(frame: pb.NodeFrame) -> list[tuple[int, int, int, int]]:
    """(step, step_time_us, heard_ms_ago, compute_us) of each rank of a `steps_only` frame, checked:
    the four fields such a frame is read for (`check_frame_ranks` reads the rest)."""
    steps = [(r.step, r.step_time_us, r.heard_ms_ago, r.compute_us) for r in frame.ranks]
    if steps and max(steps)[0] > MAX_STEP:
        raise InvalidArgument(f"a step of this frame is {max(steps)[0]}; at most {MAX_STEP}")
    return steps


class Assignments:
    """Each node's part of the current map: what every node shares is built once, then each
    directive is a copy of it with the node's own fields set (a new generation sends one to every
    node: a copy is 2x cheaper than building the message from keywords)."""

    def __init__(self, state: JobState, reason: str):
        self.state = state
        rm: RankMap | None = state.rank_map
        shared = pb.Assignment(generation=state.generation, reason=reason)
        if rm is not None:
            shared.abort_previous = rm.abort_previous
            shared.switch_at_step = rm.switch_at_step
            shared.world_size = rm.world_size
            shared.num_nodes = len(rm.placements)
            shared.store_address = rm.store_address
            shared.master_address = rm.master_address
            shared.store_prefix = store_prefix(state)
            shared.store_key = store_key(state)
            shared.shrink_of = rm.shrink_of
            shared.excluded_ranks.extend(rm.excluded_ranks)
            shared.left_out = rm.left_out
        self.active = pb.Directive(term=state.term, generation=state.generation, assignment=shared)
        self.active.assignment.role = pb.ROLE_ACTIVE
        self.unplaced = pb.Directive(term=state.term, generation=state.generation, assignment=shared)
        self.unplaced.assignment.role = pb.ROLE_WAITING if rm is None or rm.world_size == 0 else pb.ROLE_SPARE
        self.running = state.phase is Phase.RUNNING

    def directive(self, node_id: str) -> pb.Directive:
        state = self.state
        placement = state.rank_map.placement(node_id) if state.rank_map else None
        member = state.member(node_id)
        d = pb.Directive()
        if placement is not None:
            d.CopyFrom(self.active)
            a = d.assignment
            a.node_rank = placement.node_rank
            a.rank_offset = placement.rank_offset
            a.local_world_size = len(placement.slots)
            a.local_ranks.extend(placement.slots)
        else:
            d.CopyFrom(self.unplaced)
            a = d.assignment
        if member is not None and member.down_slots:
            a.down_local_ranks.extend(sorted(member.down_slots))
            # Not in the map with slots awaited: start them now, they take a place once they report.
            a.start_ranks = placement is None and self.running
        return d


def store_prefix(state: JobState) -> str:
    """Where the generation's keys go on its TCPStore, which has no auth: fresh per generation, and
    past anyone who does not hear the leader (128 bits keyed by the job's salt), so that keys planted
    ahead of time (a MASTER_ADDR, a master port) sit where no rank looks."""
    nonce = hmac.digest(bytes.fromhex(state.store_salt), state.generation.to_bytes(8, "big"), "sha256")
    return f"muster/{state.job}/g{state.generation}-{nonce[:16].hex()}"


def store_key(state: JobState) -> bytes:
    """The key that seals the generation's store values (src/muster/worker/store.py): anyone can list the store's
    keys, prefix included, so what ranks act on must prove it came from a rank that heard the leader.
    Keyed by the job's salt under another label than the prefix: knowing one says nothing of the other."""
    return hmac.digest(bytes.fromhex(state.store_salt), b"store-key\0" + state.generation.to_bytes(8, "big"), "sha256")


def _refuse_rank(r: pb.RankReport, slots: int) -> None:
    """Why a rank report is refused (the checks of `check_frame_ranks`, one by one)."""
    if r.local_rank >= slots:
        raise InvalidArgument(f"local_rank {r.local_rank} is out of range for {slots} slots")
    for name in ("step", "digest_step"):
        if getattr(r, name) > MAX_STEP:
            raise InvalidArgument(f"{name} of local_rank {r.local_rank} is {getattr(r, name)}; at most {MAX_STEP}")
    if r.generation > MAX_GENERATION:
        raise InvalidArgument(f"generation of local_rank {r.local_rank} is {r.generation}; at most {MAX_GENERATION}")
    if len(r.phase) > MAX_PHASE_CHARS:
        raise InvalidArgument(f"phase of local_rank {r.local_rank} is {len(r.phase)} characters; "
                              f"at most {MAX_PHASE_CHARS}")
    if CONTROL.search(r.phase):
        raise InvalidArgument(f"phase of local_rank {r.local_rank} {shown(r.phase)} holds a control character: "
                              "give one line of text")
    if len(r.digest) > MAX_DIGEST_BYTES:
        raise InvalidArgument(f"digest of local_rank {r.local_rank} is {len(r.digest)} bytes; at most {MAX_DIGEST_BYTES}")
    raise InvalidArgument(f"state of local_rank {r.local_rank} is unspecified or unknown ({r.state})")


def assignment_for(state: JobState, node_id: str, reason: str) -> pb.Directive:
    """One node's part of the current map."""
    return Assignments(state, reason).directive(node_id)


def evicted_directive(state: JobState, reason: str) -> pb.Directive:
    return pb.Directive(
        term=state.term,
        generation=state.generation,
        assignment=pb.Assignment(generation=state.generation, role=pb.ROLE_EVICTED, reason=reason),
    )


def event_pb(e: Event) -> pb.Event:
    return pb.Event(generation=e.generation, term=e.term, time_unix_ms=e.time_unix_ms, kind=e.kind,
                    reason=e.reason, nodes=list(e.nodes), world_size=e.world_size)


def node_kind(is_process: bool) -> NodeKind:
    return NodeKind.PROCESS if is_process else NodeKind.AGENT
