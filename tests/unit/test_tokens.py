"""The tokens file's roles: a job's token acts on its job only, `*` on every job, `@relay` is
the replicas' own, for the Relay call alone (security review 3, F2: a job's token made a relay), and
`@metrics` a scraper's, for /metrics alone; a reload ends the open streams it no longer admits."""

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


def test_metrics_take_the_scrapers_entry_or_an_operators_and_a_job_token_may_not():
    tokens = Tokens([("job-a", JOB), ("*", OPERATOR), ("@metrics", "m" * 16)])
    tokens.check_scrape(bearer("m" * 16))
    tokens.check_scrape(bearer(OPERATOR))
    with pytest.raises(PermissionDenied, match="'@metrics' entry, not a job's token"):
        tokens.check_scrape(bearer(JOB))
    with pytest.raises(PermissionDenied):
        tokens.check(bearer("m" * 16), "job-a")  # a scraper acts on no job
    with pytest.raises(Unauthenticated):
        tokens.check_scrape(())


def test_a_reload_ends_the_streams_whose_token_left_once_and_spares_the_others(tmp_path):
    path = tmp_path / "tokens"
    path.write_text(f"job-a {JOB}\njob-b {'b' * 16}\n")
    path.chmod(0o600)
    tokens = Tokens.load(path)
    ended: dict[str, list] = {"a": [], "b": [], "released": []}
    for name, token, job in (("a", JOB, "job-a"), ("b", "b" * 16, "job-b"), ("released", JOB, "job-a")):
        release = tokens.hold(lambda t=token, j=job: tokens.check(bearer(t), j), ended[name].append)
    release()  # the last one's stream is over: nothing more is checked of it
    path.write_text(f"job-a {'c' * 16}\njob-b {'b' * 16}\n")
    assert tokens.reload() and tokens.reload()
    assert [type(e) for e in ended["a"]] == [Unauthenticated] and "no longer admits" in str(ended["a"][0])
    assert ended["b"] == [] and ended["released"] == []


def test_a_stream_admitted_before_a_reload_that_came_while_its_port_opened_is_checked_as_it_is_held(tmp_path):
    """The edge checks a stream's token, then awaits its port (a job created, an election, a first
    message); a reload meanwhile ran before the stream was held. Held, it is checked against the file
    as it is now: a token rotated out meanwhile is refused there, not left streaming."""
    path = tmp_path / "tokens"
    path.write_text(f"job-a {JOB}\n")
    path.chmod(0o600)
    tokens = Tokens.load(path)
    tokens.check(bearer(JOB), "job-a")  # admitted
    path.write_text(f"job-a {'c' * 16}\n")
    assert tokens.reload()  # while its port opened
    ended = []
    with pytest.raises(Unauthenticated):
        tokens.hold(lambda: tokens.check(bearer(JOB), "job-a"), ended.append)
    path.write_text(f"job-a {'d' * 16}\n")
    assert tokens.reload() and ended == []  # never held: nothing to end
