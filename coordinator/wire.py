"""Translation between the wire (muster.v1 protobuf) and the core, with validation.

Every request is checked here before anything touches state: bad values become
InvalidArgument with a message naming the field and quoting client input bounded (`shown`).
"""

from __future__ import annotations

import hmac
import ipaddress
import re
from bisect import bisect_right
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice

from muster.coordinator.core.liveness import Liveness, RankReport
from muster.coordinator.core.policy import MAX_GENERATION, MAX_SLOTS, MAX_STEP, JobSpec
from muster.coordinator.core.state import Event, JobState, Member, NodeKind, Outcome, Phase, Placement, RankMap
from muster.coordinator.errors import FailedPrecondition, InvalidArgument, NotFound
from muster.names import JOB_NAME, NODE_ID
from muster.v1 import muster_pb2 as pb

MAX_DIGEST_BYTES = 64
MAX_SECRET_BYTES = 64
MAX_HOST_CHARS = 253
MAX_PHASE_CHARS = 128
MAX_REASON_CHARS = 256  # a Leave's reason is kept in the job's persisted history
# RFC 1123, plus "_": container runtimes (Docker Compose) name hosts with it and resolvers accept it.
HOST_LABEL = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")
RANK_STATES = {
    pb.RANK_STATE_STARTING: "starting",
    pb.RANK_STATE_RUNNING: "running",
    pb.RANK_STATE_LONG_PHASE: "long_phase",
    pb.RANK_STATE_EXITED: "exited",
    pb.RANK_STATE_UNMONITORED: "unmonitored",
    pb.RANK_STATE_FORMING: "forming",
    pb.RANK_STATE_HOLDING: "holding",
    pb.RANK_STATE_RESTARTING: "restarting",
    pb.RANK_STATE_FINISHED: "finished",
}
# Status pages: the default keeps any Status far below the 1 MiB message limit (a rank is at most
# ~170 bytes with a 128-character node id), the most stays below it.
DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE = 1000, 5000
SCAN_FACTOR = 16  # a page filtered by state looks at most this many ranks per rank it may hold
MAX_LISTED_NODES = 1000  # JobStatus.nodes and .spares; the summary counts every one
STATUS_STATES = frozenset(RANK_STATES.values()) | {"unknown", "persisted"}  # RankStatus.state
PAGE_TOKEN = re.compile(r"g(\d{1,15})r(\d{1,10})")  # generation, first rank


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


def check_leave(req: pb.LeaveRequest) -> None:
    check_job(req.job)
    check_node(req.node_id)
    check_reason(req.reason)
    check_secret(req.session_secret)


def check_reason(reason: str) -> str:
    if len(reason) > MAX_REASON_CHARS:
        raise InvalidArgument(f"reason is {len(reason)} characters; at most {MAX_REASON_CHARS}")
    return reason


def check_rejoin(first: pb.NodeFrame) -> None:
    """What a stream's first frame carries besides its address: the session secret, and the node's
    own JoinRequest (by Join's rules, naming the frame's job and node) to rebuild a lost job from."""
    check_secret(first.session_secret)
    if not first.HasField("rejoin"):
        return
    if not first.session_secret:  # else a lost state would keep the hash of nothing as the member's
        raise InvalidArgument("a first frame with rejoin must present the node's session_secret")
    try:
        check_join(first.rejoin)
    except InvalidArgument as exc:
        raise InvalidArgument(f"rejoin: {exc}") from exc
    if (first.rejoin.job, first.rejoin.node_id) != (first.job, first.node_id):
        raise InvalidArgument("rejoin must name the job and node_id of its frame")


