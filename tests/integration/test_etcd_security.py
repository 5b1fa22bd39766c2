"""The coordinator against an etcd that requires TLS with client certificates and has auth on:
certificates made on the fly, the etcd user and its role created with etcdctl, a real job
formed through it. A wrong password, or a user without one, is refused at start."""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("cryptography")
from test_security import _cert, _write  # noqa: E402  (the same on-the-fly PKI)

from muster.coordinator.etcd.server import EtcdServer, find_etcd_binary  # noqa: E402
from muster.local import CoordinatorProcess, SimulatedNode  # noqa: E402
from muster.security import TlsFiles  # noqa: E402
from muster.v1 import muster_pb2 as pb  # noqa: E402


@pytest.fixture
def secured_etcd(tmp_path):
    ca_key, ca = _cert("etcd-test-ca", None, None, ca=True)
    ca_pem, _ = _write(tmp_path / "etcd-ca", ca_key, ca)
    server = _write(tmp_path / "etcd-server", *_cert("etcd", ca_key, ca.subject, ip="127.0.0.1"))
    client = _write(tmp_path / "coordinator", *_cert("coordinator", ca_key, ca.subject))
    etcd = EtcdServer(tmp_path / "etcd", tls=TlsFiles(ca_pem, *server)).start()
    etcdctl = Path(find_etcd_binary()).with_name("etcdctl")

    def ctl(*args: str, user: str = "") -> None:
        auth = ["--user", user] if user else []
        subprocess.run([str(etcdctl), "--endpoints", etcd.client_url, "--cacert", ca_pem, "--cert", client[0],
                        "--key", client[1], *auth, *args], check=True, capture_output=True, timeout=30)

    ctl("user", "add", "root:root-password")
    ctl("user", "grant-role", "root", "root")
    ctl("role", "add", "muster")
    ctl("role", "grant-permission", "muster", "--prefix=true", "readwrite", "/muster/")
    ctl("user", "add", "muster:muster-password")
    ctl("user", "grant-role", "muster", "muster")
    ctl("auth", "enable")
    password = tmp_path / "etcd-password"
    password.write_text("muster-password\n")
    try:
        yield etcd, ["--etcd-cacert", ca_pem, "--etcd-cert", client[0], "--etcd-key", client[1],
                     "--etcd-user", "muster"], password
    finally:
        etcd.stop()


@pytest.mark.timeout(90)
def test_a_coordinator_leads_a_job_through_an_etcd_with_tls_and_auth(secured_etcd, tmp_path):
    etcd, flags, password = secured_etcd
    coordinator = CoordinatorProcess([etcd.endpoint], tmp_path / "coordinator.log",
                                     [*flags, "--etcd-password-file", str(password)]).start()
    try:
        import asyncio

        async def join():
            node = SimulatedNode([coordinator.address], "secure", "n", slots=1, spec=pb.JobSpec(min_nodes=1))
            await node.join()
            node.start()
            asg = await node.wait_for(lambda x: x.assignment().role == pb.ROLE_ACTIVE, 15, "a place")
            await node.stop()
            return asg
        assert asyncio.run(join()).world_size == 1  # election, fenced writes and watches all went through
        record = coordinator.find("etcd_client_created")[0]
        assert record["tls"] is True and record["user"] == "muster"
    finally:
        coordinator.stop()


@pytest.mark.timeout(60)
def test_a_wrong_or_missing_password_is_refused_at_start(secured_etcd, tmp_path):
    etcd, flags, _ = secured_etcd
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-password")

    def serve(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "muster.cli", "serve", "--listen", "127.0.0.1:0",
                               "--etcd", etcd.endpoint, *extra], capture_output=True, text=True, timeout=45)

    out = serve(*flags, "--etcd-password-file", str(wrong))
    assert out.returncode != 0 and "authentication failed" in out.stderr.lower(), out.stderr[-500:]
    out = serve("--etcd-user", "muster")
    assert out.returncode == 2 and "needs a password" in out.stderr
