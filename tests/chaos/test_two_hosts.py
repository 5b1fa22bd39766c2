"""Two "hosts" (the root network namespace and one behind a veth pair) run one job from the docs'
own command lines, with no --host: each agent advertises its address on the route to the
coordinator, not 127.0.0.1, so the other node's ranks reach its store and its ranks. The library's
example, and an unmodified gloo script: its ranks get the interface holding that address
(GLOO_SOCKET_IFNAME), where gloo alone binds to the hostname's address and dials loopback. The
script's run is issue 58's newcomer path whole: tokens, a killed rank's recovery and its phases in
`muster events --json` and on the live page (headless chromium), then a node lost while the job
waits for its minimum, which spends no restart and ends the run failed with the reason. Needs root
(network namespaces), and chromium for the page; skipped with the reason otherwise."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from harness import NetNamespace
from muster.local import CoordinatorProcess, json_lines, wait_until

sys.path.insert(0, str(Path(__file__).parents[1] / "integration"))  # the browser's helpers
from test_web_browser import browser, shown  # noqa: E402

pytestmark = pytest.mark.timeout(150)


LIBRARY = ["torchrun", "--nproc-per-node", "1", "-m", "muster.examples.train_ddp", "--steps", "30", "--step-sleep", "0.02"]
# the unmodified gloo script, run until the test ends it; a checkpoint directory both hosts share
PLAIN = [sys.executable, str(Path(__file__).parents[2] / "examples" / "train_plain.py"), "--steps", "100000",
         "--step-sleep", "0.05", "--checkpoint-dir"]
JOB, JOB_TOKEN, OPERATOR = "newcomer", "n" * 24, "o" * 24
WAITING_TIMEOUT_S = 6  # serve's --waiting-timeout: the run below its minimum this long ends failed


def test_a_library_job_over_two_hosts_forms_from_the_docs_command_lines_without_host(etcd, tmp_path):
    why = NetNamespace.unavailable()
    if why:
        pytest.skip(why)
    ns = NetNamespace("twoh").create()
    serve = CoordinatorProcess([etcd.endpoint], tmp_path / "serve.log", ["--insecure"],
                               listen=f"{ns.host_ip}:0")
    agents = []
    try:
        serve.start()
        # getting-started's command line, sized for one CPU rank a node
        run = [str(Path(sys.executable).parent / "muster"), "--log-json", "run", "--coordinator", serve.address,
               "--job", "twohosts", "--nodes", "2", "--"]
        for name, wrap in (("inside", ns.wrap()), ("outside", [])):
            log = open(tmp_path / f"{name}.log", "w")
            agents.append((name, subprocess.Popen([*wrap, *run, *LIBRARY], stdout=log, stderr=subprocess.STDOUT,
                                                  start_new_session=True)))
        codes = {name: p.wait(120) for name, p in agents}
        logs = {name: (tmp_path / f"{name}.log").read_text() for name, _ in agents}
        assert codes == {"inside": 0, "outside": 0}, {n: t[-3000:] for n, t in logs.items()}
        joined = {name: next(json.loads(line) for line in text.splitlines() if '"node_joined"' in line)
                  for name, text in logs.items()}
        assert joined["inside"]["host"] == ns.node_ip and joined["outside"]["host"] == ns.host_ip, joined
        assert not any("which other hosts cannot reach" in t for t in logs.values())
    finally:
        for _, p in agents:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        serve.stop()
        ns.delete()


def secret(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o600)  # a tokens or token file others may read is refused
    return path


def step_records(log: Path) -> list[dict]:
    return [r for r in json_lines(log, "step") if "world_size" in r]  # the script's lines (the agent's have no world)


@pytest.mark.timeout(240)  # (four Python processes importing torch start it on a loaded machine)
def test_the_newcomers_path_two_hosts_a_plain_script_a_killed_rank_and_a_node_lost_while_waiting(tmp_path):
    """Issue 58's "done when", as a new user meets it from the docs: `muster serve` (its private
    etcd) with tokens and the live page, `muster run` on two hosts with the docs' command line
    around an unmodified gloo script, nothing set by hand."""
    why = NetNamespace.unavailable()
    if why:
        pytest.skip(why)
    page = browser()  # (skips, saying why, without chromium)
    ns = NetNamespace("newc").create()
    tokens = secret(tmp_path / "tokens", f"{JOB} {JOB_TOKEN}\n* {OPERATOR}\n")
    token = secret(tmp_path / "token", JOB_TOKEN)
    serve = CoordinatorProcess([], tmp_path / "serve.log", [
        "--data-dir", str(tmp_path / "etcd"), "--tokens", str(tokens), "--metrics-listen", "127.0.0.1:0", "--http",
        "--waiting-timeout", str(WAITING_TIMEOUT_S)], listen=f"{ns.host_ip}:0")
    muster = str(Path(sys.executable).parent / "muster")
    agents: dict[str, subprocess.Popen] = {}
    logs = {name: tmp_path / f"{name}.log" for name in ("inside", "outside")}

    def cli(*args: str) -> dict:
        out = subprocess.run([muster, *args, JOB, "--coordinator", serve.address, "--token-file", str(token), "--json"],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout)

    try:
        serve.start(timeout_s=60)
        run = [muster, "--log-json", "run", "--coordinator", serve.address, "--job", JOB, "--nodes", "2",
               "--token-file", str(token), "--wait-report", "1", "--"]
        for name, wrap in (("inside", ns.wrap()), ("outside", [])):
            with open(logs[name], "w") as log:
                agents[name] = subprocess.Popen([*wrap, *run, *PLAIN, str(tmp_path / "checkpoint")], stdout=log,
                                                stderr=subprocess.STDOUT, start_new_session=True)

        # Formed across the hosts at once, without a variable set by hand: every step at world size 2, no restart
        wait_until(lambda: all(len(step_records(log)) >= 5 for log in logs.values()), 90, "both hosts' ranks stepping",
                   interval_s=0.2, diagnose=lambda: {n: log.read_text()[-2000:] for n, log in logs.items()})
        steps = [r for log in logs.values() for r in step_records(log)]
        assert {(r["rank"], r["world_size"], r["restart_count"]) for r in steps} == {(0, 2, 0), (1, 2, 0)}, steps[-4:]

        # (a) a rank SIGKILLed: the job recovers, its recovery's phases on the page and in events --json
        page.set_page_load_timeout(20)
        page.get(serve.find("coordinator_serving")[0]["page"] + f"jobs/{JOB}")
        shown(page, "main .error", lambda t: "no token" in t, 10, "the token asked for")
        form = page.find_element("id", "token")
        form.send_keys(JOB_TOKEN)
        form.submit()
        before = int(shown(page, "#generation", lambda t: t.split()[-1].isdigit(), 15, "the job").split()[-1])
        (victim,) = [r["pid"] for r in json_lines(logs["outside"], "rank_started")][-1:]
        os.kill(victim, signal.SIGKILL)
        # (the page asks every second; each CLI call is a Python start: asked once it is drawn)
        try:
            drawn = shown(page, f"#recovery-{before + 1}", lambda t: "first step" in t, 60,
                          "the recovery's timeline on the page")
        except AssertionError as exc:  # the leader's word, to tell a page not drawn from a recovery not over
            raise AssertionError(f"{exc}\nmuster events says {cli('events')['recoveries']}; "
                                 f"the ranks: {cli('status')['jobs'][0]['ranks']}") from None
        for phase in ("detected", "maps delivered", "first step"):
            assert phase in drawn, drawn
        page.save_screenshot(str(tmp_path / "recovery.png"))
        print(f"screenshot: {tmp_path / 'recovery.png'}")
        (killed,) = [r for r in cli("events")["recoveries"] if r["generation"] == before + 1]
        # a script's phases (no group or state of the library's): detected (the exit's report came
        # within a tally: ~0), maps delivered, and its restarted ranks' first step, the slowest
        assert not killed["planned"] and killed["recovery_s"] > 0 and killed["detection_s"] >= 0, killed
        assert killed["delivered_s"] > 0 and killed["first_step_s"] > 0 and killed["slowest"] == "first_step", killed
        shown(page, f"#recovery-{before + 1} .slowest-name", lambda t: t == "first step", 5, "the slowest phase named")

        # (b) the inside host lost while the job needs both: the outside one waits, starting no rank
        # without a place and giving no slot up, and the run ends failed, with the reason, once it
        # waited --waiting-timeout below its minimum
        lost_at = len(json_lines(logs["outside"]))
        os.killpg(agents["inside"].pid, signal.SIGKILL)  # the host's agent and its ranks
        assert agents["outside"].wait(WAITING_TIMEOUT_S + 60) == 1, logs["outside"].read_text()[-3000:]
        since = json_lines(logs["outside"])[lost_at:]
        waiting = [r for r in since if r["event"] == "waiting" and "more node" in r.get("message", "")]
        assert len(waiting) >= 3, since  # it said so each second (--wait-report 1)
        assert not [r for r in since if r["event"] in ("rank_started", "slot_given_up")], since
        (js,) = cli("status")["jobs"]
        assert js["outcome"] == "failed" and f"waited {WAITING_TIMEOUT_S}s below" in js["outcome_reason"], js
    finally:
        page.quit()
        for p in agents.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
        serve.stop()
        ns.delete()
