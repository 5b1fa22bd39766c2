"""The live page of `muster serve --http`, over real HTTP against two replicas and etcd: static
files with no data and no inline script, its JSON API behind the API's own tokens and in the
--json schema, through the leader and a standby alike, following a killed rank and a stop. The
port's guard (review 5, M3/L1/L3): HTTPS with the replica's certificate, Host names, a token on
/metrics, idle connections timed out and capped."""

import asyncio
import json
import re
import socket
import ssl
import time
import urllib.error
import urllib.request
from pathlib import Path

import jsonschema
import pytest

from muster.client import Coordinators
from muster.local import SimulatedNode
from muster.security import ClientSecurity
from muster.v1 import muster_pb2 as pb

SCHEMA = json.loads((Path(__file__).resolve().parents[2] / "docs" / "reference" / "json-schema.json").read_text())
JOB, JOB_TOKEN, OPERATOR = "web", "j" * 24, "o" * 24


def get(base: str, path: str, token: str = "", *, host: str = "", tls: ssl.SSLContext | None = None
        ) -> tuple[int, dict, bytes]:
    headers = {**({"Authorization": f"Bearer {token}"} if token else {}), **({"Host": host} if host else {})}
    request = urllib.request.Request(base + path, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10, context=tls) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def api(base: str, path: str, token: str, status: int = 200) -> dict:
    code, headers, body = get(base, path, token)
    assert code == status and headers["Content-Type"] == "application/json", (code, body[:500])
    return json.loads(body)


def valid(doc, kind: str):
    jsonschema.validate(doc, {"$ref": f"#/$defs/{kind}", "$defs": SCHEMA["$defs"]})
    return doc


async def until(predicate, timeout_s: float, what: str):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not (value := await asyncio.to_thread(predicate)):
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)
    return value


@pytest.mark.timeout(90)
def test_the_live_page_through_any_replica_behind_the_apis_tokens(coordinators, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{JOB} {JOB_TOKEN}\n* {OPERATOR}\n")
    tokens.chmod(0o600)  # a tokens file others may read is refused
    # (its simulated nodes stream from this process, which also validates pages against the schema: a
    # loaded run starved them past the 1 s heartbeat timeout, and a node_silent made the new generation)
    replicas = coordinators(2, extra=["--metrics-listen", "127.0.0.1:0", "--http", "--tokens", str(tokens),
                                      "--heartbeat-timeout", "5.0"])
    pages = {r.address: r.find("coordinator_serving")[0]["page"].rstrip("/") for r in replicas}
    base = next(iter(pages.values()))

    # the files: no data in them, scripts only from the page's own files, nothing sniffed as HTML
    for path in ("/", f"/jobs/{JOB}"):
        code, headers, html = get(base, path)
        assert code == 200 and headers["Content-Type"].startswith("text/html")
        assert "script-src 'self'" in headers["Content-Security-Policy"] and headers["X-Content-Type-Options"] == "nosniff"
        assert re.findall(rb"<script[^>]*>", html) == [b'<script src="/web/app.js">']
    code, headers, script = get(base, "/web/app.js")
    assert code == 200 and headers["Content-Type"].startswith("text/javascript")
    assert not re.search(rb"innerHTML|outerHTML|insertAdjacentHTML|document\.write|eval\(", script)
    assert get(base, "/web/style.css")[0] == 200 and get(base, "/nothing")[0] == 404

    # the API asks the API's tokens: the jobs list an operator's, a job's page that job's
    assert "no token" in api(base, "/api/jobs", "", 401)["error"]
    assert "not for every job" in api(base, "/api/jobs", JOB_TOKEN, 403)["error"]
    assert valid(api(base, "/api/jobs", OPERATOR), "page_jobs") == {"replica": next(iter(pages)), "jobs": []}
    assert api(base, "/api/jobs/Bad%20Name", OPERATOR, 400)["error"]
    assert api(base, f"/api/jobs/{JOB}?run=x", JOB_TOKEN, 400)["error"] == "run must be a run's number, not 'x'"
    assert "run must be" in api(base, f"/api/jobs/{JOB}?run={2**70}", JOB_TOKEN, 400)["error"]
    assert "unknown" in api(base, f"/api/jobs/{JOB}", JOB_TOKEN, 404)["error"]  # no such job yet

    async def scenario():
        security = ClientSecurity(JOB_TOKEN)
        nodes = [SimulatedNode([r.address for r in replicas], JOB, f"n{i}", slots=2, security=security,
                               spec=pb.JobSpec(min_nodes=1, max_nodes=2)) for i in range(2)]
        for n in nodes:
            await n.join()
            n.start()
        for n in nodes:
            await n.wait_for(lambda x: x.assignment().role == pb.ROLE_ACTIVE and x.step > 2, 15, "training")
        leader = nodes[0].leader
        standby = next(a for a in pages if a != leader)

        def page(at: str) -> dict:
            return valid(api(pages[at], f"/api/jobs/{JOB}", JOB_TOKEN), "page_job")

        for at in (leader, standby):  # a standby asks the leader for the live view
            (js,) = (await asyncio.to_thread(page, at))["status"]["jobs"]
            assert js["live"] and js["world_size"] == 4 and {r["host"] for r in js["ranks"]} == {"127.0.0.1"}
        generation = js["generation"]

        # a rank killed: its new generation is on the page (well under a second here; 5 s for a loaded CI)
        nodes[1].exits.append(pb.RankExit(local_rank=1, pid=10_001, exit_code=-9))
        await until(lambda: page(standby)["status"]["jobs"][0]["generation"] > generation, 5, "the new generation")
        assert "rank_exited" in [e["kind"] for e in (await asyncio.to_thread(page, leader))["events"]["events"]]

        def recovered():  # the leader measures the recovery once every node reports a step in the new generation
            found = page(leader)["status"]["jobs"][0]["health"]["recent_recoveries"]
            return found if found and found[-1]["generation"] > generation else None

        last = (await until(recovered, 10, "the recovery measured"))[-1]
        assert not last["planned"] and last["recovery_s"] > 0 and last["decided_unix_ms"] > 0
        listed = {at: (await asyncio.to_thread(lambda: valid(api(pages[at], "/api/jobs", OPERATOR), "page_jobs")))["jobs"]
                  for at in pages}
        assert [(j["name"], j["outcome"], j["leader"]) for j in listed[standby]] == [(JOB, "running", leader)]
        assert (listed[standby][0]["step"], listed[standby][0]["steps_per_second"]) == (None, None)  # the leader's
        assert listed[leader][0]["step"] > 0 and 15 < listed[leader][0]["steps_per_second"] < 25  # 50 ms a step

        # stopped: its outcome and no live phase, on every replica
        with Coordinators([leader], security=ClientSecurity(OPERATOR)) as c:
            await asyncio.to_thread(c.call, "Stop", pb.StopRequest(job=JOB, reason="the page test"))

        def ended(at: str):
            (js,) = page(at)["status"]["jobs"]
            return js if js["outcome"] == "stopped" else None

        for at in pages:
            js = await until(lambda: ended(at), 15, f"the stop on {at}")
            assert js["phase"] == "ended" and js["ended_unix_ms"] and "the page test" in js["outcome_reason"]
        for n in nodes:
            await n.stop()

    asyncio.run(scenario())


def threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("Threads:")).split()[1])


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """The server closed it (or reset it) within `seconds`."""
    sock.settimeout(seconds)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


