"""Every TLS end (serving, replica to replica, etcd, a caller's) is one `TlsFiles`, checked at
startup: a certificate without its key, or a file that is not there, is refused naming the flags
(or variables) that gave them, before any connection is tried."""

import pytest

from muster.cli import parser
from muster.cli.flags import security as _security
from muster.cli.serve import command as _serve
from muster.security import ClientSecurity, TlsFiles


@pytest.mark.parametrize("flags", [("--tls-cert", "--tls-key"), ("--peer-tls-cert", "--peer-tls-key"),
                                   ("--etcd-cert", "--etcd-key")])
def test_serve_refuses_a_certificate_without_its_key_and_a_key_without_its_certificate(flags, tmp_path, capsys):
    pem = tmp_path / "x.pem"
    pem.write_text("")
    for given in flags:
        assert _serve(parser().parse_args(["serve", given, str(pem)])) == 2
        assert f"{flags[0]} and {flags[1]} go together" in capsys.readouterr().err


def test_a_file_that_is_not_there_is_named_with_its_flag(tmp_path, capsys):
    absent = tmp_path / "absent.pem"
    assert _serve(parser().parse_args(["serve", "--tls-client-ca", str(absent)])) == 2
    assert f"--tls-client-ca {absent}: no such file" in capsys.readouterr().err
    with pytest.raises(ValueError, match=f"--tls-ca {absent}: no such file"):
        _security(parser().parse_args(["status", "--coordinator", "c:1", "--tls-ca", str(absent)]))


def test_the_environment_s_files_are_checked_naming_the_variables(tmp_path):
    with pytest.raises(ValueError, match=r"\$MUSTER_TLS_CERT and \$MUSTER_TLS_KEY go together"):
        ClientSecurity.from_env({"MUSTER_TLS_KEY": str(tmp_path / "k.pem")})
    ca = tmp_path / "ca.pem"
    ca.write_text("")
    assert ClientSecurity.from_env({"MUSTER_TOKEN": "t", "MUSTER_TLS_CA": str(ca)}).tls == TlsFiles(str(ca))


def test_no_files_is_plaintext():
    assert TlsFiles().check(("--tls-ca", "--tls-cert", "--tls-key")) == TlsFiles()
    assert TlsFiles().channel_credentials() is None


def test_a_client_ca_without_a_serving_certificate_is_refused(tmp_path, capsys):
    ca = tmp_path / "ca.pem"
    ca.write_text("")
    assert _serve(parser().parse_args(["serve", "--tls-client-ca", str(ca)])) == 2
    assert "--tls-client-ca needs --tls-cert and --tls-key" in capsys.readouterr().err
