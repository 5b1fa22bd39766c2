"""TLS on the coordinator's port (and mTLS), per-job tokens: certificates are made on the fly
(`cryptography`), a real coordinator serves them, real clients (CLI, SimulatedNode) call it."""

import asyncio
import datetime
import ipaddress
import subprocess
import sys

import grpc
import pytest

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

from muster.client import relay_of  # noqa: E402
from muster.local import SimulatedNode  # noqa: E402
from muster.security import ClientSecurity, TlsFiles  # noqa: E402
from muster.v1 import muster_pb2 as pb  # noqa: E402
from muster.v1 import muster_pb2_grpc as pb_grpc  # noqa: E402

TOKEN_A, TOKEN_B, OPERATOR = "a" * 24, "b" * 24, "o" * 24


def _cert(name: str, issuer_key, issuer_name, *, ca: bool = False, ip: str | None = None):
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer_name or subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ip:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip))]),
                                        critical=False)
    cert = builder.sign(issuer_key or key, hashes.SHA256())
    return key, cert


def _write(path, key, cert):
    path.with_suffix(".key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                           serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption()))
    path.with_suffix(".pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(path.with_suffix(".pem")), str(path.with_suffix(".key"))


@pytest.fixture
def pki(tmp_path):
    ca_key, ca = _cert("muster-test-ca", None, None, ca=True)
    ca_pem, _ = _write(tmp_path / "ca", ca_key, ca)
    server = _write(tmp_path / "server", *_cert("coordinator", ca_key, ca.subject, ip="127.0.0.1"))
    client = _write(tmp_path / "client", *_cert("agent", ca_key, ca.subject))
    replica = _write(tmp_path / "replica", *_cert("replica", ca_key, ca.subject))
    tokens = tmp_path / "tokens"
    tokens.write_text(f"# job token\njob-a {TOKEN_A}\njob-b {TOKEN_B}\n* {OPERATOR}\n")
    tokens.chmod(0o600)
    return {"ca": ca_pem, "server": server, "client": client, "replica": replica, "tokens": str(tokens)}


def join(stub, job: str, node: str, token: str = ""):
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    return stub.Join(pb.JoinRequest(job=job, node_id=node, slots=1, host="127.0.0.1", store_port=1,
                                    spec=pb.JobSpec(min_nodes=1, max_nodes=2)), timeout=10, metadata=metadata)


def code_of(fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value.code()


@pytest.mark.timeout(90)
def test_mtls_and_job_tokens(coordinators, pki):
    cert, key = pki["server"]
    (leader,) = coordinators(1, extra=["--tls-cert", cert, "--tls-key", key, "--tls-client-ca", pki["ca"],
                                       "--tokens", pki["tokens"]])
    assert leader.find("coordinator_serving")[0]["tls"] == "mtls"
    client_cert, client_key = pki["client"]
    good = ClientSecurity(TOKEN_A, TlsFiles(pki["ca"], client_cert, client_key))

    # plaintext and TLS without a client certificate do not get through the handshake
    with grpc.insecure_channel(leader.address) as ch:
        assert code_of(lambda: join(pb_grpc.CoordinatorStub(ch), "job-a", "n", TOKEN_A)) == grpc.StatusCode.UNAVAILABLE
    with ClientSecurity(TOKEN_A, TlsFiles(pki["ca"])).channel(leader.address) as ch:
        assert code_of(lambda: join(pb_grpc.CoordinatorStub(ch), "job-a", "n", TOKEN_A)) == grpc.StatusCode.UNAVAILABLE

    with good.channel(leader.address) as ch:
        stub = pb_grpc.CoordinatorStub(ch)
        assert code_of(lambda: join(stub, "job-a", "n")) == grpc.StatusCode.UNAUTHENTICATED
        assert code_of(lambda: join(stub, "job-a", "n", "x" * 24)) == grpc.StatusCode.UNAUTHENTICATED
        assert code_of(lambda: join(stub, "job-b", "n", TOKEN_A)) == grpc.StatusCode.PERMISSION_DENIED
        assert join(stub, "job-a", "n", TOKEN_A).member_id
        md = (("authorization", f"Bearer {TOKEN_A}"),)
        assert code_of(lambda: stub.Status(pb.StatusRequest(), timeout=5, metadata=md)) == \
            grpc.StatusCode.PERMISSION_DENIED  # listing every job needs an operator token
        assert stub.Status(pb.StatusRequest(job="job-a"), timeout=5, metadata=md).jobs[0].name == "job-a"
        assert code_of(lambda: stub.Events(pb.EventsRequest(job="job-b"), timeout=5, metadata=md)) == \
            grpc.StatusCode.PERMISSION_DENIED
        frames = iter([pb.NodeFrame(job="job-b", node_id="n", member_id=1)])
        assert code_of(lambda: list(stub.Session(frames, timeout=5, metadata=md))) == grpc.StatusCode.PERMISSION_DENIED

    async def a_node_with_credentials_gets_its_place():
        node = SimulatedNode([leader.address], "job-a", "m", slots=1, security=good,
                             spec=pb.JobSpec(min_nodes=1, max_nodes=2))
        await node.join()
        node.start()
        asg = await node.wait_for(lambda x: x.assignment().role == pb.ROLE_ACTIVE, 10, "a place over mTLS")
        await node.stop()
        return asg
    assert asyncio.run(a_node_with_credentials_gets_its_place()).world_size >= 1

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "muster.cli", "status", "--coordinator", leader.address,
                               "--tls-ca", pki["ca"], "--tls-cert", client_cert, "--tls-key", client_key, *args],
                              capture_output=True, text=True, timeout=30)
    shown = cli("--job", "job-a", "--token", OPERATOR)
    assert shown.returncode == 0 and "job job-a" in shown.stdout
    refused = cli("--job", "job-a", "--token", TOKEN_B)
    assert refused.returncode != 0 and "PERMISSION_DENIED" in refused.stderr


@pytest.mark.timeout(60)
def test_tls_without_client_certificates_and_a_bad_tokens_file(coordinators, pki, tmp_path):
    cert, key = pki["server"]
    (leader,) = coordinators(1, extra=["--tls-cert", cert, "--tls-key", key])
    assert leader.find("coordinator_serving")[0]["tls"] == "tls"
    with ClientSecurity(tls=TlsFiles(pki["ca"])).channel(leader.address) as ch:  # no token needed: none configured
        assert join(pb_grpc.CoordinatorStub(ch), "open", "n").member_id
    bad = tmp_path / "bad-tokens"
    bad.write_text("job-a short\n")
    bad.chmod(0o600)
    out = subprocess.run([sys.executable, "-m", "muster.cli", "serve", "--listen", "127.0.0.1:0", "--etcd",
                          "127.0.0.1:1", "--tokens", str(bad)], capture_output=True, text=True, timeout=30)
    assert out.returncode != 0 and "16+ characters" in out.stderr


@pytest.mark.timeout(120)
def test_an_agent_trains_over_mtls_with_its_job_token(coordinators, pki, agents, tmp_path):
    from muster.local import TrainingProcess

    cert, key = pki["server"]
    (leader,) = coordinators(1, extra=["--tls-cert", cert, "--tls-key", key, "--tls-client-ca", pki["ca"],
                                       "--tokens", pki["tokens"]])
    client_cert, client_key = pki["client"]
    flags = ["--tls-ca", pki["ca"], "--tls-cert", client_cert, "--tls-key", client_key]
    (agent,) = agents([leader.address], "job-a", ["a"], steps=20, nodes="2:2", extra=[*flags, "--token", TOKEN_A])
    # the library without an agent reads the same credentials from the environment
    env = {"MUSTER_TOKEN": TOKEN_A, "MUSTER_TLS_CA": pki["ca"], "MUSTER_TLS_CERT": client_cert,
           "MUSTER_TLS_KEY": client_key}
    rank = TrainingProcess([leader.address], "job-a", tmp_path / "process-rank.log", steps=20, min_nodes=2,
                           max_nodes=2, env=env).start()
    try:
        assert agent.wait(90) == 0, agent.log_path.read_text()[-2000:]
        assert rank.wait(30) == 0, rank.log_path.read_text()[-2000:]
        assert agent.steps(0)[-1]["step"] == 20 and rank.steps()[-1]["world_size"] == 3
    finally:
        rank.stop()
    (wrong,) = agents([leader.address], "job-b", ["b"], steps=5, extra=[*flags, "--token", TOKEN_A])
    assert wrong.wait(60) != 0
    assert "PERMISSION_DENIED" in wrong.log_path.read_text()


@pytest.mark.timeout(90)
def test_a_relay_calls_the_leader_with_the_replicas_certificate_and_an_operators_token(coordinators, pki):
    cert, key = pki["server"]
    client_cert, client_key = pki["client"]
    replica_cert, replica_key = pki["replica"]
    replicas = coordinators(2, extra=["--tls-cert", cert, "--tls-key", key, "--tls-client-ca", pki["ca"],
                                      "--tokens", pki["tokens"], "--relay-min-nodes", "2", "--peer-tls-ca", pki["ca"],
                                      "--peer-tls-cert", replica_cert, "--peer-tls-key", replica_key])
    addresses = [r.address for r in replicas]
    good = ClientSecurity(TOKEN_A, TlsFiles(pki["ca"], client_cert, client_key))

    async def nodes_stream_through_the_relay():
        names = [f"n{i}" for i in range(64)]
        names = [n for n in names if relay_of(n, addresses) == addresses[0]][:2] + \
            [n for n in names if relay_of(n, addresses) == addresses[1]][:2]  # each replica relays two
        nodes = [SimulatedNode(addresses, "job-a", name, slots=1, security=good,
                               spec=pb.JobSpec(min_nodes=4, max_nodes=4)) for name in names]
        for node in nodes:
            await node.join()
            node.start()
        for node in nodes:
            await node.wait_for(lambda x: x.assignment().role == pb.ROLE_ACTIVE, 10, "a place through a relay")
        relayed = [n for n in nodes if n.session.relay and n.session.relay != n.leader]
        for node in nodes:
            await node.stop()
        return relayed

    relayed = asyncio.run(nodes_stream_through_the_relay())
    leader = next(r for r in replicas if r.find("leadership_acquired", job="job-a"))
    standby = next(r for r in replicas if r is not leader)
    assert relayed and leader.find("relay_attached", job="job-a", relay=standby.address)

    # an agent's certificate is no replica's, even with the operator's token (security review 3, F2)
    with ClientSecurity(OPERATOR, TlsFiles(pki["ca"], client_cert, client_key)).channel(leader.address) as ch:
        up = iter([pb.RelayUp(job="job-a", relay="agent")])
        assert code_of(lambda: list(pb_grpc.CoordinatorStub(ch).Relay(up, timeout=5, metadata=(
            ("authorization", f"Bearer {OPERATOR}"),)))) == grpc.StatusCode.PERMISSION_DENIED
    assert "--peer-tls-cert" in leader.find("relay_refused", code="PERMISSION_DENIED")[0]["error"]
