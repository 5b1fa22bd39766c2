"""The CLI's defaults that save typing: --coordinator and --job from the environment, then the
address `muster serve` listens on; --version."""

import subprocess
import sys

import pytest

from muster.cli import parser
from muster.cli.flags import DEFAULT_ADDRESS, from_environment as _from_environment


def parsed(argv, monkeypatch, **env):
    for name in ("MUSTER_COORDINATOR", "MUSTER_JOB"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    p = parser()
    args = p.parse_args(argv)
    _from_environment(p, args)
    return args


def test_the_coordinator_comes_from_the_flag_then_the_environment_then_the_serve_default(monkeypatch):
    assert parsed(["status"], monkeypatch).coordinator == DEFAULT_ADDRESS == "127.0.0.1:7600"
    assert parsed(["status"], monkeypatch, MUSTER_COORDINATOR="10.0.0.1:9").coordinator == "10.0.0.1:9"
    assert parsed(["status", "--coordinator", "h:1"], monkeypatch, MUSTER_COORDINATOR="10.0.0.1:9").coordinator == "h:1"


def test_the_job_comes_from_the_environment_where_a_verb_needs_one(monkeypatch, capsys):
    assert parsed(["events"], monkeypatch, MUSTER_JOB="j").job == "j"
    assert parsed(["run", "--", "python", "x.py"], monkeypatch, MUSTER_JOB="j").job == "j"
    assert parsed(["status"], monkeypatch).job is None  # every job
    with pytest.raises(SystemExit) as missing:
        parsed(["events"], monkeypatch)
    assert missing.value.code == 2 and "the job is required: muster events JOB (or set MUSTER_JOB)" in capsys.readouterr().err
    assert parsed(["events", "--job", "j"], monkeypatch).job == "j"  # the alias


def test_version():
    out = subprocess.run([sys.executable, "-m", "muster.cli", "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("muster ")


@pytest.mark.parametrize("argv,says", [
    (["--listen", "nonsense"], "--listen: address 'nonsense' is not HOST:PORT"),
    (["--listen", "127.0.0.1:7600", "--metrics-listen", "x"], "--metrics-listen: address 'x' is not HOST:PORT"),
    (["--listen", "0.0.0.0:7600"], "reaches beyond this host with neither TLS (--tls-cert) nor tokens (--tokens)"),
])
def test_serve_refuses_a_bad_or_open_address_in_one_line_before_starting_anything(argv, says, tmp_path):
    out = subprocess.run([sys.executable, "-m", "muster.cli", "serve", "--data-dir", str(tmp_path), *argv],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0 and says in out.stderr, out.stderr
    assert not (tmp_path / "etcd").exists(), "no etcd started for a refused command line"


def test_an_open_address_is_served_with_tls_tokens_or_insecure():
    from muster.cli.serve import check_listen as _check_listen

    p = parser()
    for extra in (["--insecure"], ["--tokens", "t"], ["--listen", "[::1]:7600"], ["--listen", "localhost:7600"]):
        _check_listen(p.parse_args(["serve", "--listen", "0.0.0.0:7600", *extra]), tls=False)
    _check_listen(p.parse_args(["serve", "--listen", "0.0.0.0:7600"]), tls=True)


def test_the_page_beyond_loopback_needs_tokens_and_tls_or_insecure():
    """It takes tokens, operators' too: never in the clear (review 5, M3)."""
    from muster.cli.serve import check_listen as _check_listen

    p = parser()
    page = ["serve", "--metrics-listen", "0.0.0.0:9090", "--http"]
    _check_listen(p.parse_args([*page, "--tokens", "t"]), tls=True)
    _check_listen(p.parse_args([*page, "--insecure"]), tls=False)
    _check_listen(p.parse_args(["serve", "--metrics-listen", "127.0.0.1:9090", "--http"]), tls=False)
    for extra, tls in ((["--tokens", "t"], False), ([], True)):
        with pytest.raises(ValueError, match="and takes their tokens: add --tokens .* and --tls-cert/--tls-key"):
            _check_listen(p.parse_args([*page, *extra]), tls=tls)


def test_json_has_one_shape_numbers_as_numbers_every_field_present_and_absent_as_null():
    from muster.json_output import as_json
    from muster.v1 import muster_pb2 as pb

    assert as_json(pb.JobsResponse()) == {"jobs": []}  # (was {})
    record = as_json(pb.JobsResponse(jobs=[pb.JobRecord(name="j", run=3, started_unix_ms=1_700_000_000_000)]))
    (job,) = record["jobs"]
    assert job["run"] == 3 and job["started_unix_ms"] == 1_700_000_000_000
    assert (job["ended_unix_ms"], job["leader"], job["reason"], job["world_size"]) == (None, None, None, 0)
    status = as_json(pb.JobStatus(name="j", term=2, ranks=[pb.RankStatus(rank=1, step=10**12)]))
    assert status["term"] == 2 and status["ranks"][0]["step"] == 10**12 and status["spares"] == []
    assert (status["health"], status["summary"], status["next_page_token"], status["leader"]) == (None,) * 4
    rank = status["ranks"][0]
    assert (rank["pid"], rank["host"], rank["compute_us"], rank["phase"], rank["local_rank"]) == (None,) * 4 + (0,)


@pytest.mark.timeout(60)
def test_shell_completion_knows_every_verb(tmp_path):
    script = subprocess.run([sys.executable, "-m", "muster.cli", "completion", "bash"], capture_output=True, text=True,
                            timeout=30, check=True).stdout
    (tmp_path / "muster.bash").write_text(script)
    probe = (f"source {tmp_path / 'muster.bash'}; COMP_WORDS=(muster st); COMP_CWORD=1; COMP_LINE='muster st'; "
             "COMP_POINT=9; _shtab_muster; echo ${COMPREPLY[@]}")
    said = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, timeout=30)
    assert said.stdout.split() == ["status", "stop"], said
    zsh = subprocess.run([sys.executable, "-m", "muster.cli", "completion", "zsh"], capture_output=True, text=True,
                         timeout=30, check=True).stdout
    assert zsh.startswith("#compdef muster") and "--heartbeat-timeout" in zsh


def test_a_mistyped_verb_or_flag_is_refused_with_the_nearest_one(capsys):
    for argv, meant in ((["stauts"], "status"), (["status", "--nodse", "n"], "--node"),
                        (["run", "--nodse", "2", "--", "t.py"], "--nodes")):
        with pytest.raises(SystemExit) as exit:
            parser().parse_args(argv)
        assert exit.value.code == 2 and f"did you mean {meant}?" in capsys.readouterr().err


def test_the_logging_flags_come_before_or_after_the_verb_and_v_is_the_version(monkeypatch, capsys):
    assert parsed(["status", "--log-level", "debug", "--log-json"], monkeypatch).log_level == "debug"
    assert parsed(["--log-level", "warning", "status"], monkeypatch).log_level == "warning"
    assert parsed(["status"], monkeypatch).log_level == "info"
    with pytest.raises(SystemExit):
        parser().parse_args(["-V"])
    assert capsys.readouterr().out.startswith("muster ")


@pytest.mark.timeout(60)
def test_nobody_answering_names_the_address_and_where_it_came_from():
    import os
    import subprocess
    import sys

    from muster.net import free_port

    # In a process of its own: main() configures logging onto the stderr it finds, which in-process
    # would be this test's capture, closed under every later test of the worker.
    env = {**os.environ, "MUSTER_COORDINATOR": f"127.0.0.1:{free_port()}"}  # nothing listens there
    out = subprocess.run([sys.executable, "-m", "muster.cli", "jobs"], env=env, capture_output=True, text=True,
                         timeout=50)
    assert out.returncode == 1
    assert "from $MUSTER_COORDINATOR: is `muster serve` running there?" in out.stderr
