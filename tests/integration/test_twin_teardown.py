"""The aborted group's teardown runs beside the next generation, on real groups (gloo, and the
NCCL-shaped twin whose abort leaves its groups to the background teardown as NCCL's does): a
collective blocked on a live peer is released by the abort, the next generation forms and runs a
collective while the old group's abort is still held, and a hundred reforms leave the process with
no more threads and descriptors than ten did. No timings: every wait is bounded, none measured."""

import gc
import os
import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed as dist

from muster.worker.library.backends import NcclTwin
from muster.worker.library.comm import Comm, GroupSpec

WAIT_S = 30.0  # a bound on every wait below, never a measurement
KEY = b"k" * 32  # the generation's store key, as an assignment carries it
PEER = """
import sys
from muster.worker.library.comm import Comm, GroupSpec
comm = Comm("nccl-twin", host_store=False, timeout_s=30)
comm.form(GroupSpec(1, 1, 2, 0, sys.argv[1], "g1", b"k" * 32), abandoned=lambda: False)
print("formed", flush=True)
sys.stdin.readline()  # never joins a collective: rank 0's waits on it until the abort
"""


class HeldTwin(NcclTwin):
    """The twin whose background abort, once done, is held until the test lets it end (NCCL's join)."""

    abort_join_s = 0.0

    def __init__(self):
        super().__init__()
        self.joining, self.gate = threading.Event(), threading.Event()
        self.aborted: list[int] = []  # the ids of the groups aborted, once each

    def _abort_groups(self, groups):
        self.aborted += [id(g) for g in groups]
        super()._abort_groups(groups)
        self.joining.set()
        assert self.gate.wait(WAIT_S)


def resources() -> tuple[int, int]:
    """This process's threads (native ones included) and file descriptors."""
    gc.collect()
    return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))


@pytest.mark.timeout(120)
def test_the_next_generation_forms_and_steps_while_the_old_groups_abort_is_held():
    backend = HeldTwin()
    comm = Comm(backend, timeout_s=30)
    address = f"127.0.0.1:{comm.store_port}"
    peer = subprocess.Popen([sys.executable, "-c", PEER, address], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    failed: list[BaseException] = []

    def collective():  # the training thread, in a collective its peer never joins
        try:
            dist.all_reduce(torch.ones(4))
        except Exception as exc:
            failed.append(exc)

    training = threading.Thread(target=collective)
    try:
        comm.form(GroupSpec(1, 0, 2, 0, address, "g1", KEY), abandoned=lambda: False)
        assert peer.stdout.readline().strip() == "formed"
        training.start()
        racing = [threading.Thread(target=comm.abort, args=(2,)) for _ in range(3)]  # the abort thread, a hold...
        for t in racing:
            t.start()
        for t in racing:
            t.join(WAIT_S)
        assert not comm.abort(2)  # done already: nothing more to abort
        training.join(WAIT_S)
        assert not training.is_alive() and failed and backend.is_transport_failure(failed[0]), failed
        assert backend.joining.wait(WAIT_S) and not backend.gate.is_set()
        comm.destroy()  # the training thread lets go: the teardown may shut the old group down once aborted
        comm.form(GroupSpec(2, 0, 1, 0, address, "g2"), abandoned=lambda: False)
        t = torch.ones(4)
        dist.all_reduce(t)
        assert t.tolist() == [1.0] * 4
        assert not backend.teardown.idle(0)  # generation 1's abort is still held
        backend.gate.set()
        assert backend.teardown.idle(WAIT_S)
        assert len(backend.aborted) == len(set(backend.aborted)) == 1  # generation 1's group, aborted once
    finally:
        backend.gate.set()
        training.join(WAIT_S)
        peer.kill()
        peer.wait(WAIT_S)
        peer.stdout.close()
        peer.stdin.close()
        comm.destroy()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["gloo", "nccl-twin"])
def test_a_hundred_reforms_leave_threads_and_descriptors_flat(backend):
    comm = Comm(backend, timeout_s=30)
    teardown = getattr(comm.backend, "teardown", None)
    if teardown is not None:
        comm.backend.abort_join_s = 0.0  # (NCCL's join, 0.5 s a reform in the background, is not what is counted)
    address = f"127.0.0.1:{comm.store_port}"
    counts = {}
    for generation in range(1, 101):
        comm.form(GroupSpec(generation, 0, 1, 0, address, f"g{generation}"), abandoned=lambda: False)
        t = torch.ones(4)
        dist.all_reduce(t)
        assert comm.abort(generation + 1)
        comm.destroy()
        if generation in (10, 100):
            assert teardown is None or teardown.idle(WAIT_S)
            counts[generation] = resources()
    # (no more: fewer when what earlier tests in this process left behind has ended meanwhile)
    assert counts[100][0] <= counts[10][0] and counts[100][1] <= counts[10][1], counts
