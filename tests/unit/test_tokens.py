"""The tokens file's roles: a job's token acts on its job only, `*` on every job, and `@relay` is
the replicas' own, for the Relay call alone (security review 3, F2: a job's token made a relay)."""

import pytest

from muster.coordinator.auth import Tokens
from muster.coordinator.errors import PermissionDenied, Unauthenticated

JOB, OPERATOR, RELAY = "j" * 16, "o" * 16, "r" * 16
TOKENS = Tokens([("job-a", JOB), ("*", OPERATOR), ("@relay", RELAY)])


def bearer(token: str):
    return (("authorization", f"Bearer {token}"),)


def test_only_the_relay_entry_or_an_operator_may_relay_and_a_job_token_may_not():
    TOKENS.check_relay(bearer(RELAY))
    TOKENS.check_relay(bearer(OPERATOR))
    with pytest.raises(PermissionDenied, match="'@relay' entry, not a job's token"):
        TOKENS.check_relay(bearer(JOB))
    with pytest.raises(Unauthenticated):
        TOKENS.check_relay(bearer("x" * 16))


def test_the_relay_token_acts_on_no_job():
    with pytest.raises(PermissionDenied):
        TOKENS.check(bearer(RELAY), "job-a")
    with pytest.raises(PermissionDenied):
        TOKENS.check(bearer(RELAY), "")


def test_a_replica_relays_with_the_relay_entry_else_the_operators_else_none():
    assert TOKENS.relay_token() == RELAY
    assert Tokens([("job-a", JOB), ("*", OPERATOR)]).relay_token() == OPERATOR
    assert Tokens([("job-a", JOB)]).relay_token() == ""


def test_a_token_the_file_does_not_know_is_refused_before_any_job_is_named():
    assert TOKENS.grants(bearer(JOB)) == ["job-a"]
    with pytest.raises(Unauthenticated, match="no token"):
        TOKENS.grants(())
