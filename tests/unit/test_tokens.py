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


def tokens_file(path, text: str, mode: int = 0o600):
    path.write_text(text)
    path.chmod(mode)
    return path


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644])
def test_a_tokens_file_group_or_others_may_read_is_refused_in_one_line(tmp_path, mode):
    path = tokens_file(tmp_path / "tokens", f"job-a {JOB}\n", mode)
    with pytest.raises(ValueError) as refused:
        Tokens.load(path)
    assert str(refused.value) == f"{path}: mode {mode:04o} lets group or others read it; chmod 600 {path}"


def test_only_a_whole_line_is_a_comment_and_a_token_may_hold_a_hash(tmp_path):
    path = tokens_file(tmp_path / "tokens", f"# the job's\n  # indented\njob-a {JOB}#tail\n* {OPERATOR}\n")
    tokens = Tokens.load(path)
    assert tokens.entries == [("job-a", JOB + "#tail"), ("*", OPERATOR)]
    with pytest.raises(Unauthenticated):
        tokens.grants(bearer(JOB))  # the token is the whole word, '#' and all
    path = tokens_file(tmp_path / "bad", f"job-a {JOB} # a trailing note\n")
    with pytest.raises(ValueError, match="bad:1: expected 'JOB TOKEN'"):
        Tokens.load(path)


def test_a_reload_takes_the_new_tokens_and_a_file_that_does_not_load_leaves_them(tmp_path):
    path = tokens_file(tmp_path / "tokens", f"job-a {JOB}\n@relay {RELAY}\n")
    tokens = Tokens.load(path)
    assert not tokens.changed()
    keys = tokens.member_keys()
    secret = keys.sign(b"x" * 32, "job-a", 1, "n1", 1, 1_700_000_000_000)
    new_job, new_relay = "k" * 16, "s" * 16
    tokens_file(tmp_path / "next", f"job-a {new_job}\n@relay {new_relay}\n")
    (tmp_path / "next").replace(path)  # as an editor or a mounted Secret writes it
    assert tokens.changed() and tokens.reload() and not tokens.changed()
    assert tokens.grants(bearer(new_job)) == ["job-a"]
    with pytest.raises(Unauthenticated):
        tokens.grants(bearer(JOB))
    assert tokens.member_keys().verify(secret, "job-a", 1, "n1", 1), "members who joined before still prove it"
    path.chmod(0o644)
    assert not tokens.reload() and tokens.grants(bearer(new_job)) == ["job-a"]
    tokens_file(path, "job-a short\n")
    assert not tokens.reload() and tokens.grants(bearer(new_job)) == ["job-a"]
