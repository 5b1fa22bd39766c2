"""The coordinator against an etcd that requires TLS with client certificates and has auth on:
certificates made on the fly, the etcd user and its role created with etcdctl, a real job
formed through it. A wrong password, or a user without one, is refused at start. And the embedded
etcd: reachable by its owner only, refused with users it never made, restarted when it dies."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import etcd3
import grpc
import pytest

pytest.importorskip("cryptography")
from test_security import _cert, _write  # noqa: E402  (the same on-the-fly PKI)

from muster.coordinator.etcd.client import EtcdAccess, auth_strangers, call, connect, enable_auth  # noqa: E402
from muster.coordinator.etcd.server import EtcdServer, EtcdStartError, find_etcd_binary  # noqa: E402
from muster.local import CoordinatorProcess, SimulatedNode, process_alive, wait_until  # noqa: E402
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


# ---- the embedded etcd (`muster serve` without --etcd), security review 5, M1 -------------------------------

INTRUDER = Path(__file__).parent / "scripts" / "etcd_intruder.py"


def _tcp_listeners(pid: int) -> list[str]:
    """The TCP ports `pid` listens on (its socket inodes matched against /proc/net/tcp*)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd)
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                ports.append(fields[1])
    return ports


def _python_for(uid: int) -> str:
    """An interpreter `uid` may run (the intruder needs only the standard library): this one may be
    under root's 0700 home."""
    for candidate in dict.fromkeys([sys.executable, shutil.which("python3"), "/usr/bin/python3"]):
        try:
            if candidate and subprocess.run([candidate, "-c", ""], user=uid, cwd="/", timeout=30).returncode == 0:
                return candidate
        except OSError:
            continue
    pytest.skip(f"no python that uid {uid} may run")


