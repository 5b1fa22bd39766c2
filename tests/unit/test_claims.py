"""Session secrets that prove a member after etcd lost its job (`claims`), and the claims a leader
takes back with them (`claims.rejoin_of`)."""

import secrets

import pytest

from muster.coordinator.claims import (GENERATION_MARGIN, GENERATIONS_PER_S, MemberKeys, member_key, rejoin_of,
                                      secret_hash)
from muster.coordinator.errors import InvalidArgument, NotFound
from muster.v1 import muster_pb2 as pb

KEYS = MemberKeys((member_key("r" * 24),))
NOW_MS = 1_700_000_000_000


def signed(keys=KEYS, member_id=3, started_ms=NOW_MS):
    return keys.sign(secrets.token_bytes(32), "job-a", 1, "n1", member_id, started_ms)


def claim(secret: bytes, member_id=3, generation=8, node_id="n1") -> pb.NodeFrame:
    return pb.NodeFrame(job="job-a", node_id=node_id, member_id=member_id, generation=generation,
                        session_secret=secret, rejoin=pb.JoinRequest(job="job-a", node_id=node_id, slots=1,
                                                                     host="10.0.0.1", store_port=29500))


def test_a_signed_secret_proves_only_the_member_it_was_issued_to_and_when_its_run_started():
    secret = signed()
    assert len(secret) <= 64 and secret_hash(secret) == secret_hash(secret[:32])
    assert KEYS.verify(secret, "job-a", 1, "n1", 3) == NOW_MS
    for job, run, node, member in [("job-b", 1, "n1", 3), ("job-a", 2, "n1", 3), ("job-a", 1, "n2", 3),
                                   ("job-a", 1, "n1", 1)]:
        assert KEYS.verify(secret, job, run, node, member) is None
    tampered = secret[:32] + (NOW_MS + 1).to_bytes(8, "big") + secret[40:]  # a run started later
    assert KEYS.verify(tampered, "job-a", 1, "n1", 3) is None
    assert KEYS.verify(secrets.token_bytes(32), "job-a", 1, "n1", 3) is None
    assert MemberKeys((member_key("j" * 24),)).verify(secret, "job-a", 1, "n1", 3) is None


def test_a_rotated_key_still_proves_the_members_it_signed():
    rotated = MemberKeys((member_key("new" * 8), *KEYS.keys))
    assert rotated.verify(signed(), "job-a", 1, "n1", 3) is not None
    assert KEYS.verify(signed(rotated), "job-a", 1, "n1", 3) is None


def test_a_claim_is_proven_by_its_secret_and_bounded_by_the_generations_since_its_run_started():
    secret = signed(started_ms=NOW_MS - 10_000)
    rejoin = rejoin_of(claim(secret, generation=9), 1, KEYS, NOW_MS)
    assert rejoin.proven and rejoin.run_started_ms == NOW_MS - 10_000 and rejoin.secret_hash == secret_hash(secret)
    most = GENERATION_MARGIN + 10 * GENERATIONS_PER_S
    assert rejoin_of(claim(secret, generation=most), 1, KEYS, NOW_MS).proven
    for generation in (most + 1, 2**32):
        with pytest.raises(InvalidArgument, match=f"reached {most} at most"):
            rejoin_of(claim(secret, generation=generation), 1, KEYS, NOW_MS)


@pytest.mark.parametrize("frame", [claim(b"s" * 32), claim(signed(), member_id=1), claim(signed(), node_id="evil")])
def test_a_claim_its_secret_does_not_prove_is_told_to_join_again(frame):
    with pytest.raises(NotFound, match="cannot prove it was member .*join again"):
        rejoin_of(frame, 1, KEYS, NOW_MS)


def test_without_a_key_a_claim_is_taken_unproven():
    assert not rejoin_of(claim(b"s" * 32), 1, None, NOW_MS).proven