@pytest.mark.timeout(90)
def test_the_port_serves_https_answers_its_own_names_asks_a_scrape_token_and_drops_idle_connections(
        coordinators, tmp_path):
    pytest.importorskip("cryptography")
    from test_security import _cert, _write  # the same on-the-fly PKI

    from muster.coordinator.metrics import IDLE_TIMEOUT_S, MAX_CONNECTIONS

    ca_key, ca = _cert("muster-test-ca", None, None, ca=True)
    ca_pem, _ = _write(tmp_path / "ca", ca_key, ca)
    cert, key = _write(tmp_path / "server", *_cert("coordinator", ca_key, ca.subject, ip="127.0.0.1"))
    scraper = "s" * 24
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{JOB} {JOB_TOKEN}\n* {OPERATOR}\n@metrics {scraper}\n")
    tokens.chmod(0o600)
    (replica,) = coordinators(1, extra=["--metrics-listen", "127.0.0.1:0", "--http", "--tokens", str(tokens),
                                        "--tls-cert", cert, "--tls-key", key, "--http-host", "muster.test"])
    page = replica.find("coordinator_serving")[0]["page"]
    assert page.startswith("https://127.0.0.1:")
    base, address = page.rstrip("/"), page.removeprefix("https://").rstrip("/")
    trust = ssl.create_default_context(cafile=ca_pem)

    # HTTPS, verified against the replica's certificate; the same port in the clear answers nothing
    assert get(base, "/", tls=trust)[0] == 200
    assert valid(json.loads(get(base, "/api/jobs", OPERATOR, tls=trust)[2]), "page_jobs")["jobs"] == []
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(f"http://{address}/healthz", timeout=10)

    # Host: its own names and IP addresses; another name is a page rebinding its DNS to this port
    port = address.rsplit(":", 1)[1]
    for name in (f"localhost:{port}", f"muster.test:{port}", "MUSTER.TEST", f"127.0.0.1:{port}"):
        assert get(base, "/api/jobs", OPERATOR, host=name, tls=trust)[0] == 200, name
    for path in ("/api/jobs", "/metrics", "/"):
        code, _, body = get(base, path, OPERATOR, host=f"attacker.example:{port}", tls=trust)
        assert code == 421 and b"--http-host" in body, (path, code)

    # /metrics names every job: the scraper's token or an operator's; /healthz asks none
    code, headers, body = get(base, "/metrics", tls=trust)
    assert code == 401 and headers["WWW-Authenticate"] == "Bearer" and b"no token" in body
    code, _, body = get(base, "/metrics", JOB_TOKEN, tls=trust)
    assert code == 403 and b"'@metrics'" in body
    for token in (scraper, OPERATOR):
        code, _, body = get(base, "/metrics", token, tls=trust)
        assert code == 200 and b"muster_ready 1.0" in body
    assert get(base, "/healthz", tls=trust)[0] == 200

    # idle connections (nothing sent, or half a handshake: a record header announcing 512 bytes of
    # ClientHello): a thread each up to the cap, the rest closed at once (accepted in the order they
    # connected), and all closed after the timeout
    before = threads(replica.proc.pid)
    began = time.monotonic()
    idle = []
    for i in range(MAX_CONNECTIONS + 100):
        sock = socket.create_connection(("127.0.0.1", int(port)), timeout=5)
        if i % 2:
            sock.sendall(b"\x16\x03\x01\x02\x00")
        idle.append(sock)
    held, excess = idle[:MAX_CONNECTIONS], idle[MAX_CONNECTIONS:]
    assert all(closed_within(s, 5) for s in excess)
    assert threads(replica.proc.pid) <= before + MAX_CONNECTIONS + 1
    assert time.monotonic() - began < IDLE_TIMEOUT_S - 2 and not any(closed_within(s, 0.01) for s in held)
    assert all(closed_within(s, IDLE_TIMEOUT_S + 5 - (time.monotonic() - began)) for s in held)
    assert time.monotonic() - began > IDLE_TIMEOUT_S - 1
    for s in idle:
        s.close()
    assert get(base, "/healthz", tls=trust)[0] == 200
    assert threads(replica.proc.pid) <= before + 1
    assert replica.find("http_connections_capped", limit=MAX_CONNECTIONS)