@pytest.fixture
def open_base():
    """A base directory every user may pass through (pytest's own tmp is 0700, which would hide the
    data directory's permissions from the test), removed after."""
    base = Path(tempfile.mkdtemp(prefix="muster-m1-"))
    os.chmod(base, 0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def _serve(base: Path, name: str) -> CoordinatorProcess:
    return CoordinatorProcess([], base / f"{name}.log", ["--data-dir", str(base / "data")])


def _etcd_gone(serve: CoordinatorProcess) -> None:
    """serve stopped its etcd (every one it started, restarts included); one left is killed by its PID."""
    pids = [r["pid"] for r in serve.records() if r.get("event") in ("embedded_etcd_started", "embedded_etcd_restarted")]
    try:
        wait_until(lambda: not any(process_alive(p) for p in pids), 10, "serve's etcd to stop")
    finally:
        for pid in pids:
            if process_alive(pid):
                os.kill(pid, signal.SIGKILL)


def _owner_view(data: Path) -> list[str]:
    password = (data / "etcd-root-password").read_text().strip()
    client = connect([EtcdServer(data / "etcd", private=True).endpoint],
                     access=EtcdAccess(user="root", password=password, local=True))
    try:
        return auth_strangers(client)
    finally:
        client.close()


@pytest.mark.timeout(90)
def test_the_embedded_etcd_listens_on_no_port_only_on_sockets_in_its_0700_dir(open_base):
    """M1a: its peer listener was http://127.0.0.1:<port>; one POST of a raft heartbeat there crashed it.
    Now neither listener is a TCP port: both are unix sockets in a directory only its owner may enter."""
    serve = _serve(open_base, "serve").start()
    try:
        etcd = serve.find("embedded_etcd_started")[0]
        assert etcd["endpoint"] == f"unix:{open_base / 'data' / 'etcd' / 'client:0'}"
        assert _tcp_listeners(etcd["pid"]) == []
        cmdline = Path(f"/proc/{etcd['pid']}/cmdline").read_bytes().split(b"\0")
        assert not [a for a in cmdline if b"http" in a or b"127.0.0.1" in a], cmdline
        etcd_dir = open_base / "data" / "etcd"
        assert etcd_dir.stat().st_mode & 0o777 == 0o700
        assert {"client:0", "peer:0"} <= set(os.listdir(etcd_dir))
        assert _owner_view(open_base / "data") == []
        serve.signal(signal.SIGTERM)
        assert serve.proc.wait(15) == 0
    finally:
        serve.stop()
        _etcd_gone(serve)


@pytest.mark.timeout(90)
@pytest.mark.skipif(os.geteuid() != 0, reason="acting as another local user takes root")
def test_another_local_user_racing_serves_first_start_reaches_neither_listener(open_base):
    """M1b: a local user found the etcd port in /proc/*/cmdline 0.35 s after start and added a root-role
    user before `muster serve` turned auth on. The same race, as `nobody`, from before serve starts: it
    finds the etcd, but there is no URL to try, and both sockets refuse it (EACCES)."""
    stop = open_base / "stop"
    intruder = subprocess.Popen([_python_for(65534), "-I", str(INTRUDER), str(open_base / "data"), str(stop), "60"],
                                user=65534, group=65534, cwd="/", stdout=subprocess.PIPE, text=True)
    serve = _serve(open_base, "serve")
    try:
        serve.start()
        time.sleep(0.5)  # a few more rounds against the serving etcd
        stop.touch()
        seen = json.loads(intruder.communicate(timeout=15)[0])
        assert seen["uid"] == 65534 and seen["etcd_seen_after_s"] is not None, seen
        assert [u for u in seen["urls"] if "://" in u and not u.startswith("unix://")] == [], seen
        assert "etcd" in seen["data_dir_listed"], seen  # the data directory is open to it; the etcd one is not
        assert len(seen["outcomes"]) == 4, seen  # user add and raft, on each socket
        # FileNotFoundError until serve made the etcd directory, EACCES from then on; never an answer
        assert all("PermissionError" in outcome and set(outcome) <= {"PermissionError", "FileNotFoundError"}
                   for outcome in seen["outcomes"].values()), seen["outcomes"]
        print(json.dumps(seen))
        assert _owner_view(open_base / "data") == []
    finally:
        if intruder.poll() is None:
            intruder.kill()
            intruder.wait(5)
        serve.stop()
        _etcd_gone(serve)


@pytest.mark.timeout(90)
def test_serve_refuses_an_embedded_etcd_with_users_or_roles_it_never_made(open_base):
    """An etcd that someone reached before its auth was on (data from a release with a loopback port):
    `muster serve` refuses to serve it, naming what it found, and stops it."""
    data = open_base / "data"
    etcd = EtcdServer(data / "etcd", private=True).start()
    try:
        ctl = [str(Path(find_etcd_binary()).with_name("etcdctl")), "--endpoints", f"unix://{etcd.client_socket}"]
        for args in (["user", "add", "intruder:intruder-pw"], ["user", "grant-role", "intruder", "root"]):
            subprocess.run([*ctl, *args], check=True, capture_output=True, timeout=30)
    finally:
        etcd.stop()
    out = subprocess.run([sys.executable, "-m", "muster.cli", "--log-json", "serve", "--listen", "127.0.0.1:0",
                          "--data-dir", str(data)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, out.stderr[-2000:]
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith("muster serve: the embedded etcd in ") and "has user intruder" in line, line
    assert "before its auth was on" in line, line
    pids = [json.loads(r)["pid"] for r in out.stderr.splitlines() if '"embedded_etcd_started"' in r]
    assert pids and not any(process_alive(p) for p in pids)


@pytest.mark.timeout(120)
def test_serve_restarts_its_dead_etcd_and_the_job_goes_on_then_gives_up_saying_why(open_base):
    """SIGKILL of the embedded etcd (the review's crash, or the OOM killer): serve starts it again with
    its data, the job's node stays placed and a new node joins it. Killed a fourth time within a minute,
    serve exits 1 with one line saying so, and leaves no etcd behind."""
    serve = _serve(open_base, "serve").start()
    try:
        import asyncio

        first = serve.find("embedded_etcd_started")[0]["pid"]
        killed = time.monotonic()
        os.kill(first, signal.SIGKILL)
        restarted = wait_until(lambda: serve.find("embedded_etcd_restarted"), 20, "etcd restarted")[0]
        back_s = time.monotonic() - killed

        async def job():
            spec = pb.JobSpec(min_nodes=1, max_nodes=2)
            nodes = [SimulatedNode([serve.address], "etcd-restart", f"n{i}", slots=1, spec=spec) for i in range(2)]
            await nodes[0].join()
            nodes[0].start()
            await nodes[0].wait_for(lambda x: x.assignment().role == pb.ROLE_ACTIVE, 15, "a place")
            os.kill(restarted["pid"], signal.SIGKILL)  # while the job runs
            wait_until(lambda: len(serve.find("embedded_etcd_restarted")) == 2, 20, "etcd restarted again")
            await nodes[1].join()
            nodes[1].start()
            asg = await nodes[1].wait_for(lambda x: x.assignment().world_size == 2, 30, "both nodes formed")
            for node in nodes:
                await node.stop()
            return asg
        assert asyncio.run(job()).world_size == 2  # the job's state written and read through the new etcd
        for restarts in (2, 3):  # the third and fourth deaths within the minute: the fourth ends serve
            last = wait_until(lambda: serve.find("embedded_etcd_restarted")[restarts - 1:], 20, f"restart {restarts}")
            os.kill(last[-1]["pid"], signal.SIGKILL)
        assert serve.proc.wait(20) == 1
        tail = serve.log_path.read_text().strip().splitlines()[-1]
        assert tail.startswith("muster serve: the embedded etcd died 4 times within 60s (last exit code -9)"), tail
        print(json.dumps({"etcd_back_after_kill_s": round(back_s, 2)}))
    finally:
        serve.stop()
        _etcd_gone(serve)


@pytest.mark.timeout(60)
def test_a_client_renews_the_auth_token_etcd_forgot(tmp_path):
    """etcd keeps simple auth tokens in memory (a restart after a raft snapshot, or auth turned off and
    on, forgets them): the next call logs in again instead of failing every call after."""
    etcd = EtcdServer(tmp_path / "etcd", private=True).start()
    try:
        assert enable_auth(etcd.endpoint, "pw")
        access = EtcdAccess(user="root", password="pw", local=True)
        client, admin = connect([etcd.endpoint], access=access), connect([etcd.endpoint], access=access)
        call(client, lambda: client.put("/k", "1"), "put")
        admin.authstub.AuthDisable(etcd3.etcdrpc.AuthDisableRequest(), 5, credentials=admin.call_credentials,
                                   metadata=admin.metadata)
        assert enable_auth(etcd.endpoint, "pw")  # every token issued before is gone
        with pytest.raises(grpc.RpcError, match="invalid auth token"):
            client.get("/k")
        assert call(client, lambda: client.get("/k"), "get")[0] == b"1"
        client.close()
        admin.close()
    finally:
        etcd.stop()


def test_a_data_dir_too_long_for_a_socket_path_is_refused_before_etcd_starts(tmp_path):
    etcd = EtcdServer(tmp_path / ("d" * 120), private=True)
    with pytest.raises(EtcdStartError, match="too long a path for the embedded etcd's sockets"):
        etcd.start()
    assert etcd.pid is None
