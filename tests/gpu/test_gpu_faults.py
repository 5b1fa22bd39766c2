"""The faults of tests/integration/test_worker.py on the GPU path: library ranks of train_ddp.py on
NCCL, 4 and 8 of them sharing the visible GPUs (each process its own NCCL_HOSTID), against a real
etcd and coordinator. Skipped without CUDA; MUSTER_GPU_TEST_BACKEND=gloo (or nccl-twin) runs the
same tests on CPU. `make gpu-check` runs them, then the recovery benchmark."""

import os
import signal
import time
from collections import defaultdict

import pytest
import torch

from muster.client import Coordinators
from muster.coordinator.core.kinds import EVICTIONS
from muster.local import rank_env, record_time, wait_until
from muster.v1 import muster_pb2 as pb

BACKEND = os.environ.get("MUSTER_GPU_TEST_BACKEND", "nccl")
HEARTBEAT_TIMEOUT = ["--heartbeat-timeout", "2.0"]  # the default: fewer false evictions on a loaded box

pytestmark = [
    pytest.mark.skipif(BACKEND == "nccl" and not torch.cuda.is_available(),
                       reason="needs CUDA (MUSTER_GPU_TEST_BACKEND=gloo or nccl-twin runs these on CPU)"),
    pytest.mark.timeout(300),
    pytest.mark.parametrize("n", [4, 8], ids=["ranks4", "ranks8"]),
]


class Job:
    """One coordinator and library ranks of one job, each rank its own node; every rank is ended by
    PID afterwards (the `training` fixture)."""

    def __init__(self, coordinators, training, name: str, n: int):
        (self.leader,) = coordinators(1, extra=HEARTBEAT_TIMEOUT)
        self.training, self.name, self.n = training, name, n
        self.ranks = []

    def add(self, count: int = 1) -> list:
        new = [self.training([self.leader.address], self.name, 1, steps=10**9, min_nodes=self.n - 1,
                             max_nodes=self.n, env=rank_env(BACKEND))[0] for _ in range(count)]
        self.ranks += new
        return new

    def together(self, ranks, world_size: int, after_generation: int = 0, timeout_s: float = 180) -> int:
        """Wait until every one of `ranks` has stepped (twice) in one generation newer than
        `after_generation` with `world_size` ranks; that generation."""
        def newest(p):
            steps = [r for r in p.steps() if r["generation"] > after_generation and r["world_size"] == world_size]
            return steps[-1]["generation"] if len(steps) >= 2 else None

        def same():
            generations = {newest(p) for p in ranks}
            return generations.pop() if len(generations) == 1 and None not in generations else None

        for p in ranks:
            assert p.proc.poll() is None, f"rank pid {p.pid} exited:\n{p.log_path.read_text()[-3000:]}"
        return wait_until(same, timeout_s, f"{len(ranks)} ranks stepping together in a group of {world_size} "
                                           f"newer than generation {after_generation}", interval_s=0.1)

    def holder_of_rank(self, rank: int, generation: int):
        """The process that is global rank `rank` of `generation` (rank 0 hosts its store)."""
        return next(p for p in self.ranks for r in p.records("group_formed")
                    if r["generation"] == generation and r["rank"] == rank)

    def evictions(self, since: float) -> list[dict]:
        return [r for r in self.leader.find("membership_changed") if r["kind"] in EVICTIONS
                and record_time(r) >= since]


def node_of(p) -> str:
    return p.records("node_joined")[0]["node"]


def assert_identical(ranks, generation: int) -> None:
    """Every rank of `generation` holds the same parameters at every step it completed there."""
    by_step = defaultdict(set)
    for p in ranks:
        for r in p.steps():
            if r["generation"] == generation:
                by_step[r["step"]].add(r["digest"])
    diverged = sorted(s for s, d in by_step.items() if len(d) != 1)
    assert by_step and not diverged, f"replicas of generation {generation} differ at steps {diverged[:5]}"


def assert_survived(job: Job, victim, survivors, generation: int, at: float) -> None:
    """The survivors step in a new group without the victim, none lost, no one else evicted."""
    after = job.together(survivors, job.n - 1, generation, timeout_s=60)
    assert_identical(survivors, after)
    evicted = {n for r in job.evictions(at) for n in r["nodes"]}
    assert evicted == {node_of(victim)}, f"evicted {evicted}, expected only the victim {node_of(victim)}"


@pytest.fixture
def job(coordinators, training, n):
    return Job(coordinators, training, "gpu", n)


def test_killed_rank(job):
    job.add(job.n)
    generation = job.together(job.ranks, job.n)
    victim = job.holder_of_rank(job.n - 1, generation)
    at = time.time()
    victim.signal(signal.SIGKILL)
    assert_survived(job, victim, [p for p in job.ranks if p is not victim], generation, at)


def test_killed_store_host(job):
    job.add(job.n)
    generation = job.together(job.ranks, job.n)
    victim = job.holder_of_rank(0, generation)
    store = {r["store"] for p in job.ranks for r in p.records("group_formed") if r["generation"] == generation}
    at = time.time()
    victim.signal(signal.SIGKILL)
    survivors = [p for p in job.ranks if p is not victim]
    assert_survived(job, victim, survivors, generation, at)
    moved = {r["store"] for p in survivors for r in p.records("group_formed") if r["generation"] > generation}
    assert moved and moved.isdisjoint(store), f"the store did not move off the dead host: {store} -> {moved}"


def test_hung_rank(job):
    job.add(job.n)
    generation = job.together(job.ranks, job.n)
    victim = job.holder_of_rank(1, generation)
    at = time.time()
    victim.signal(signal.SIGSTOP)
    try:
        assert_survived(job, victim, [p for p in job.ranks if p is not victim], generation, at)
        assert {r["kind"] for r in job.evictions(at)} & {"node_silent", "rank_stalled"}
    finally:
        victim.signal(signal.SIGCONT)  # it wakes fenced out and stops (3) rather than train on stale state
    assert victim.wait(30) == 3, victim.log_path.read_text()[-3000:]


def test_joining_rank(job):
    first = job.add(job.n - 1)
    generation = job.together(first, job.n - 1)
    job.add()  # a rank joins the running job
    grown = job.together(job.ranks, job.n, generation)
    assert_identical(job.ranks, grown)
    assert not any(p.records("step_discarded") for p in first), "a planned join aborts nothing"


def test_planned_leave(job):
    job.add(job.n)
    generation = job.together(job.ranks, job.n)
    leaver = job.holder_of_rank(job.n - 1, generation)
    at = time.time()
    with Coordinators([job.leader.address], timeout_s=10) as c:  # `muster drain`
        c.call("Drain", pb.DrainRequest(job=job.name, node=node_of(leaver), reason="gpu-check"))
    assert leaver.wait(60) == 0, leaver.log_path.read_text()[-3000:]
    assert leaver.records("training_drained")
    stayers = [p for p in job.ranks if p is not leaver]
    job.together(stayers, job.n - 1, generation, timeout_s=60)
    for p in stayers:
        aborted = [r for r in p.records() if r.get("event") in ("step_discarded", "group_aborted")
                   and record_time(r) >= at]
        assert not aborted, f"pid {p.pid}: a planned leave aborted {aborted[:2]}"
    assert not job.evictions(at)
