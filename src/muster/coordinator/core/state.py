"""The persisted state of one job: members, the current rank map and the change history.

It changes only with membership (never per heartbeat) and is written to etcd, fenced on the
leader's term, before any directive about it leaves the leader. Values are immutable.
"""

from __future__ import annotations

import hmac
import json
import secrets
import threading
import zlib
from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache
from enum import Enum
from itertools import accumulate, count, repeat
from json.encoder import encode_basestring_ascii
from operator import attrgetter
from typing import Iterable, NamedTuple

from muster.coordinator.core.pages import PageCache, split
from muster.coordinator.core.policy import JobSpec

SCHEMA = 2  # 2: a placement is written without node_rank and rank_offset (its order gives them)
READS = (1, 2)
_NODE_ID, _JSON, _SEQ = attrgetter("node_id"), attrgetter("json"), attrgetter("seq")  # the passes over every node run in C
COMPRESS_ABOVE = 256 * 1024  # bytes of JSON; smaller states stay readable with etcdctl
_PAGE_CACHES: dict[str, PageCache] = {}
_PAGE_CACHES_LOCK = threading.Lock()
_CACHED_JOBS = 16  # the large jobs whose pages are kept (the oldest dropped past it)
_ITEMS = "\x00"  # where the members' and the placements' items go (JSON text never holds a raw NUL)


class NodeKind(str, Enum):
    AGENT = "agent"  # a node agent supervising local ranks; its stream may reconnect
    PROCESS = "process"  # one training process talking directly; its stream closing is its exit


class Phase(str, Enum):
    FORMING = "forming"  # no map yet: waiting for min_nodes (and the last call)
    RUNNING = "running"
    WAITING = "waiting"  # had a map, fell below min_nodes


class Outcome(str, Enum):
    """How a run of a job ended: set once, never changed (`running` until then)."""

    RUNNING = "running"
    SUCCEEDED = "succeeded"  # every rank of its last map completed its script
    FAILED = "failed"  # a rank failed while it was finishing, every node was lost, or it waited too long
    STOPPED = "stopped"  # an operator stopped it (or every node was drained)


@dataclass(frozen=True)
class Member:
    node_id: str
    member_id: int  # this incarnation; a node that rejoins gets a new one
    host: str
    store_port: int
    slots: int
    seq: int  # join order: lower is older
    kind: NodeKind = NodeKind.AGENT
    down_slots: frozenset[int] = frozenset()  # slots whose rank failed and has not come back
    master_port: int = 0  # where its rank 0 would host a plain env:// store (0: none)
    # SHA-256 (hex) of the session secret handed to the node at Join: its Session and Leave present
    # the secret (member_id alone is guessable). "": a member of a state written before secrets.
    secret_hash: str = ""
    # Taken back on a claim its secret proved, in a rebuild still going on: it outranks the members
    # nobody could prove (`machine._rebuild`), and no claim but a proven one takes its place.
    proven: bool = False
    # When (wall ms) its ranks last failed of their own fault, the newest last (at most
    # HOLD_OUT_FAILURES): persisted so that a new leader counts on toward holding the node out.
    faults_ms: tuple[int, ...] = ()
    # Each slot's last failure, (slot, error digest, step, pid): persisted so that a new leader knows a
    # restart that fails the same way again as a repeat (`ExitBook.repeated`), as the last one would.
    last_errors: tuple[tuple[int, str, int, int], ...] = ()

    @cached_property  # a member never changes: assigning ranks asks it of every member
    def usable_slots(self) -> tuple[int, ...]:
        return tuple(s for s in range(self.slots) if s not in self.down_slots)

    def admits(self, secret_hash: str) -> bool:
        """The presented secret (by its hash) is this member's; in constant time."""
        return not self.secret_hash or hmac.compare_digest(self.secret_hash, secret_hash)

    @cached_property
    def json(self) -> str:
        """Its part of the encoded state, made once (a state is written at every change)."""
        return _json({"node_id": self.node_id, "member_id": self.member_id, "host": self.host,
                      "store_port": self.store_port, "slots": self.slots, "seq": self.seq, "kind": self.kind.value,
                      "down_slots": sorted(self.down_slots), "master_port": self.master_port,
                      "secret_hash": self.secret_hash, **({"proven": True} if self.proven else {}),
                      **({"faults_ms": list(self.faults_ms)} if self.faults_ms else {}),
                      **({"last_errors": [list(e) for e in self.last_errors]} if self.last_errors else {})})


@lru_cache(maxsize=1024)
def _slots_json(slots: tuple[int, ...]) -> str:
    """A placement's slots as JSON: a job's nodes have a few shapes, so a renumbered map mostly hits."""
    return f"[{','.join(map(str, slots))}]"


