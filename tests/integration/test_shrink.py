"""A loss-only generation shrinks the old group instead of forming a new one (MUSTER_NCCL_SHRINK=1;
NCCL's comm shrink on a GPU, its twin here): every survivor shrinks, or none does."""

import signal

import pytest

from muster.local import wait_until

from test_worker import PRODUCTION_TIMEOUT, STEPS, assert_contiguous_and_identical, rank_of, running

TWIN = {"MUSTER_BACKEND": "nccl-twin"}
SHRINK = {**TWIN, "MUSTER_NCCL_SHRINK": "1"}


def reformed(survivors, generation):
    return [r for p in survivors for r in p.records("group_formed") if r["generation"] > generation]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("victim_rank", [2, 0], ids=["rank2", "rank0_store_moves"])
def test_survivors_of_a_lost_rank_shrink_their_group_and_train_on(coordinators, training, victim_rank):
    (leader,) = coordinators(1, extra=PRODUCTION_TIMEOUT)
    ranks = training([leader.address], "shrink", 4, steps=STEPS, min_nodes=3, max_nodes=4, env=SHRINK)
    running(ranks)
    victim = next(p for p in ranks if rank_of(p) == victim_rank)
    survivors = [p for p in ranks if p is not victim]
    generation = victim.steps()[-1]["generation"]
    victim.signal(signal.SIGKILL)
    for p in survivors:
        assert p.wait(90) == 0, p.log_path.read_text()[-2000:]
        assert p.last_step == STEPS
    assert_contiguous_and_identical(survivors, generation)
    first = [r for r in reformed(survivors, generation) if r["generation"] == generation + 1]
    assert len(first) == 3 and all(r["shrunk"] and r["world_size"] == 3 for r in first), first
    shrunk = [r for p in survivors for r in p.records("group_shrunk")]
    assert {tuple(r["excluded"]) for r in shrunk} == {(victim_rank,)} and len(shrunk) == 3


@pytest.mark.timeout(120)
def test_one_survivor_that_cannot_shrink_makes_every_survivor_form_anew(coordinators, training):
    (leader,) = coordinators(1, extra=PRODUCTION_TIMEOUT)
    ranks = training([leader.address], "noshrink", 3, steps=STEPS, min_nodes=3, max_nodes=4, env=SHRINK)
    ranks += training([leader.address], "noshrink", 1, steps=STEPS, min_nodes=3, max_nodes=4, env=TWIN)
    running(ranks)
    victim = next(p for p in ranks[:3] if rank_of(p) != 0)
    survivors = [p for p in ranks if p is not victim]
    generation = victim.steps()[-1]["generation"]
    victim.signal(signal.SIGKILL)
    wait_until(lambda: all(p.steps()[-1]["generation"] > generation for p in survivors), 60, "survivors step again")
    for p in survivors:
        assert p.wait(90) == 0, p.log_path.read_text()[-2000:]
    assert_contiguous_and_identical(survivors, generation)
    first = [r for r in reformed(survivors, generation) if r["generation"] == generation + 1]
    assert len(first) == 3 and not any(r["shrunk"] for r in first), first
    assert not [r for p in survivors for r in p.records("group_shrunk")]
