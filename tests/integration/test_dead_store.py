"""A replacement rank handed a generation whose store host has just died (`muster demo`'s
"kill a node: NOT RECOVERED"): node0's rank is killed; its replacement gets the generation
that takes it back, hosted by node1's store, but node1's agent was killed meanwhile. The abort
generation that follows (node1 silent) must be formed at once: c10d's TCPStore constructor
retries a refused connect for the whole form timeout (300 s) and nothing could abandon it.
Run on gloo and on the NCCL-shaped twin (NCCL's abort and destroy rules over gloo)."""

import os
import signal

import pytest

from muster.local import record_time, wait_until

# Long enough that node1, killed as the replacement starts, is not yet found failed when the
# replacement reports: the leader then hands it the planned generation hosted by node1's dead store.
HEARTBEAT_TIMEOUT = ["--heartbeat-timeout", "15"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", ["gloo", "nccl-twin"])
def test_a_replacement_abandons_a_generation_whose_store_host_died(coordinators, agents, backend):
    (leader,) = coordinators(1, extra=HEARTBEAT_TIMEOUT)
    # Every rank that held the state is lost here: the job allows beginning again, so that the
    # replacement trains on alone (by default the run would end failed, saying so: test_state_lost_restart)
    a, b = agents([leader.address], "deadstore", ["node0", "node1"], slots=1, steps=10**6,
                  env={"MUSTER_BACKEND": backend}, extra=["--on-state-lost", "restart"])
    wait_until(lambda: all(n.steps(0) and n.steps(0)[-1]["world_size"] == 2 and n.steps(0)[-1]["step"] >= 10
                           for n in (a, b)), 90, "both ranks past step 10")
    started = len(a.rank_pids(0))
    os.kill(a.rank_pids(0)[-1], signal.SIGKILL)
    wait_until(lambda: len(a.rank_pids(0)) > started, 20, "node0 starts a replacement")
    b.signal(signal.SIGKILL)  # its ranks and its store go with it; the leader notices only its silence

    def placed():  # the generation that takes the replacement back, with node1 (its store) still in the map:
        # a planned switch, or an abort one when node1 was still re-forming after the kill (reforming)
        return [r for r in a.rank_records(0, "assignment_received") if r["role"] == "ROLE_ACTIVE"]

    wait_until(placed, 40, "the replacement handed a place")
    generation = placed()[0]["generation"]
    # node1 is found failed (its rank stalled, or the node silent): an abort generation of node0 alone.
    # The leader may hold the replacement back until node1's re-form is decided: then its first
    # place is that generation already.
    alone_first = [r for r in leader.find("membership_changed", kind="generation")
                   if r["generation"] == generation and r["nodes"] == ["node0"]]
    abort = alone_first or wait_until(lambda: [r for r in leader.find("membership_changed", kind="generation")
                                               if r["generation"] > generation], 40, "the abort generation")
    assert abort[0]["reason"].startswith("abort") and abort[0]["nodes"] == ["node0"], abort

    def alone():
        return [r for r in a.steps(0) if r["world_size"] == 1 and r["generation"] >= abort[0]["generation"]]

    try:
        wait_until(alone, 20, "the replacement training alone in the abort generation")
    except AssertionError:
        raise AssertionError("the replacement never formed the abort generation; its log:\n"
                             + a.rank_logs(0)[-1].read_text()[-3000:]) from None
    formed = [r for r in a.rank_records(0, "group_formed") if r["generation"] == abort[0]["generation"]]
    assert formed and formed[0]["backend"] == backend, "no group_formed record for the abort generation"
    took = record_time(formed[0]) - record_time(abort[0])
    assert took < 5.0, f"the abort generation formed {took:.1f}s after it was published"
    assert a.proc.poll() is None, "node0's agent exited"