class Reforming(SimulatedNode):
    """Reports its ranks' phase and, from a few steps into each generation (as a rank's reform phases
    reach its agent once it formed and moved the state), their reform's phases: 1 MiB moved in 0.3 s."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.began: dict[int, int] = {}  # generation -> the step of its first report

    def _reports(self):
        reports = super()._reports()
        began = self.began.setdefault(self.generation, self.step)
        for r in reports:
            r.phase = "phased"
            if r.state == pb.RANK_STATE_RUNNING and self.step - began >= 3:
                # (as a survivor says it: its own state went on, from the step the generation formed at)
                r.reform.CopyFrom(pb.ReformPhases(generation=self.generation, abort_s=0.01, form_s=0.05, sync_s=0.35,
                                                  transfer_s=0.3, bytes_received=1 << 20, tier="replica", step=began))
        return reports


@pytest.mark.timeout(90)
def test_a_relayed_jobs_recovery_reaches_the_page_with_its_ranks_phases(coordinators):
    """A job whose node streams go through a relay replica shows its ranks' phases and each
    recovery's timeline on the page as a direct job does: its relay forwards a frame that brings a
    rank's reform phases (they come a few steps after the new generation), and the recovery ends
    on its relay's word for the steps it no longer forwards."""
    from test_relay import RELAY, leader_of, names_spread, stepping_job

    replicas = coordinators(2, extra=[*RELAY, "--metrics-listen", "127.0.0.1:0", "--http"])
    addresses = [r.address for r in replicas]

    async def scenario():
        nodes = await stepping_job(addresses, "relayed", names_spread(addresses, 2), slots=2, node=Reforming)
        leader = leader_of(replicas, "relayed")
        standby = next(r for r in replicas if r is not leader)
        assert all(n.session.relay == standby.address for n in nodes)  # every node relayed
        base = leader.find("coordinator_serving")[0]["page"].rstrip("/")

        def job() -> dict:
            return valid(api(base, "/api/jobs/relayed", ""), "page_job")["status"]["jobs"][0]

        def recovered(generation: int):
            found = job()["health"]["recent_recoveries"]
            return found if found and found[-1]["generation"] > generation else None

        generation = max(n.generation for n in nodes)
        await until(lambda: recovered(generation - 1), 10, "the first map's recovery")
        nodes[0].exits.append(pb.RankExit(local_rank=1, pid=10_001, exit_code=-9))
        last = (await until(lambda: recovered(generation), 10, "the kill's recovery measured"))[-1]
        assert not last["planned"] and last["recovery_s"] > 0

        def timed():  # the phases come with the ranks' frames a few steps into the generation
            r = recovered(generation)[-1]
            return r if r["slowest"] == "moved" and r["bytes_moved"] == 7 << 20 else None  # every rank's word: 7 ranks left x 1 MiB

        drawn = await until(timed, 10, "every rank's phases in the recovery")
        assert (drawn["abort_s"], drawn["form_s"], drawn["sync_s"], drawn["transfer_s"]) == (0.01, 0.05, 0.35, 0.3)
        assert {r["phase"] for r in job()["ranks"]} == {"phased"}
        for n in nodes:
            await n.stop()

    asyncio.run(scenario())
