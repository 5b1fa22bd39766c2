"""Session secrets that prove, after etcd lost a job, which member a node was.

A secret is 32 random bytes (the state keeps their hash: they authenticate every Session and
Leave) and, where the replicas share a key, the wall time its run started at and a MAC over that,
the random bytes and the member it names (job, run, node id, member id). The key comes from the
tokens file's relay credential, which every replica holds and no job's token holder sees: nothing
in etcd, so it survives etcd losing the job. A leader rebuilding a lost job takes a claim back only
with a valid MAC, and only up to the generation a run could have reached since it started; the
run's start tells the run a node was a member of from a run made anew under the same number.

A first frame that says who its node was (`rejoin`) is such a claim: checked here by the rules a
leader takes it back by (`rejoin_of`), also where a replica that does not know the job creates it.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from collections.abc import Callable

from muster.coordinator import wire
from muster.coordinator.core.machine import Rejoin
from muster.coordinator.core.state import JobState
from muster.coordinator.errors import InvalidArgument, NotFound
from muster.v1 import muster_pb2 as pb

RANDOM_BYTES = 32
TAG_BYTES = 16
_STARTED = struct.Struct(">Q")  # the run's start, wall ms
_MEMBER = struct.Struct(">QQ")  # run, member id
# A generation needs a decision and a fenced etcd write: far fewer than this a second. The margin
# covers the hosts' clock skew. Bounds what a proven member may claim (a claim of 2^32 a day after
# its run started is no real one).
GENERATIONS_PER_S = 1000
GENERATION_MARGIN = 1000


def member_key(credential: str) -> bytes:
    """The proof key of a relay credential (a token of the tokens file)."""
    return hmac.new(credential.encode(), b"muster member proofs v1", hashlib.sha256).digest()


def most_generation(run_started_ms: int, now_ms: int) -> int:
    """The highest generation a run started at `run_started_ms` could have reached by `now_ms`."""
    return GENERATION_MARGIN + GENERATIONS_PER_S * max(0, now_ms - run_started_ms) // 1000


class MemberKeys:
    """The replicas' proof keys: the first signs, each verifies (a rotated credential's key stays
    valid for the members that joined before the rotation)."""

    def __init__(self, keys: tuple[bytes, ...]):
        self.keys = keys

    def sign(self, random: bytes, job: str, run: int, node_id: str, member_id: int, run_started_ms: int) -> bytes:
        started = _STARTED.pack(run_started_ms)
        return random + started + _tag(self.keys[0], random, started, job, run, node_id, member_id)

    def verify(self, secret: bytes, job: str, run: int, node_id: str, member_id: int) -> int | None:
        """When the run the secret was issued in started (wall ms), or None: not signed by these
        keys for this member."""
        if len(secret) != RANDOM_BYTES + _STARTED.size + TAG_BYTES:
            return None
        random, started, tag = secret[:RANDOM_BYTES], secret[RANDOM_BYTES:-TAG_BYTES], secret[-TAG_BYTES:]
        if not any(hmac.compare_digest(tag, _tag(k, random, started, job, run, node_id, member_id))
                   for k in self.keys):
            return None
        return _STARTED.unpack(started)[0]


def _tag(key: bytes, random: bytes, started: bytes, job: str, run: int, node_id: str, member_id: int) -> bytes:
    named = b"\0".join((job.encode(), node_id.encode(), _MEMBER.pack(run, member_id)))
    return hmac.new(key, named + started + random, hashlib.sha256).digest()[:TAG_BYTES]


def random_part(join: pb.JoinRequest) -> bytes:
    """A new member's secret's random bytes: from the Join's key and the node it names when it gives
    a key (an attempt repeated after its answer was lost then gets the secret whose hash its
    membership holds), otherwise fresh."""
    if not join.join_key:
        return secrets.token_bytes(RANDOM_BYTES)
    named = b"\0".join((b"muster join key v1", join.job.encode(), join.node_id.encode(), join.join_key))
    return hashlib.sha256(named).digest()[:RANDOM_BYTES]


def secret_hash(secret: bytes) -> str:
    """What the state keeps of a session secret: the SHA-256 of its random part, never the secret
    (the rest, its proof for a rebuild, is made once the member id is known: `claims`)."""
    return hashlib.sha256(secret[:RANDOM_BYTES]).hexdigest()


def check_rejoin(first: pb.NodeFrame) -> None:
    """What a stream's first frame carries besides its address: the session secret, and the node's
    own JoinRequest (by Join's rules, naming the frame's job and node) to rebuild a lost job from."""
    wire.check_secret(first.session_secret)
    if not first.HasField("rejoin"):
        return
    if not first.session_secret:  # else a lost state would keep the hash of nothing as the member's
        raise InvalidArgument("a first frame with rejoin must present the node's session_secret")
    try:
        wire.check_join(first.rejoin)
    except InvalidArgument as exc:
        raise InvalidArgument(f"rejoin: {exc}") from exc
    if (first.rejoin.job, first.rejoin.node_id) != (first.job, first.node_id):
        raise InvalidArgument("rejoin must name the job and node_id of its frame")


def taken_back(first: pb.NodeFrame, state: JobState, member_keys: Callable[[], MemberKeys | None]) -> bool:
    """Whether a first frame is a claim the core decides on (a `Rejoin`), not a member's stream: it
    says who its node was, is not the member the node is now, and either the job's lost state is
    being rebuilt from its nodes or the claim proves itself by its secret (it then displaces whoever
    took the node id unproven; the core decides whether the running state is a run made anew since
    etcd lost the one it ran, else it is told NOT_FOUND)."""
    if not first.HasField("rejoin"):
        return False
    member = state.member(first.node_id)
    if member is not None and member.member_id == first.member_id and member.admits(secret_hash(first.session_secret)):
        return False
    if state.rebuilding:
        return True
    keys = member_keys()  # only now: most frames never get here
    return keys is not None and keys.verify(first.session_secret, state.job, state.run, first.node_id,
                                            first.member_id) is not None


def rejoin_of(first: pb.NodeFrame, run: int, keys: MemberKeys | None, now_ms: int) -> Rejoin:
    """The member a node that is no member says it was (a lost state rebuilt): for the core to take
    back. Where the replicas share a proof key the claim must prove it (else the node joins anew,
    told NOT_FOUND, as any node that is no member: a forged claim never reaches the core) and its
    generation is bounded by when its run started; without a key it is taken unproven."""
    started_ms = 0
    if keys is not None:
        started_ms = keys.verify(first.session_secret, first.job, run, first.node_id, first.member_id)
        if started_ms is None:
            raise NotFound(f"node {first.node_id!r} cannot prove it was member {first.member_id} of job "
                           f"{first.job!r}: its session secret is none a replica signed for that member; join again")
        most = most_generation(started_ms, now_ms)
        if first.generation > most:
            raise InvalidArgument(f"member {first.member_id} of job {first.job!r} claims generation "
                                  f"{first.generation}; its run started {max(0, now_ms - started_ms) / 1000:.0f}s "
                                  f"ago: it could have reached {most} at most")
    r = first.rejoin
    return Rejoin(first.node_id, first.member_id, first.generation, secret_hash(first.session_secret), r.host,
                  r.store_port, r.slots, wire.node_kind(r.is_process), r.master_port, wire.spec_of(r.spec),
                  run_started_ms=started_ms, world_size=first.world_size, local_world_size=first.local_world_size)


def check_claim(first: pb.NodeFrame, keys: MemberKeys | None, now_ms: int) -> None:
    """A rejoining node's claim, checked as its leader will (`rejoin_of`) before a replica that
    does not know the job (etcd lost it) creates the job from it: a forged claim creates none."""
    check_rejoin(first)
    rejoin_of(first, first.run, keys, now_ms)
