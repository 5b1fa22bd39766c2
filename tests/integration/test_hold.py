"""Hold, don't crash: a rank lost while no coordinator answers costs that rank only. The survivors'
collectives fail, they discard the step and hold (process and state kept) until a leader is back,
then the job re-forms from their state; nothing reaches the training script."""

import os
import signal
import time

import pytest

from muster.local import CoordinatorProcess, json_lines, process_alive, progress_gap, wait_until

PRODUCTION_TIMEOUT = ["--heartbeat-timeout", "2.0"]


def last_steps(agents):
    """(node, slot) -> the newest step record of the newest process of that slot."""
    out = {}
    for a in agents:
        for slot in (0, 1):
            steps = a.steps(slot)
            if steps:
                out[(a.node_id, slot)] = steps[-1]
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", ["gloo", "nccl-twin"])
def test_a_rank_killed_while_no_coordinator_answers_costs_only_that_rank(etcd, coordinators, agents, tmp_path,
                                                                        backend):
    (leader,) = coordinators(1, extra=PRODUCTION_TIMEOUT)
    a, b = agents([leader.address], "hold", ["a", "b"], steps=10**6, step_sleep_s=0.05,
                  env={"MUSTER_BACKEND": backend})
    wait_until(lambda: len(last_steps([a, b])) == 4 and min(r["step"] for r in last_steps([a, b]).values()) >= 10,
               90, "every rank past step 10")
    survivors = {(n, s): n.rank_pids(s)[-1] for n in (a, b) for s in (0, 1) if (n, s) != (b, 1)}
    generation = max(r["generation"] for r in last_steps([a, b]).values())

    leader.kill()  # no coordinator answers from now on
    victim = b.rank_pids(1)[-1]
    os.kill(victim, signal.SIGKILL)
    wait_until(lambda: all(any(r.get("event") == "rank_holding" for r in n.rank_records(s))
                           for (n, s) in survivors), 30, "every survivor holding")
    top = max(r["step"] for r in last_steps([a, b]).values())

    replacement = CoordinatorProcess([etcd.endpoint], tmp_path / "coordinator-back.log", PRODUCTION_TIMEOUT,
                                     listen=leader.address)
    try:
        time.sleep(8)  # the outage lasts longer than the 5 s after which the error used to reach the script
        for (n, s), pid in survivors.items():
            assert process_alive(pid), f"survivor {n.node_id}/{s} died during the outage"
        replacement.start()
        wait_until(lambda: len(last_steps([a, b])) == 4 and all(
            r["generation"] > generation and r["step"] > top + 5 for r in last_steps([a, b]).values()),
            60, "all four slots training again in a new generation")
        for (n, s), pid in survivors.items():
            assert n.rank_pids(s)[-1] == pid and process_alive(pid), f"survivor {n.node_id}/{s} lost its process"
            gap = progress_gap(n.rank_records(s))
            assert not gap, f"{n.node_id}/{s} {gap}"
        kinds = {r["kind"] for r in replacement.find("membership_changed")}
        assert kinds & {"rank_exited", "group_broken"}, kinds
        formed = [r for n in (a, b) for s in (0, 1) for log in n.rank_logs(s) for r in json_lines(log, "group_formed")]
        assert {r["backend"] for r in formed} == {backend}
    finally:
        replacement.stop()


@pytest.mark.timeout(120)
def test_a_hold_ends_with_a_clear_message_once_the_hold_timeout_passes(coordinators, training):
    (leader,) = coordinators(1, extra=PRODUCTION_TIMEOUT)
    ranks = training([leader.address], "expire", n=2, steps=10**6, min_nodes=2, max_nodes=2,
                     env={"MUSTER_HOLD_TIMEOUT": "4"})
    wait_until(lambda: all(r.last_step >= 5 for r in ranks), 60, "both ranks past step 5")
    leader.kill()
    ranks[1].proc.kill()
    code = ranks[0].wait(60)
    stopped = ranks[0].records("training_stopped")
    assert code == 3 and stopped, ranks[0].log_path.read_text()[-2000:]
    assert "held 4s for a new generation" in stopped[-1]["error"]
    assert ranks[0].records("rank_holding"), "the survivor did not hold first"


@pytest.mark.timeout(180)
def test_a_node_removed_while_unheard_joins_again_with_its_ranks(coordinators, agents):
    """The leader removes a node it cannot hear (node_silent): here its agent frozen past the
    heartbeat timeout; in a soak, a node that reached a new leader just after its takeover grace once
    every coordinator had been down. Alive again, the node is told it is no member: it joins again as
    a new member, its ranks held (process and state kept), and the job re-forms at full strength."""
    (leader,) = coordinators(1, extra=PRODUCTION_TIMEOUT)
    a, b = agents([leader.address], "unheard", ["a", "b"], steps=10**6, step_sleep_s=0.05)
    wait_until(lambda: len(last_steps([a, b])) == 4 and min(r["step"] for r in last_steps([a, b]).values()) >= 10,
               90, "every rank past step 10")
    pids = {(n, s): n.rank_pids(s)[-1] for n in (a, b) for s in (0, 1)}

    b.signal(signal.SIGSTOP)
    try:
        wait_until(lambda: leader.find("membership_changed", kind="node_silent"), 30, "the leader to judge b silent")
    finally:
        b.signal(signal.SIGCONT)
    removed = max(r["generation"] for r in leader.find("membership_changed", kind="node_silent"))
    wait_until(lambda: b.records("node_rejoining"), 30, "b to join again")
    wait_until(lambda: len(last_steps([a, b])) == 4 and all(
        r["generation"] > removed and r["world_size"] == 4 for r in last_steps([a, b]).values()),
        60, "all four ranks training together again after b was removed")
    for (n, s), pid in pids.items():
        assert n.rank_pids(s)[-1] == pid and process_alive(pid), f"{n.node_id}/{s} lost its process"
    # b's kept ranks were told their old group is gone (a's ranks aborted it when b was removed):
    # they leave it at once rather than step on in it to a planned switch.
    for s in (0, 1):
        assert any(r["abort"] for r in b.rank_records(s, "assignment_received") if r["generation"] > removed), s
    assert b.proc.poll() is None and not b.records("node_evicted")
    joined = [r for r in leader.find("membership_changed", kind="node_joined") if r["nodes"] == ["b"]]
    assert len(joined) == 2, joined  # its first join, and the one after its removal
