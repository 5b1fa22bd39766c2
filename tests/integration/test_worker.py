"""The worker library with real gloo process groups, a real coordinator and a real etcd: ranks
are killed, hung and added, and the survivors keep training in-process. The kill and hang cases
run again on the NCCL-shaped twin (`nccl-twin`: NCCL's abort, error classification and destroy
rules over gloo), the paths an NCCL rank takes."""

import signal
from collections import defaultdict

import pytest

from muster.local import progress_gap, wait_until

STEPS = 70
PRODUCTION_TIMEOUT = ["--heartbeat-timeout", "2.0"]  # the default: fewer false evictions on a loaded box


def step_records(ranks):
    return {p.pid: p.steps() for p in ranks}


def assert_contiguous_and_identical(survivors, after_generation):
    """Steps go up by one (a reform may bring a rank forward to the step a peer completed, never
    back: nothing completed is lost or redone), and every rank of a generation holds the same
    parameters at every step."""
    by_step = defaultdict(set)
    for p in survivors:
        gap = progress_gap(p.records())
        assert not gap, f"pid {p.pid}: {gap}"
        for r in p.steps():
            if r["generation"] > after_generation:
                by_step[r["step"]].add(r["digest"])
    assert by_step, "no step completed in the new generation"
    diverged = {step: d for step, d in by_step.items() if len(d) != 1}
    assert not diverged, f"replicas differ at steps {sorted(diverged)[:5]}"


def rank_of(p):
    return p.steps()[-1]["rank"]


def running(ranks, at_least=8):
    wait_until(lambda: all(p.last_step >= at_least for p in ranks), 60, f"all ranks past step {at_least}")


def assert_reformed_on(backend, ranks, after_generation):
    """Every reform after `after_generation` went through `backend`, and the logs stay readable: no
    c10d "waitForInput ... timed out" warning from the arrival barrier."""
    formed = [r for p in ranks for r in p.records("group_formed") if r["generation"] > after_generation]
    assert formed and {r["backend"] for r in formed} == {backend}
    assert all("before_form_s" in r for r in formed), "a late rank's own record says where its time went"
    assert not [p for p in ranks if "waitForInput" in p.log_path.read_text()]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("victim_rank,backend", [(2, "gloo"), (0, "gloo"), (0, "nccl-twin")],
                         ids=["rank2", "rank0_store_moves", "rank0_store_moves_nccl_twin"])
def test_survivors_of_a_killed_rank_continue_in_process(coordinators, training, victim_rank, backend):
    (leader,) = coordinators(1, extra=PRODUCTION_TIMEOUT)
    ranks = training([leader.address], "kill", 4, steps=STEPS, min_nodes=3, max_nodes=4,
                     env={"MUSTER_BACKEND": backend})
    running(ranks)
    victim = next(p for p in ranks if rank_of(p) == victim_rank)
    survivors = [p for p in ranks if p is not victim]
    generation = victim.steps()[-1]["generation"]
    store_before = {r["store"] for p in ranks for r in p.records("group_formed") if r["generation"] == generation}
    victim.signal(signal.SIGKILL)
    for p in survivors:
        assert p.wait(90) == 0, p.log_path.read_text()[-2000:]  # same process, trained to the end
        assert p.last_step == STEPS
    assert_contiguous_and_identical(survivors, generation)
    new_worlds = {r["world_size"] for p in survivors for r in p.steps() if r["generation"] > generation}
    assert 3 in new_worlds
    reformed = [r for p in survivors for r in p.records("group_formed") if r["generation"] > generation]
    assert {r["world_size"] for r in reformed} >= {3}
    if victim_rank == 0:
        store_after = {r["store"] for r in reformed}
        assert store_after and store_after.isdisjoint(store_before), "the store moved with rank 0"
    kinds = [r["kind"] for r in leader.find("membership_changed")]
    assert "process_exited" in kinds
    assert_reformed_on(backend, survivors, generation)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["gloo", "nccl-twin"])