class _Placed(NamedTuple):
    node_id: str
    node_rank: int
    rank_offset: int
    slots: tuple[int, ...]  # local ranks in use, ascending (local_rank follows the slot)
    # Its part of the encoded state, made with it: the node and its slots, not its numbers (which
    # follow from the map's order), so a placement a loss renumbered keeps the text, and the
    # pages that hold it their compressed form (`encode`).
    json: str


class Placement(_Placed):
    """One node's part of a rank map: rank = rank_offset + index of local_rank in slots.

    A tuple, so that a loss's renumbering of the placements after it is made in C
    (`renumbered`): as frozen dataclasses, the 85k new ones after a loss in the middle of a
    125k-node map were two fifths of the change's CPU."""

    __slots__ = ()

    def __new__(cls, node_id: str, node_rank: int, rank_offset: int, slots: tuple[int, ...],
                json: str | None = None) -> Placement:
        return tuple.__new__(cls, (node_id, node_rank, rank_offset, slots, json if json is not None else
                                   f'{{"node_id":{encode_basestring_ascii(node_id)},"slots":{_slots_json(slots)}}}'))

    def __repr__(self) -> str:
        return f"Placement({self.node_id!r}, {self.node_rank}, {self.rank_offset}, {self.slots})"

    def rank_of(self, local_rank: int) -> int:
        return self.rank_offset + self.slots.index(local_rank)


def renumbered(node_ids: Iterable[str], first_node_rank: int, offsets: Iterable[int],
               slots: Iterable[tuple[int, ...]], jsons: Iterable[str]) -> list[Placement]:
    """Placements numbered from `first_node_rank` and `offsets`, with their encoded texts given:
    made in C, without a Python call per placement."""
    return list(map(tuple.__new__, repeat(Placement), zip(node_ids, count(first_node_rank), offsets, slots, jsons)))


@dataclass(frozen=True)
class RankMap:
    generation: int
    world_size: int
    placements: tuple[Placement, ...]  # by node_rank
    store_address: str
    abort_previous: bool
    switch_at_step: int  # planned: switch after this step; 0 with abort
    master_address: str = ""  # rank 0's node host:master_port, for scripts without the library
    shrink_of: int = 0  # loss-only: the generation whose group survivors may shrink (rankmap.shrink_of)
    excluded_ranks: tuple[int, ...] = ()  # with shrink_of: its ranks this map leaves out
    # Usable slots of the job's nodes this map does not place (its size rules, spares): a rank there
    # may hold state the placed ones lack, so a sharded layout's ranks wait rather than call it lost.
    left_out: int = 0

    @cached_property
    def by_node(self) -> dict[str, Placement]:
        """The placements by node id (a loop over every node looks up in it, not through `placement`)."""
        return dict(zip(map(_NODE_ID, self.placements), self.placements))  # in C: 125k in a few ms

    def placement(self, node_id: str) -> Placement | None:
        return self.by_node.get(node_id)

    @property
    def planned(self) -> bool:
        """Switched to after a step of the group before it, not formed at once (an abort, a first map)."""
        return not self.abort_previous and self.switch_at_step > 0

    @property
    def node_ids(self) -> tuple[str, ...]:
        return tuple(map(_NODE_ID, self.placements))


@dataclass(frozen=True)
class Event:
    """One entry of the membership history."""

    generation: int
    term: int
    time_unix_ms: int
    kind: str
    reason: str
    nodes: tuple[str, ...] = ()
    world_size: int = 0


