"""Session secrets that prove, after etcd lost a job, which member a node was.

A secret is 32 random bytes (the state keeps their hash: they authenticate every Session and
Leave) and, where the replicas share a key, the wall time its run started at and a MAC over that,
the random bytes and the member it names (job, run, node id, member id). The key comes from the
tokens file's relay credential, which every replica holds and no job's token holder sees: nothing
in etcd, so it survives etcd losing the job. A leader rebuilding a lost job takes a claim back only
with a valid MAC, and only up to the generation a run could have reached since it started; the
run's start tells the run a node was a member of from a run made anew under the same number.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

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
