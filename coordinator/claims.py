"""Session secrets that prove, after etcd lost a job, which member a node was.

A secret is 32 random bytes (the state keeps their hash: they authenticate every Session and
Leave) and, where the replicas share a key, the generation and wall time it was issued at and a
MAC over those, the random bytes and the member it names (job, run, node id, member id). The key
comes from the tokens file's relay credential, which every replica holds and no job's token holder
sees: nothing in etcd, so it survives etcd losing the job. A leader rebuilding a lost job takes a
claim back only with a valid MAC, and only up to the generation the job could have reached since
the secret was issued.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass

RANDOM_BYTES = 32
TAG_BYTES = 16
_ISSUED = struct.Struct(">QQ")  # generation, wall ms
_MEMBER = struct.Struct(">QQ")  # run, member id
# A generation needs a decision and a fenced etcd write: far fewer than this a second. The margin
# covers the hosts' clock skew. Bounds what a proven member may claim (a claim of 2^32 a day after
# it joined is no real one).
GENERATIONS_PER_S = 1000
GENERATION_MARGIN = 1000


def member_key(credential: str) -> bytes:
    """The proof key of a relay credential (a token of the tokens file)."""
    return hmac.new(credential.encode(), b"muster member proofs v1", hashlib.sha256).digest()


@dataclass(frozen=True)
class Issued:
    """When a proven secret was handed out."""

    generation: int
    wall_ms: int

    def most_generation(self, now_ms: int) -> int:
        """The highest generation the job could have reached by `now_ms`."""
        return self.generation + GENERATION_MARGIN + GENERATIONS_PER_S * max(0, now_ms - self.wall_ms) // 1000


class MemberKeys:
    """The replicas' proof keys: the first signs, each verifies (a rotated credential's key stays
    valid for the members that joined before the rotation)."""

    def __init__(self, keys: tuple[bytes, ...]):
        self.keys = keys

    def sign(self, random: bytes, job: str, run: int, node_id: str, member_id: int, generation: int,
             wall_ms: int) -> bytes:
        issued = _ISSUED.pack(generation, wall_ms)
        return random + issued + _tag(self.keys[0], random, issued, job, run, node_id, member_id)

    def verify(self, secret: bytes, job: str, run: int, node_id: str, member_id: int) -> Issued | None:
        """When the secret was issued to this member, or None: not signed by these keys for it."""
        if len(secret) != RANDOM_BYTES + _ISSUED.size + TAG_BYTES:
            return None
        random, issued, tag = secret[:RANDOM_BYTES], secret[RANDOM_BYTES:-TAG_BYTES], secret[-TAG_BYTES:]
        if not any(hmac.compare_digest(tag, _tag(k, random, issued, job, run, node_id, member_id)) for k in self.keys):
            return None
        return Issued(*_ISSUED.unpack(issued))


def _tag(key: bytes, random: bytes, issued: bytes, job: str, run: int, node_id: str, member_id: int) -> bytes:
    named = b"\0".join((job.encode(), node_id.encode(), _MEMBER.pack(run, member_id)))
    return hmac.new(key, named + issued + random, hashlib.sha256).digest()[:TAG_BYTES]
