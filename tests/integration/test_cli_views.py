"""The terminal views against a live deployment (etcd, `muster serve`, two `muster run` agents
training): status --watch, events --follow, logs, and every verb's --json checked against the
schema in the reference (docs/reference/json-schema.json)."""

import json
import os
import re
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest

from muster import rank_logs, version
from muster.local import AgentProcess, wait_until

SCHEMA = json.loads((Path(__file__).resolve().parents[2] / "docs" / "reference" / "json-schema.json").read_text())
JOB = "views"


def muster(*args, timeout=30):
    return subprocess.run([sys.executable, "-m", "muster.cli", *args], capture_output=True, text=True, timeout=timeout)


# A view that the test ends with Ctrl-C gets SIGINT as at a terminal, even in a suite started in the
# background (a shell's background job inherits SIGINT ignored, and Python keeps it so). The child
# sets it itself: a preexec_fn forks a test process whose gRPC threads are running, and such a child
# can die before its exec (stop 53's CI: the view's stdout closed empty).
AT_A_TERMINAL = ("import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
                 "runpy.run_module('muster.cli', run_name='__main__', alter_sys=True)")


def started(*args, **kwargs):
    kwargs.setdefault("stdout", subprocess.PIPE)
    return subprocess.Popen([sys.executable, "-c", AT_A_TERMINAL, *args], stderr=subprocess.PIPE, **kwargs)


def valid(doc, kind: str):
    jsonschema.validate(doc, {"$ref": f"#/$defs/{kind}", "$defs": SCHEMA["$defs"]})
    return doc


def answered(kind: str, *args):
    out = muster(*args, "--json")
    assert out.returncode == 0, out.stderr
    return valid(json.loads(out.stdout), kind)


def read_until(fd: int, done, timeout_s: float, what: str) -> bytes:
    """Bytes from `fd` until done(all so far), within a bound."""
    data, deadline = b"", time.monotonic() + timeout_s
    while not done(data):
        left = deadline - time.monotonic()
        assert left > 0, f"timed out waiting for {what}: {data[-2000:]!r}"
        if select.select([fd], [], [], left)[0]:
            chunk = os.read(fd, 65536)
            assert chunk, f"closed before {what}: {data[-2000:]!r}"
            data += chunk
    return data


def interrupted(proc: subprocess.Popen) -> None:
    """Ctrl-C ends it at once, with status 0 and no traceback."""
    proc.send_signal(signal.SIGINT)
    assert proc.wait(10) == 0
    assert b"Traceback" not in proc.stderr.read()


