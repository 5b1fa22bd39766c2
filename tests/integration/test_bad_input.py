"""Bad input and unreachable peers, as a user meets them at the command line: one line on stderr
naming the flag or the address, the documented exit status, before any side effect (no etcd
started, no log line first) and within the user's timeout."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
MUSTER = [sys.executable, "-m", "muster.cli"]
DEAD = "127.0.0.1:1"  # nothing listens on port 1

CASES = [
    # (argv, exit status, the one line must match)
    (["run", "--job", "j", "--slots", "-1", "--", "python", "-c", "1"], 2, r"^muster run: argument --slots: must be a positive integer, got '-1'"),
    (["run", "--job", "j", "--slots", "0", "--", "python", "-c", "1"], 2, r"^muster run: argument --slots: must be a positive integer, got '0'"),
    (["run", "--job", "j", "--slots", "many", "--", "python", "-c", "1"], 2, r"argument --slots: must be a positive integer, got 'many'"),
    (["run", "--", "python", "-c", "1"], 2, r"^muster run: the job is required: --job JOB \(or torchrun's --rdzv-id, or set MUSTER_JOB\)$"),
    (["run", "--coordinator", DEAD, "--job", "j", "--", "torchrun", "--rdzv-id", "k", "train.py"], 2,
     r"^muster run: torchrun --rdzv-id k contradicts --job j: name the job once$"),
    (["run", "--job", "", "--coordinator", DEAD, "--", "python", "t.py"], 2, r"^muster run: the job id is empty"),
    (["run", "--coordinator", "nonsense", "--job", "j", "--", "torchrun", "train.py"], 2,
     r"^muster run: coordinator address 'nonsense' is not HOST:PORT"),
    (["run", "--coordinator", DEAD, "--job", "j", "--nodes", "2", "--", "torchrun", "--nnodes", "3", "train.py"], 2,
     r"^muster run: torchrun --nnodes 3:3 contradicts --nodes 2"),
    (["run", "--job", "j"], 2, r"^muster run: give the command to run after --"),
    (["run", "--job", "j", "--join-timeout", "-3", "--", "python", "-c", "1"], 2, r"argument --join-timeout: must be a positive number"),
    (["serve", "--heartbeat-timeout", "-1"], 2, r"^muster serve: argument --heartbeat-timeout: must be a positive number, got '-1'"),
    (["serve", "--heartbeat-interval", "3"], 2, r"^muster serve: --heartbeat-interval \(3.0\) must be below --heartbeat-timeout \(2.0\)$"),
    (["serve", "--listen", "nonsense"], 2, r"^muster serve: .*--listen.*nonsense"),
    (["serve", "--grace", "inf"], 2, r"argument --grace: must be a positive number, got 'inf'"),
    (["demo", "--nodes", "0"], 2, r"^muster demo: argument --nodes: must be a positive integer"),
    (["status", "--coordinator", "nonsense"], 2, r"^muster status: coordinator address 'nonsense' is not HOST:PORT$"),
    (["status", "--job", "j", "--timeout", "0"], 2, r"argument --timeout: must be a positive number, got '0'"),
    (["status", "--job", "j", "--coordinator", DEAD], 1, r"^muster status: UNAVAILABLE: .*127\.0\.0\.1:1"),
    (["stop"], 2, r"^muster stop: the job is required: muster stop JOB \(or set MUSTER_JOB\)$"),
    (["status", "a", "--job", "b"], 2, r"^muster status: the job is named twice, 'a' and --job 'b'$"),
    (["status", "--watch", "--interval", "0"], 2, r"^muster status: argument --interval: must be within 0\.1 and 3600 seconds, got '0'"),
    (["events", "--job", "j", "--follow", "--interval", "4000"], 2, r"argument --interval: must be within 0\.1 and 3600"),
    (["logs", "j", "--coordinator", DEAD], 2, r"^muster logs: --log-dir is required \(or set MUSTER_LOG_DIR\)"),
    (["logs", "j", "--log-dir", "none", "--coordinator", DEAD], 2, r"^muster logs: --log-dir none: no such directory$"),
    (["logs", "j", "--log-dir", ".", "--tail", "-1", "--coordinator", DEAD], 2, r"^muster logs: --tail must be at least 0$"),
    (["logs", "j", "--log-dir", ".", "--node", "a", "--coordinator", DEAD], 1, r"^muster logs: UNAVAILABLE: .*127\.0\.0\.1:1"),
    (["serve", "--http"], 2, r"^muster serve: --http serves the page on the metrics port"),
    (["serve", "--http", "--metrics-listen", "0.0.0.0:0"], 2, r"^muster serve: --http on 0\.0\.0\.0:0 shows every job"),
    (["serve", "--http", "--metrics-listen", "0.0.0.0:0", "--tokens", "t"], 2, r"takes their tokens: .* --tls-cert"),
    (["nosuch"], 2, r"^muster: argument command: invalid choice: 'nosuch'"),
]


def one_line(argv: list[str], timeout_s: float, cwd: Path) -> tuple[int, str, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MUSTER_")}
    start = time.monotonic()
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, cwd=cwd, env=env)
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    assert len(lines) == 1, f"{argv}: not one line but {len(lines)}:\n" + "\n".join(lines[:20])
    return out.returncode, lines[0], time.monotonic() - start


@pytest.mark.parametrize("argv,code,said", CASES, ids=[" ".join(c[0]) for c in CASES])
@pytest.mark.timeout(60)
def test_a_bad_command_line_gets_one_line_and_its_exit_status(argv, code, said, tmp_path):
    got, line, _ = one_line([*MUSTER, *argv], 45, tmp_path)
    assert got == code and re.search(said, line), (got, line)
    assert not (tmp_path / ".muster").exists(), "a side effect before the refusal (serve's etcd data)"


@pytest.mark.timeout(90)
def test_torchrun_against_a_dead_endpoint_says_so_in_one_line_within_its_join_timeout(tmp_path):
    argv = [str(BIN / "torchrun"), "--nnodes", "1", "--nproc-per-node", "1", "--rdzv-backend=muster",
            "--rdzv-endpoint", DEAD, "--rdzv-id", "deadend", "--rdzv-conf", "join_timeout=3",
            "-m", "muster.examples.train_ddp"]
    got, line, took = one_line(argv, 80, tmp_path)
    assert got == 1, (got, line)  # as `muster run`'s: nobody answered (2 is a wrong command line)
    assert re.search(r"^torchrun --rdzv-backend=muster: job 'deadend' could not join at 127\.0\.0\.1:1 "
                     r"\(--rdzv-endpoint\) within 3s \(--rdzv-conf join_timeout\): UNAVAILABLE", line), line
    assert took < 60, f"{took:.0f} s: the join's 3 s bound (and torch's import) should be all it takes"


@pytest.mark.timeout(60)
def test_serve_on_a_port_in_use_is_refused_in_one_line_before_etcd_starts(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        for flag in ("--listen", "--metrics-listen"):
            got, line, _ = one_line([*MUSTER, "serve", flag, address], 45, tmp_path)
            assert got == 2 and re.search(rf"^muster serve: {flag} {address}: Address already in use", line), line
            assert not (tmp_path / ".muster").exists(), "etcd started"
