"""Where a caller's secrets travel: off the command line (--token-file), out of reprs (a traceback
printed with its locals shows every dataclass in it)."""

import pytest

from muster.cli import parser
from muster.cli.flags import security as _security
from muster.coordinator.etcd.client import EtcdAccess
from muster.security import ClientSecurity, TlsFiles

TOKEN = "s3cr3t-" * 4


def test_the_token_and_the_etcd_password_are_absent_from_reprs():
    assert TOKEN not in repr(ClientSecurity(TOKEN, TlsFiles("ca.pem")))
    assert "ca.pem" in repr(ClientSecurity(TOKEN, TlsFiles("ca.pem")))
    assert TOKEN not in repr(EtcdAccess(user="muster", password=TOKEN))


@pytest.mark.parametrize("verb", [["run", "--coordinator", "c:1", "--job", "j", "--", "python", "t.py"],
                                  ["status", "--coordinator", "c:1"], ["stop", "--coordinator", "c:1", "j"]])
def test_the_token_is_read_from_token_file_by_the_agent_and_every_client_verb(verb, tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    assert _security(parser().parse_args([*verb[:1], "--token-file", str(path), *verb[1:]])).token == TOKEN


def test_a_missing_or_empty_token_file_is_refused_with_its_name(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    for path, why in ((tmp_path / "absent", "No such file or directory"), (empty, "the file is empty")):
        with pytest.raises(ValueError) as err:
            _security(parser().parse_args(["status", "--coordinator", "c:1", "--token-file", str(path)]))
        assert str(err.value) == f"--token-file {path}: {why}"


def test_token_and_token_file_together_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parser().parse_args(["status", "--coordinator", "c:1", "--token", TOKEN, "--token-file", str(tmp_path)])
    assert "not allowed with argument --token" in capsys.readouterr().err