@pytest.mark.timeout(180)
def test_watch_follow_logs_and_every_json_against_a_live_deployment(coordinators, agents, tmp_path):
    (replica,) = coordinators(1)
    at = ("--coordinator", replica.address)
    assert answered("jobs", "jobs", *at) == {"jobs": []}
    assert answered("status", "status", *at) == {"replica": replica.address, "version": version(), "leader": None,
                                                 "term": None, "jobs": []}

    a, b = agents([replica.address], JOB, ["a", "b"], slots=1, steps=100_000, step_sleep_s=0.05)
    log_dir = a.log_dir
    wait_until(lambda: a.steps(0) and b.steps(0) and a.steps(0)[-1]["world_size"] == 2, 90, "both nodes training")

    def ranks():
        (js,) = answered("status", "status", *at, "--job", JOB)["jobs"]
        return js["ranks"] if js["world_size"] == 2 and all(r["pid"] for r in js["ranks"]) else None

    # ranks are findable: PID and host in status, and `ps` shows a warm rank's script, not the zygote
    for r in wait_until(ranks, 30, "both ranks' pids"):
        assert r["host"] == "127.0.0.1"
        cmdline = Path(f"/proc/{r['pid']}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        assert str(AgentProcess.SCRIPT) in cmdline and "--steps 100000" in cmdline and "zygote" not in cmdline

    events = started("events", *at, "--job", JOB, "--follow", "--json", "--interval", "0.2")
    followed = tmp_path / "followed.txt"  # (ranks write faster than a pipe left unread holds)
    follow = started("logs", JOB, *at, "--log-dir", str(log_dir), "--follow", "--tail", "0", "--interval", "0.2",
                     stdout=open(followed, "wb"))

    # status --watch: a document per line under --json; redrawn in place on a terminal; Ctrl-C ends it
    watch = started("status", *at, "--job", JOB, "--watch", "--json", "--interval", "0.2")
    frames = read_until(watch.stdout.fileno(), lambda d: d.count(b"\n") >= 2, 20, "two frames").splitlines()
    for line in frames[:2]:
        assert valid(json.loads(line), "status")["jobs"][0]["name"] == JOB
    interrupted(watch)
    terminal, tty = pty.openpty()
    watch = started("status", *at, "--job", JOB, "--watch", "--interval", "0.2", stdout=tty)
    os.close(tty)
    screen = read_until(terminal, lambda d: d.count(b"every 0.2s: muster status") >= 2, 20, "two screens")
    assert b"\x1b[H" in screen and b"RANK" in screen and b"127.0.0.1" in screen
    interrupted(watch)
    os.close(terminal)

    # logs: one rank's latest lines (its own records), a node's (prefixed), every node's
    out = muster("logs", JOB, *at, "--log-dir", str(log_dir), "--rank", "1", "--tail", "3")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    steps = [r for r in map(json.loads, filter(lambda line: line.startswith("{"), lines)) if r["event"] == "step"]
    assert len(lines) == 3 and steps and all(r["rank"] == 1 for r in steps)
    out = muster("logs", JOB, *at, "--log-dir", str(log_dir), "--node", "a", "--tail", "2")
    prefixes = [line.split("| ", 1)[0] for line in out.stdout.splitlines()]
    assert out.returncode == 0 and prefixes == ["a/agent"] * 2 + ["a/0"] * 2  # the agent's own lines, then its rank's
    agent = [line.split("| ", 1)[1] for line in out.stdout.splitlines()[:2]]  # its JSON records, as text
    assert all(re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d [+-]\d{4} (debug|info|warning|error) +[a-z_]+", a) for a in agent)
    out = muster("logs", JOB, *at, "--log-dir", str(log_dir), "--tail", "1")
    prefixes = sorted(line.split("| ", 1)[0] for line in out.stdout.splitlines())
    assert out.returncode == 0 and prefixes == ["a/0", "a/agent", "b/0", "b/agent"]
    assert '"event": "rank_started"' in rank_logs.agent_log(rank_logs.run_dir(log_dir, JOB, 1), "a").read_text()
    out = muster("logs", JOB, *at, "--log-dir", str(log_dir), "--rank", "7")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "no rank 7" in out.stderr

    # a rank killed and restarted by its agent: status counts the restart, on that rank only
    (killed,) = [r for r in ranks() or () if r["node"] == "a"]
    os.kill(killed["pid"], signal.SIGKILL)

    def restarted():
        found = {r["node"]: r for r in ranks() or ()}
        back = found.get("a") and found["a"]["pid"] != killed["pid"] and found["a"]["state"] == "running"
        return found if back and found["a"]["restarts"] >= 1 else None

    found = wait_until(restarted, 60, "a's rank restarted and its restart counted")
    # b's is whatever b's agent counted (its rank may have died of the reform too, under load)
    assert found["b"]["restarts"] == b.records("rank_started")[-1]["restart_count"]
    table = [line.split() for line in muster("status", *at, "--job", JOB).stdout.splitlines()]
    column = next(line for line in table if "RESTARTS" in line).index("RESTARTS")
    rows = {line[2]: line for line in table if line[2:3] in (["a"], ["b"])}  # (NODE is the third column)
    assert (rows["a"][column], rows["b"][column]) == (str(found["a"]["restarts"]), str(found["b"]["restarts"]))

    # the operator verbs' --json; the followers end on their own once the run has its outcome
    drained = answered("drain", "drain", *at, "--job", JOB, "--node", "b")
    assert (drained["job"], drained["node"]) == (JOB, "b") and drained["generation"] >= 2 and not drained["already"]
    # A drain repeated is answered, not refused (b left with the first)
    again = answered("drain", "drain", *at, "--job", JOB, "--node", "b")
    assert again["already"] and again["generation"] >= drained["generation"], again
    out = muster("drain", *at, "--job", JOB, "--node", "b")
    assert out.returncode == 0 and out.stdout == f"node b of job {JOB} had left already: nothing changed\n", out
    assert b.wait(60) == 3
    stopped = answered("stop", "stop", JOB, *at)
    assert stopped["job"] == JOB and stopped["run"] == 1 and not stopped["already"]
    # A stop repeated (the first's answer lost to a deadline, say) is answered, not refused: as the run
    # ends at its leader, and once it has ended (at the replica, from its record)
    assert answered("stop", "stop", JOB, *at) == {"job": JOB, "run": 1, "after_step": 0, "already": True}
    assert a.wait(60) == 3
    out = muster("stop", JOB, *at)
    assert out.returncode == 0 and out.stdout == f"job {JOB} run 1 was stopped already: nothing changed\n", out
    assert events.wait(30) == 0 and follow.wait(30) == 0
    lines = [valid(json.loads(line), "event_line") for line in events.stdout.read().splitlines()]
    kinds = [line["event"]["kind"] for line in lines]
    assert kinds[0] == "node_joined" and "node_left" in kinds and "stopped" in kinds
    every = answered("events", "events", *at, "--job", JOB)["events"]
    assert [line["event"] for line in lines] == every, (kinds, [e["kind"] for e in every])  # each once
    followed = followed.read_text().splitlines()
    assert any(line.startswith("a/0| ") and '"event": "step"' in line for line in followed)
    assert any(line.startswith("b/agent| ") and "drain" in line for line in followed)  # b's agent, as it left

    (js,) = answered("status", "status", *at, "--job", JOB)["jobs"]
    assert (js["outcome"], js["phase"]) == ("stopped", "ended") and js["ended_unix_ms"] > 0
    (record,) = answered("jobs", "jobs", *at)["jobs"]
    assert (record["outcome"], record["leader"]) == ("stopped", None)
    assert answered("delete", "delete", JOB, *at) == {"job": JOB, "deleted": 1}
    out = muster("stop", JOB, *at)  # no run of it retained: nothing says it was stopped
    assert out.returncode != 0 and f"job {JOB!r} is not running" in out.stderr, out
