"""`muster logs` keeps jobs apart (security review 5, M2 and L2): two real `muster run` agents of
jobs A and B, both node `n0`, share one --log-dir; each job's files are under DIR/<job>/<run>/ and
the agent's user's alone; `logs` shows one job's lines, only to a caller whose token may see that
job; what a rank prints reaches the terminal escaped. And the coordinator refuses control
characters in a Leave's or Stop's reason and in a rank's phase, naming the field."""

import asyncio
import os
import re
import stat
import subprocess
import sys

import grpc
import pytest

from muster import rank_logs
from muster.local import SimulatedNode, wait_until
from muster.v1 import muster_pb2 as pb

TOKEN_A, TOKEN_B, OPERATOR = "a" * 24, "b" * 24, "o" * 24
TITLE = "\x1b]0;owned\x07"  # sets the terminal's window title (OSC ... BEL)
RLO = "\u202e"  # right-to-left override: what follows reads backwards
RANK = r"""
import sys, time
job = sys.argv[1]
print(job, "says \x1b]0;owned\x07 then \u202e", flush=True)
while True:  # lines to follow, until the agent stops it
    print(job, "tick", flush=True)
    time.sleep(0.2)
"""


def muster(*args, token: str = "", timeout: float = 30):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("MUSTER_")}, "MUSTER_TOKEN": token}
    return subprocess.run([sys.executable, "-m", "muster.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.mark.timeout(150)
def test_two_jobs_with_one_node_id_in_one_log_dir_each_see_only_their_own_lines(coordinators, agents, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"job-a {TOKEN_A}\njob-b {TOKEN_B}\n* {OPERATOR}\n")
    tokens.chmod(0o600)
    (replica,) = coordinators(1, ["--tokens", str(tokens)])
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    a, b = (agents([replica.address], job, ["n0"], slots=1, nodes="1:1", env={"MUSTER_TOKEN": token},
                   command=[sys.executable, str(script), job])[0]
            for job, token in (("job-a", TOKEN_A), ("job-b", TOKEN_B)))
    for agent in (a, b):
        wait_until(lambda: agent.rank_logs(0) and "tick" in agent.rank_logs(0)[-1].read_text(), 90,
                   f"{agent.job}'s rank printing")
    log_dir = a.log_dir  # the fixture's: one directory for both
    assert b.log_dir == log_dir

    # the layout: DIR/<job>/<run>/, the directories 0700 and the files 0600
    for job in ("job-a", "job-b"):
        run = rank_logs.run_dir(log_dir, job, 1)
        assert sorted(p.name for p in run.iterdir()) == ["n0-agent.log", "n0-slot0-1.log"]
        assert [stat.S_IMODE(p.stat().st_mode) for p in (run.parent, run)] == [0o700, 0o700]
        assert {stat.S_IMODE(p.stat().st_mode) for p in run.iterdir()} == {0o600}

    at = ("--coordinator", replica.address, "--log-dir", str(log_dir))
    out = muster("logs", "job-a", *at, "--tail", "1000", token=TOKEN_A)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any(line.startswith("n0/0| job-a tick") for line in lines)
    assert "job-b" not in out.stdout  # neither B's rank nor B's agent
    # the agent's records as text: the time with its zone, the level, the event, then key=value
    agent_lines = [line.removeprefix("n0/agent| ") for line in lines if line.startswith("n0/agent| ")]
    assert agent_lines and all(re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d [+-]\d{4} ", a) for a in agent_lines)
    assert {m for a in agent_lines for m in re.findall(r"\bjob=(\S+)", a)} == {"job-a"}
    assert any(" node_joined " in a for a in agent_lines)  # held from before the Join, then written
    # the rank's escape sequences reach the terminal as text
    assert "n0/0| job-a says \\x1b]0;owned\\x07 then \\u202e" in lines
    assert "\x1b" not in out.stdout and "\x07" not in out.stdout and RLO not in out.stdout

    # the caller's right to see the job, whatever the flags; nothing printed on a refusal
    for args, token, refusal in [(("job-a", "--node", "n0"), "", "UNAUTHENTICATED"),
                                 (("job-a",), TOKEN_B, "PERMISSION_DENIED"),
                                 (("job-b", "--node", "n0"), TOKEN_A, "PERMISSION_DENIED"),
                                 (("job-b", "--rank", "0"), TOKEN_A, "PERMISSION_DENIED")]:
        out = muster("logs", *args, *at, token=token)
        assert (out.returncode, out.stdout) == (1, ""), (args, out)
        assert out.stderr.startswith(f"muster logs: {refusal}"), (args, out.stderr)
    out = muster("logs", "job-b", *at, "--node", "n0", "--tail", "1000", token=OPERATOR)
    assert out.returncode == 0 and "job-b tick" in out.stdout and "job-a" not in out.stdout, out
    out = muster("logs", "job-a", *at, "--node", "n9", token=TOKEN_A)
    assert out.returncode == 2 and "no logs of n9 in " in out.stderr and "job-a/1" in out.stderr, out

    # a follower piped into `head` ends quietly once head has its lines
    out = subprocess.run(f"{sys.executable} -m muster.cli logs job-a --coordinator {replica.address} "
                         f"--log-dir {log_dir} --node n0 --follow --tail 5 | head -2", shell=True,
                         capture_output=True, text=True, timeout=30, env={**os.environ, "MUSTER_TOKEN": TOKEN_A})
    assert len(out.stdout.splitlines()) == 2 and "Error" not in out.stderr, out.stderr


@pytest.mark.timeout(60)
def test_control_characters_in_a_reason_or_a_phase_are_refused_at_the_wire(coordinators):
    (replica,) = coordinators(1)

    async def scenario():
        node = SimulatedNode([replica.address], "tricks", "n0", slots=1, spec=pb.JobSpec(min_nodes=1, max_nodes=1))
        await node.join()
        node.start()
        try:
            await node.wait_for(lambda n: n.assignment().role == pb.ROLE_ACTIVE, 10, "a place")
            with pytest.raises(grpc.aio.AioRpcError) as left:
                await node.session.leave(reason=f"bye {TITLE}", retry_for_s=5)
            assert left.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert left.value.details().startswith("reason") and "control character" in left.value.details()
            # a rank's phase: its node's stream is refused
            node.session._reports = lambda: [pb.RankReport(local_rank=0, pid=1, state=pb.RANK_STATE_LONG_PHASE,
                                                           phase=f"checkpoint {RLO}gnp.exe")]
            await node.wait_for(lambda n: n.errors, 10, "the stream refused")
            (refused,) = node.errors
            assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT, refused
            assert refused.details().startswith("phase of local_rank 0") and "control character" in refused.details()
        finally:
            await node.stop()

    asyncio.run(scenario())
    out = muster("stop", "tricks", "--coordinator", replica.address, "--reason", f"{TITLE}done")
    assert out.returncode == 1 and out.stderr.startswith("muster stop: INVALID_ARGUMENT: reason"), out
    assert "\x1b" not in out.stderr