@dataclass(frozen=True)
class JobState:
    job: str
    spec: JobSpec
    term: int = 0  # term of the leader that wrote it
    generation: int = 0
    phase: Phase = Phase.FORMING
    members: tuple[Member, ...] = ()  # by seq
    rank_map: RankMap | None = None
    history: tuple[Event, ...] = ()
    next_seq: int = 1
    # The leader found no state (etcd lost it): nodes that were members are taken back as they
    # reconnect, until rebuild_deadline; then one abort generation re-forms them.
    rebuilding: bool = False
    # ...and no spec either: `spec` is the coordinator's default until the first node taken back
    # (or joining) brings its own. Not persisted: any state written has a node's spec.
    spec_lost: bool = field(default=False, compare=False)
    forming_deadline: float | None = field(default=None, compare=False)  # monotonic; not persisted
    rebuild_deadline: float | None = field(default=None, compare=False)  # monotonic; not persisted
    # What the nodes taken back said they ran: (node_id, generation, its world size, the node's ranks
    # in it). Not persisted: a rebuild a later leader finishes aborts, as before.
    rebuild_claims: tuple[tuple[str, int, int, int], ...] = field(default=(), compare=False)
    # A job's life: the run of its name (a finished name joined again starts run + 1), when it
    # started and ended (wall ms), and how. `finishing`: a rank of the map completed its script, so
    # nothing re-forms the job any more; `failure` the first failure seen since (the outcome's reason).
    run: int = 1
    outcome: Outcome = Outcome.RUNNING
    outcome_reason: str = ""
    started_ms: int = 0
    ended_ms: int = 0
    finishing: bool = False
    failure: str = ""
    waiting_deadline: float | None = field(default=None, compare=False)  # monotonic; not persisted
    # The job's own random key for its generations' store prefixes (wire.store_prefix): the stores
    # have no auth, so keys are planted ahead of time unless no one off the stream can name the prefix.
    store_salt: str = field(default_factory=lambda: secrets.token_hex(16), compare=False, repr=False)

    @property
    def ended(self) -> bool:
        return self.outcome is not Outcome.RUNNING

    @property
    def frozen(self) -> bool:
        """No new generation: the job is finishing, or its run ended (members drain)."""
        return self.finishing or self.ended

    @cached_property
    def members_by_node(self) -> dict[str, Member]:
        return dict(zip(map(_NODE_ID, self.members), self.members))

    def member(self, node_id: str) -> Member | None:
        return self.members_by_node.get(node_id)

    def left(self, node_id: str) -> Event | None:
        """How `node_id` left, if it is no member because it left (a drain, a signal to its agent, its
        ranks' end) rather than being lost or never joining: the history's last entry about it alone
        (a departure's "finishing" note aside). What a drain repeated is answered with."""
        if self.member(node_id) is not None:
            return None
        for e in reversed(self.history):
            if e.nodes == (node_id,) and e.kind != "finishing":
                return e if e.kind in ("node_left", "node_finished") else None
        return None

    @property
    def rebuilt_members(self) -> bool:
        """Rebuilding, and nodes were taken back (they claim generations > 0): the job runs on
        in their old groups until the rebuild ends; nothing is published before."""
        return self.rebuilding and self.generation > 0

    @cached_property
    def spares(self) -> tuple[str, ...]:
        """Members with usable slots that the map does not use (O(nodes): once per state, which
        every Status summary and metrics scrape reads)."""
        used = set(self.rank_map.node_ids) if self.rank_map else set()
        return tuple(m.node_id for m in self.members if m.node_id not in used and m.usable_slots)

    def with_members(self, members: tuple[Member, ...]) -> JobState:
        return replace(self, members=tuple(sorted(members, key=_SEQ)))


def _spec_doc(spec: JobSpec) -> dict:
    """The spec's fields, its straggler policy and on_state_lost only where the job sets them: a replica
    of the version before them reads every other job's spec during a rolling upgrade."""
    return {k: v for k, v in vars(spec).items() if not (k.startswith("straggler_") or k == "on_state_lost") or v}


def encode_spec(spec: JobSpec, run: int) -> bytes:
    """A job's spec as etcd keeps it: its sizes and the run of its name it was created for."""
    return _json({**_spec_doc(spec), "run": run}).encode()


def decode_spec(data: bytes) -> tuple[JobSpec, int]:
    doc = json.loads(data)
    run = doc.pop("run", 1)  # specs written before runs: the first
    return JobSpec(**doc), run


def run_summary(state: JobState) -> bytes:
    """What `muster jobs` lists of a finished run (its record holds the rest)."""
    rm = state.rank_map
    return _json({"outcome": state.outcome.value, "reason": state.outcome_reason, "generation": state.generation,
                  "world_size": rm.world_size if rm else 0, "started_ms": state.started_ms,
                  "ended_ms": state.ended_ms}).encode()


def _json(value) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


def _object(parts: dict[str, str]) -> str:
    """A JSON object of already encoded values, keys sorted as `_json` sorts them."""
    return "{" + ",".join(f"{_json(key)}:{parts[key]}" for key in sorted(parts)) + "}"