def spec_of(msg: pb.JobSpec) -> JobSpec:
    return JobSpec(msg.min_nodes, msg.max_nodes, msg.world_size_multiple, msg.straggler_action,
                   round(msg.straggler_factor, 4), msg.straggler_min_steps)  # a float32 on the wire


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
                or len(phase) > MAX_PHASE_CHARS or len(digest) > MAX_DIGEST_BYTES or state is None):
            _refuse_rank(r, slots)
        reports.append(RankReport(local_rank, r.pid, step, r.step_time_us / 1e6, state, r.heard_ms_ago, phase,
                                  digest_step, digest, generation, r.compute_us / 1e6, r.restarts,
                                  r.snapshot_every, r.snapshot_bytes))
    for e in frame.exits:
        if e.local_rank >= member.slots:
            raise InvalidArgument(f"exit of local_rank {e.local_rank} is out of range for {member.slots} slots")
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
            shared.shrink_of = rm.shrink_of
            shared.excluded_ranks.extend(rm.excluded_ranks)
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


@dataclass(frozen=True)
class Page:
    """Which ranks one Status answers with (StatusRequest's paging and filters, checked)."""

    size: int = DEFAULT_PAGE_SIZE
    token: tuple[int, int] | None = None  # (generation, first rank) of a next_page_token
    node: str = ""
    states: frozenset[str] = frozenset()

    @property
    def summarised(self) -> bool:
        """The first page of the whole job carries the summary (a node's ranks are about that node)."""
        return self.token is None and not self.node


def check_page(req: pb.StatusRequest) -> Page:
    if req.page_size > MAX_PAGE_SIZE:
        raise InvalidArgument(f"page_size is {req.page_size}; at most {MAX_PAGE_SIZE} (0: {DEFAULT_PAGE_SIZE})")
    if not req.job and (req.page_token or req.node):
        raise InvalidArgument("page_token and node need a job")
    token = None
    if req.page_token:
        found = PAGE_TOKEN.fullmatch(req.page_token)
        if found is None:
            raise InvalidArgument(f"page_token {shown(req.page_token)} is none that Status gave; "
                                  "ask without one for the first page")
        token = int(found[1]), int(found[2])
    if req.node:
        check_node(req.node)
    if len(req.states) > len(STATUS_STATES):
        raise InvalidArgument(f"states lists {len(req.states)} states; there are {len(STATUS_STATES)}")
    for name in req.states:
        if name not in STATUS_STATES:
            raise InvalidArgument(f"states: {shown(name)} is no rank state; use {', '.join(sorted(STATUS_STATES))}")
    return Page(req.page_size or DEFAULT_PAGE_SIZE, token, req.node, frozenset(req.states))


def rank_states(placements: Sequence[Placement], live: Liveness) -> Counter[str]:
    """The live state of every rank of `placements`, counted: one dict lookup per rank."""
    counts: Counter[str] = Counter()
    for p in placements:
        node = live.nodes.get(p.node_id)
        if node is None:
            counts["unknown"] += len(p.slots)
            continue
        ranks = node.ranks
        counts.update(r.state if (r := ranks.get(slot)) else "unknown" for slot in p.slots)
    return counts


def job_summary(state: JobState, live: Liveness | None, counts: Counter[str] | None = None) -> pb.JobSummary:
    """Counts over the whole job; `counts`: rank_states of the whole map, counted already (the
    leader counts a large map in slices, yielding to its loop between them)."""
    s = pb.JobSummary(nodes=len(state.members), spares=len(state.spares))
    rm = state.rank_map
    if rm is None or not rm.world_size:
        return s
    if live is None:
        s.rank_states["persisted"] = rm.world_size
    else:
        s.rank_states.update(rank_states(rm.placements, live) if counts is None else counts)
    return s


