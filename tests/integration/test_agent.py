"""`muster run` node agents over a real coordinator and etcd, running examples/train_ddp.py with
gloo: ranks and agents are killed or drained, the rest keep training."""

import os
import signal
import sys
import time

import pytest

from muster.testing import EXAMPLE, process_alive, wait_until

EXAMPLES = EXAMPLE.parent

PRODUCTION_TIMEOUT = ["--heartbeat-timeout", "2.0"]


def stepping(agents, at_least=10):
    wait_until(lambda: all(a.steps(s) and a.steps(s)[-1]["step"] >= at_least for a in agents for s in (0, 1)),
               90, f"every rank past step {at_least}")


def digests_by_step(runs, after_generation):
    by_step = {}
    for steps in runs:
        for r in steps:
            if r["generation"] > after_generation:
                by_step.setdefault(r["step"], set()).add(r["digest"])
    return by_step


@pytest.mark.timeout(150)
def test_a_killed_rank_is_replaced_and_rejoins_while_the_others_keep_their_pids(coordinators, agents):
    (leader,) = coordinators(1, extra=PRODUCTION_TIMEOUT)
    a, b = agents([leader.address], "agents", ["a", "b"], steps=300)
    stepping([a, b])
    pids = {(n, s): n.rank_pids(s) for n in (a, b) for s in (0, 1)}
    generation = b.steps(0)[-1]["generation"]
    os.kill(pids[(b, 0)][-1], signal.SIGKILL)
    wait_until(lambda: len(b.rank_pids(0)) == len(pids[(b, 0)]) + 1, 20, "the agent starts a replacement")
    for n in (a, b):
        assert n.wait(120) == 0, n.log_path.read_text()[-3000:]
    for (n, slot), before in pids.items():
        if (n, slot) != (b, 0):
            assert n.rank_pids(slot) == before, f"{n.node_id}/{slot} was restarted"
            run = n.steps(slot)
            assert run[-1]["step"] == 300, f"{n.node_id}/{slot} did not train to the end"
            steps = [r["step"] for r in run]
            assert steps == list(range(steps[0], steps[0] + len(steps)))
    replacement = b.steps(0, start=-1)
    assert replacement[0]["step"] > 1 and replacement[0]["world_size"] == 4 and replacement[-1]["step"] == 300
    final = digests_by_step([a.steps(0), a.steps(1), b.steps(1), replacement], replacement[0]["generation"] - 1)
    assert all(len(d) == 1 for d in final.values()), "ranks differ after the rejoin"
    assert len({d for ds in final.values() for d in ds}) == len(final)
    assert generation < replacement[0]["generation"]
    kinds = [r["kind"] for r in leader.find("membership_changed")]
    assert "rank_exited" in kinds and "rank_recovered" in kinds


@pytest.mark.timeout(120)
def test_a_killed_agent_takes_its_ranks_along_and_the_other_node_continues(coordinators, agents):
    (leader,) = coordinators(1, extra=PRODUCTION_TIMEOUT)
    a, b = agents([leader.address], "agentkill", ["a", "b"], steps=200)
    stepping([a, b])
    rank_pids = [a.rank_pids(0)[0], a.rank_pids(1)[0]]
    a.signal(signal.SIGKILL)
    killed = time.monotonic()
    wait_until(lambda: not any(process_alive(p) for p in rank_pids), 1.0, "the agent's ranks to exit")
    assert time.monotonic() - killed < 1.0
    assert b.wait(90) == 0, b.log_path.read_text()[-3000:]
    for slot in (0, 1):
        steps = b.steps(slot)
        assert steps[-1]["step"] == 200 and steps[-1]["world_size"] == 2
        numbers = [r["step"] for r in steps]
        assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))
    assert [r["kind"] for r in leader.find("membership_changed") if r["nodes"] == ["a"]][-1] == "node_silent"


@pytest.mark.timeout(120)
def test_sigterm_drains_an_agent_at_a_step_boundary_without_aborting_a_step(coordinators, agents):
    (leader,) = coordinators(1, extra=PRODUCTION_TIMEOUT)
    a, b = agents([leader.address], "drain", ["a", "b"], steps=200)
    stepping([a, b])
    a.signal(signal.SIGTERM)
    assert a.wait(60) == 0, a.log_path.read_text()[-3000:]
    planned = a.records("drain_planned")[0]["after_step"]
    for slot in (0, 1):
        assert a.steps(slot)[-1]["step"] == planned  # it stopped exactly at the agreed step
    assert b.wait(90) == 0
    for slot in (0, 1):
        log = b.rank_logs(slot)[0].read_text()
        assert "step_discarded" not in log, "a planned leave aborts nothing"
        steps = b.steps(slot)
        assert steps[-1]["step"] == 200 and steps[-1]["world_size"] == 2
        after = [r for r in steps if r["step"] == planned + 1]
        assert after and after[0]["world_size"] == 2


@pytest.mark.timeout(150)
def test_a_plain_script_survives_a_killed_rank_by_restart(coordinators, agents, tmp_path):
    (leader,) = coordinators(1, extra=PRODUCTION_TIMEOUT)
    plain = [sys.executable, str(EXAMPLES / "train_plain.py"), "--steps", "150", "--step-sleep", "0.05",
             "--checkpoint-dir", str(tmp_path / "checkpoint")]
    a, b = agents([leader.address], "plain", ["a", "b"], command=plain)
    stepping([a, b])
    os.kill(b.rank_pids(1)[-1], signal.SIGKILL)
    for n in (a, b):
        assert n.wait(120) == 0, n.log_path.read_text()[-3000:]
    for n in (a, b):
        for slot in (0, 1):
            final = n.steps(slot, start=-1)
            assert final[-1]["step"] == 150 and final[-1]["world_size"] == 4
            assert final[0]["resumed_from"] > 0, "the restarted ranks resumed from the checkpoint"
    assert len(a.rank_pids(0)) >= 2, "restart semantics: the other node's ranks were restarted too"


@pytest.mark.timeout(60)
def test_a_crash_looping_slot_is_given_up_after_its_restart_budget(coordinators, agents):
    (leader,) = coordinators(1)
    crash = [sys.executable, "-c", "import sys; sys.exit(7)"]
    (node,) = agents([leader.address], "crashloop", ["c"], slots=1, nodes="1:1", command=crash,
                     extra=["--max-restarts", "2"])
    assert node.wait(40) == 1  # not a success: the operator must see it
    crashes = [r for r in node.records("rank_exited") if r["code"] == 7]
    assert len(crashes) == 3  # the first run and two restarts (plain-script restarts with a new map are not crashes)
    (given_up,) = node.records("slot_given_up")
    assert given_up["restarts"] == 2 and given_up["last_code"] == 7
    exits = [r for r in leader.find("membership_changed") if r["kind"] == "rank_exited"]
    assert exits and "exit code 7" in exits[0]["reason"]