def encode(state: JobState) -> bytes:
    """JSON, so `etcdctl get` shows something an operator can read; zlib-compressed past
    COMPRESS_ABOVE bytes, so a 100k-rank job stays under etcd's request limit (1.5 MiB). Members
    and placements keep their encoded text: a change re-encodes only what changed."""
    rm = state.rank_map
    doc = {
        "schema": _json(SCHEMA),
        "job": _json(state.job),
        "spec": _json(_spec_doc(state.spec)),
        "term": _json(state.term),
        "generation": _json(state.generation),
        "phase": _json(state.phase.value),
        "next_seq": _json(state.next_seq),
        "rebuilding": _json(state.rebuilding),
        "run": _json(state.run),
        "outcome": _json(state.outcome.value),
        "outcome_reason": _json(state.outcome_reason),
        "started_ms": _json(state.started_ms),
        "ended_ms": _json(state.ended_ms),
        "finishing": _json(state.finishing),
        "failure": _json(state.failure),
        "store_salt": _json(state.store_salt),
        "members": f"[{_ITEMS}]",
        "rank_map": "null" if rm is None else _object({
            "generation": _json(rm.generation),
            "world_size": _json(rm.world_size),
            "store_address": _json(rm.store_address),
            "abort_previous": _json(rm.abort_previous),
            "switch_at_step": _json(rm.switch_at_step),
            "master_address": _json(rm.master_address),
            "shrink_of": _json(rm.shrink_of),
            "excluded_ranks": _json(list(rm.excluded_ranks)),
            "left_out": _json(rm.left_out),
            "placements": f"[{_ITEMS}]",
        }),
        "history": _json([
            {
                "generation": e.generation,
                "term": e.term,
                "time_unix_ms": e.time_unix_ms,
                "kind": e.kind,
                "reason": e.reason,
                "nodes": list(e.nodes),
                "world_size": e.world_size,
            }
            for e in state.history
        ]),
    }
    text = _object(doc).split(_ITEMS)  # the text around the members' items, and the placements'
    sources = [state.members] + ([rm.placements] if rm else [])
    items = [list(map(_JSON, source)) for source in sources]
    size = sum(map(len, text)) + sum(sum(map(len, part)) + len(part) for part in items)
    if size <= COMPRESS_ABOVE:
        return "".join(t + ",".join(part) for t, part in zip(text, items + [[]])).encode()
    # Compressed in pages, this job's kept from its last write: a change compresses what it changed.
    parts: list = [text[0]]
    for part, source, after in zip(items, sources, text[1:]):
        parts += [split(part, map(_NODE_ID, source)), after]
    return _page_cache(state.job).compress(parts)


def _page_cache(job: str) -> PageCache:
    with _PAGE_CACHES_LOCK:  # jobs' writes are encoded in worker threads
        cache = _PAGE_CACHES.pop(job, None) or PageCache()
        _PAGE_CACHES[job] = cache  # the most recent last
        while len(_PAGE_CACHES) > _CACHED_JOBS:
            _PAGE_CACHES.pop(next(iter(_PAGE_CACHES)))
    return cache


def _placed(docs: list[dict]) -> tuple[Placement, ...]:
    """A rank map's placements from their documents, numbered by their order (schema 1 wrote the
    numbers too, always these)."""
    slots = [tuple(p["slots"]) for p in docs]
    return tuple(Placement(p["node_id"], node_rank, offset, s)
                 for node_rank, (p, offset, s) in enumerate(zip(docs, accumulate(map(len, slots), initial=0), slots)))


def decode(data: bytes) -> JobState:
    doc = json.loads(data if data[:1] == b"{" else zlib.decompress(data))
    if doc.get("schema") not in READS:
        raise ValueError(f"unsupported job state schema {doc.get('schema')!r} (this build reads "
                         f"{', '.join(map(str, READS))})")
    rm = doc["rank_map"]
    return JobState(
        job=doc["job"],
        spec=JobSpec(**doc["spec"]),
        term=doc["term"],
        generation=doc["generation"],
        phase=Phase(doc["phase"]),
        next_seq=doc["next_seq"],
        rebuilding=doc.get("rebuilding", False),
        run=doc.get("run", 1),
        outcome=Outcome(doc.get("outcome", "running")),
        outcome_reason=doc.get("outcome_reason", ""),
        started_ms=doc.get("started_ms", 0),
        ended_ms=doc.get("ended_ms", 0),
        finishing=doc.get("finishing", False),
        failure=doc.get("failure", ""),
        **({"store_salt": doc["store_salt"]} if "store_salt" in doc else {}),  # else a new one: written before salts
        members=tuple(
            Member(**{**m, "kind": NodeKind(m["kind"]), "down_slots": frozenset(m["down_slots"]),
                      "faults_ms": tuple(m.get("faults_ms", ())),
                      "last_errors": tuple(tuple(e) for e in m.get("last_errors", ()))})
            for m in doc["members"]
        ),
        rank_map=None
        if rm is None
        else RankMap(
            generation=rm["generation"],
            world_size=rm["world_size"],
            store_address=rm["store_address"],
            abort_previous=rm["abort_previous"],
            switch_at_step=rm["switch_at_step"],
            master_address=rm.get("master_address", ""),
            shrink_of=rm.get("shrink_of", 0),
            excluded_ranks=tuple(rm.get("excluded_ranks", ())),
            left_out=rm.get("left_out", 0),
            placements=_placed(rm["placements"]),
        ),
        history=tuple(Event(**{**e, "nodes": tuple(e["nodes"])}) for e in doc["history"]),
    )