def test_a_hung_rank_is_evicted_and_once_resumed_is_fenced_out(coordinators, training, backend):
    (leader,) = coordinators(1, extra=PRODUCTION_TIMEOUT)
    ranks = training([leader.address], "hang", 4, steps=STEPS, min_nodes=3, max_nodes=4,
                     env={"MUSTER_BACKEND": backend})
    running(ranks)
    victim = next(p for p in ranks if rank_of(p) == 1)
    survivors = [p for p in ranks if p is not victim]
    generation = victim.steps()[-1]["generation"]
    victim.signal(signal.SIGSTOP)
    wait_until(lambda: all(p.steps()[-1]["generation"] > generation for p in survivors), 30, "survivors reform")
    steps_when_resumed = {p.pid: p.last_step for p in survivors}
    victim.signal(signal.SIGCONT)
    assert victim.wait(30) == 3  # FencedOut: it stops instead of training on stale state
    assert "fenced out" in victim.records("training_stopped")[0]["error"]
    for p in survivors:
        assert p.wait(90) == 0
        assert p.last_step == STEPS > steps_when_resumed[p.pid]
    assert_contiguous_and_identical(survivors, generation)
    # The first eviction after the stop is the victim's (before it, a host at half speed once saw another
    # rank join a new leader late and rejoin: fresh-clone run Z)
    evicted = [r for r in leader.find("membership_changed")
               if r["kind"] in ("node_silent", "rank_stalled") and r["generation"] > generation]
    assert evicted and evicted[0]["nodes"] == [victim.records("node_joined")[0]["node"]]
    assert_reformed_on(backend, survivors, generation)


@pytest.mark.timeout(120)
def test_a_new_rank_joins_at_a_step_boundary_with_identical_state(coordinators, training):
    (leader,) = coordinators(1, extra=PRODUCTION_TIMEOUT)
    # --grow-to: the first ranks train until the joiner is in, however long its start takes (a loaded
    # machine took over 13 s, once longer than a fixed number of steps lasted), then STEPS more
    grow = {"steps": STEPS, "min_nodes": 3, "max_nodes": 4, "args": ("--grow-to", "4")}
    first = training([leader.address], "grow", 3, **grow)
    running(first)
    generation = first[0].steps()[-1]["generation"]
    (joiner,) = training([leader.address], "grow", 1, **grow)
    everyone = first + [joiner]
    for p in everyone:
        assert p.wait(90) == 0, p.log_path.read_text()[-2000:]
    assert all(not p.records("step_discarded") for p in first), "a planned join aborts nothing"
    joined_at = joiner.steps()[0]["step"]
    assert joined_at > 1 and joiner.steps()[0]["world_size"] == 4
    assert_contiguous_and_identical(everyone, generation)
    assert {p.last_step for p in everyone} == {joined_at - 1 + STEPS}  # STEPS after the step it joined at


@pytest.mark.timeout(120)
def test_the_leader_flags_a_rank_whose_parameters_diverge(coordinators, training):
    (leader,) = coordinators(1, extra=PRODUCTION_TIMEOUT)
    digests = {"MUSTER_DIGEST_EVERY": "5"}
    honest = training([leader.address], "diverge", 2, steps=40, min_nodes=3, max_nodes=3, env=digests)
    (odd,) = training([leader.address], "diverge", 1, steps=40, min_nodes=3, max_nodes=3, env=digests,
                      args=("--perturb-at-step", "12"))
    for p in honest + [odd]:
        assert p.wait(90) == 0
    flagged = wait_until(lambda: leader.find("membership_changed", kind="replicas_diverged"), 10, "divergence event")
    assert flagged[0]["nodes"] == [odd.records("node_joined")[0]["node"]]
    assert "step 15" in flagged[0]["reason"] and "differ from the majority (2 of 3)" in flagged[0]["reason"]


@pytest.mark.timeout(120)
def test_training_does_not_notice_a_leader_failover(coordinators, training):
    replicas = coordinators(2, extra=PRODUCTION_TIMEOUT)
    ranks = training([r.address for r in replicas], "failover", 3, steps=STEPS, min_nodes=3, max_nodes=3)
    running(ranks)
    leader = next(r for r in replicas if r.find("leadership_acquired", job="failover"))
    standby = next(r for r in replicas if r is not leader)
    leader.kill()
    wait_until(lambda: standby.find("leadership_acquired", job="failover"), 10, "the standby leads")
    for p in ranks:
        assert p.wait(90) == 0, p.log_path.read_text()[-2000:]
        assert p.last_step == STEPS
        assert not p.records("step_discarded")
        assert {r["generation"] for r in p.steps()} == {1}
    assert_contiguous_and_identical(ranks, 0)
    evictions = {"node_silent", "process_exited", "rank_exited", "rank_silent", "rank_stalled"}
    assert not [r for r in standby.find("membership_changed") if r["kind"] in evictions]