def rank_page(state: JobState, live: Liveness | None, page: Page) -> tuple[list[pb.RankStatus], str]:
    """One page of ranks and the token of the next ("" after the last). O(page size): placements
    are ordered by rank offset, so the page's first node is found by bisection; a states filter
    scans at most SCAN_FACTOR x page size ranks."""
    rm = state.rank_map
    start = 0
    if page.token is not None:
        generation, start = page.token
        if generation != state.generation:
            raise FailedPrecondition(f"page_token is of generation {generation}; the job is at generation "
                                     f"{state.generation}: its ranks moved, ask again without a page_token")
        if rm is None or start > rm.world_size:
            raise InvalidArgument(f"page_token starts at rank {start}, beyond the job's world size "
                                  f"{rm.world_size if rm else 0}")
    if page.node and state.member(page.node) is None:
        raise NotFound(f"node {page.node!r} is no member of job {state.job!r}")
    if rm is None:
        return [], ""
    if page.node:
        placement = rm.placement(page.node)
        placements: tuple[Placement, ...] = (placement,) if placement else ()
    else:
        placements = rm.placements
    first = max(0, bisect_right(placements, start, key=lambda p: p.rank_offset) - 1)
    budget = page.size * SCAN_FACTOR if page.states else page.size
    ranks: list[pb.RankStatus] = []
    for p in placements[first:]:
        node = live.nodes.get(p.node_id) if live else None
        member = state.member(p.node_id)
        for index in range(max(0, start - p.rank_offset), len(p.slots)):
            if len(ranks) == page.size or budget == 0:
                return ranks, f"g{state.generation}r{p.rank_offset + index}"
            budget -= 1
            slot = p.slots[index]
            r = node.ranks.get(slot) if node else None
            step = (node.vouch.step_of(node, r) if node.vouch is not None else r.step) if r else 0
            rank_state = (r.state if r else "unknown") if live else "persisted"
            if page.states and rank_state not in page.states:
                continue
            ranks.append(pb.RankStatus(rank=p.rank_offset + index, local_rank=slot, node=p.node_id,
                                       node_rank=p.node_rank, pid=r.pid if r else 0, step=step,
                                       state=rank_state, compute_us=int(r.compute_s * 1e6) if r else 0,
                                       step_time_us=int(r.step_time_s * 1e6) if r else 0,
                                       straggler_factor=r.straggler_factor if r else 0.0,
                                       phase=r.phase if r and live else "", host=member.host if member else "",
                                       restarts=r.restarts if r else 0,
                                       snapshot_every=r.snapshot_every if r else 0,
                                       snapshot_bytes=r.snapshot_bytes if r else 0))
    return ranks, ""


def job_status(state: JobState, leader: str, term: int, live: Liveness | None, brief: bool = False,
               page: Page = Page(), summary: pb.JobSummary | None = None) -> pb.JobStatus:
    """Persisted map always; pids, steps and rank states only when `live` (the leader) is given;
    `brief`: neither ranks nor nodes (O(1) in the job size). Otherwise one page of ranks, and with
    the first page (of the whole job, no node filter) the summary (`summary`, or counted here) and
    the nodes and spares (at most MAX_LISTED_NODES of each)."""
    rm = state.rank_map
    js = pb.JobStatus(
        name=state.job,
        leader=leader,
        term=term,
        generation=state.generation,
        world_size=rm.world_size if rm else 0,
        phase=state.phase.value if state.outcome is Outcome.RUNNING else "ended",  # no live phase once over
        live=live is not None,
        run=state.run,
        outcome=state.outcome.value,
        outcome_reason=state.outcome_reason,
        started_unix_ms=state.started_ms,
        ended_unix_ms=state.ended_ms,
    )
    if brief:
        return js
    ranks, js.next_page_token = rank_page(state, live, page)
    js.ranks.extend(ranks)
    if page.summarised:
        js.nodes.extend(m.node_id for m in islice(state.members, MAX_LISTED_NODES))
        js.spares.extend(state.spares[:MAX_LISTED_NODES])
        js.summary.CopyFrom(summary or job_summary(state, live))
    return js


def job_record(job: str, run: int, summary: dict, leader: str = "") -> pb.JobRecord:
    """A run as `muster jobs` lists it, from a finished run's summary or a running job's state."""
    return pb.JobRecord(name=job, run=run, outcome=summary["outcome"], reason=summary["reason"],
                        world_size=summary["world_size"], generation=summary["generation"],
                        started_unix_ms=summary["started_ms"], ended_unix_ms=summary["ended_ms"], leader=leader)


def node_kind(is_process: bool) -> NodeKind:
    return NodeKind.PROCESS if is_process else NodeKind.AGENT
