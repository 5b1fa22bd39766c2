"""Shared pytest fixtures: a real etcd server per test and a client for it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import json
import os
import resource
import sys

import pytest
from hypothesis import settings

# CI runs the same examples every time; HYPOTHESIS_PROFILE=explore searches further (and anew).
settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", max_examples=3000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_sessionstart(session):
    """With --junitxml (`make test`'s build/tests.xml), the run's machine goes into the XML beside
    each test's seconds: tests/durations.py reads them. The controller writes the file (xdist's
    workers have no XML of their own)."""
    from _pytest.junitxml import xml_key  # the stash key record_testsuite_property uses (not xdist-safe)

    xml = session.config.stash.get(xml_key, None)
    if xml is None:
        return
    xml.add_global_property("cpus", os.cpu_count())
    xml.add_global_property("loadavg_at_start", " ".join(f"{x:.2f}" for x in os.getloadavg()))
    xml.add_global_property("workers", getattr(session.config.option, "numprocesses", None) or 1)
    xml.add_global_property("args", " ".join(session.config.invocation_params.args))


_CPU_AT_SETUP = pytest.StashKey[tuple[float, float]]()


def _own_cpu_s() -> float:
    """The test process's own CPU seconds (its waits' polls, its log reads)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    return own.ru_utime + own.ru_stime


def _cpu_s() -> float:
    """This process's CPU seconds and those of every descendant it (or its children, in turn) reaped:
    a test's agents, ranks, coordinators and etcd are reaped by its teardown; ranks forked from the
    worker's shared zygote (`training`) are reaped by the zygote, which reports their CPU, and those of
    `muster.testing.run_processes` by multiprocessing's forkserver, whose /proc stat counts them."""
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    local = sys.modules.get("muster.local")
    warm = local.WarmRanks.reaped_cpu_s() if local is not None else 0.0
    return _own_cpu_s() + reaped.ru_utime + reaped.ru_stime + warm + _forkserver_reaped_cpu_s()


def _forkserver_reaped_cpu_s() -> float:
    forkserver = sys.modules.get("multiprocessing.forkserver")
    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    if not pid:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:  # (it ended)
        return 0.0
    return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")  # cutime, cstime (stat's 16th, 17th)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    if item.path.parent.name in ("integration", "chaos") and "MUSTER_ZYGOTE_SOCKET" not in os.environ:
        _host_zygote()
    item.stash[_CPU_AT_SETUP] = _cpu_s(), _own_cpu_s()
    return (yield)


def _host_zygote() -> None:
    """Every agent the tests start (`muster run`, in whatever harness) forks its node's zygote from
    the worker's, as `muster run --zygote-socket` does from a host's: a node's start then costs no
    `import torch` (4 s of CPU on a slow host; the suite starts ~250 nodes). An `AgentProcess` is
    itself forked from it (the agent imports torch for its TCPStore: ~2 s of CPU a node, start and
    exit). An agent in a network namespace of its own (the chaos tier's partitions) still starts
    cold with its own zygote, and tests of the agent's own zygote unset MUSTER_ZYGOTE_SOCKET for
    their agents."""
    from muster.local import WarmRanks

    zygote = WarmRanks.shared()
    os.environ["MUSTER_ZYGOTE_SOCKET"] = zygote.socket_path
    if zygote.pid is not None:
        behind_the_control_plane(zygote.pid)


# What the zygote forks (agents and their ranks, `training`'s ranks) runs this much nicer than etcd,
# the coordinators and the test itself: at 10 a busy rank weighs a tenth of them in the scheduler (CFS
# weights 110 and 1024), at 5 a third, and three workers' ranks starved a coordinator past its etcd
# session (leaders lost and elected again mid-test).
BEHIND = 10


def behind_the_control_plane(pid: int) -> None:
    """On a real cluster etcd and the coordinators have hosts of their own; here the ranks, most of the
    suite's CPU, share two cores with them, and under load a coordinator starved for a second lost
    its 2 s etcd session, and with it its leadership (fresh-clone run E: two tests failed so). On Linux
    niceness is per thread, so each of `pid`'s threads is set; what it forks inherits it."""
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            os.setpriority(os.PRIO_PROCESS, int(task), BEHIND)
    except OSError:
        pass  # gone, or not ours to change: as before


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """Each test's CPU seconds (its processes', setup and teardown included) go into the JUnit XML
    beside its wall seconds, so tests/durations.py can tell a test that computes from one that waits
    (an xdist worker runs one test at a time; a module fixture's teardown counts to its last test)."""
    try:
        return (yield)
    finally:
        if _CPU_AT_SETUP in item.stash:
            every, own = item.stash[_CPU_AT_SETUP]
            item.user_properties.append(("cpu_s", f"{_cpu_s() - every:.2f}"))
            item.user_properties.append(("own_cpu_s", f"{_own_cpu_s() - own:.2f}"))


_DURATIONS = Path(__file__).with_name("durations.json")


def pytest_collection_modifyitems(config, items):
    """The files that took longest in the last summed-up run (tests/durations.json's `files_s`) first,
    each file's tests together and in their order (a module's fixtures stay shared), files it did not
    run last: xdist's worksteal hands each worker a share of the collection and moves tests from the
    ends of the queues, so the long files start first and the run ends on short tests, not with one
    worker running a long one while the others idle."""
    if not _DURATIONS.is_file():
        return
    seconds = json.loads(_DURATIONS.read_text()).get("files_s", {})
    root = config.rootpath
    items.sort(key=lambda item: -seconds.get(item.path.relative_to(root).as_posix(), 0.0))  # (a stable sort)

if TYPE_CHECKING:
    from muster.coordinator.etcd.server import EtcdServer


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator["EtcdServer"]:
    """A started single-member etcd in tmp_path, stopped (and reaped) afterwards, its data deleted:
    etcd preallocates 64 MB WAL files, 12 of a run's 13 GB kept under pytest's temporary folders. Its
    log stays beside the test's other logs."""
    # Imported here so unit tests never pay for (or depend on) etcd.
    from muster.coordinator.etcd.server import EtcdServer

    server = EtcdServer(tmp_path / "etcd")
    server.start()
    try:
        yield server
    finally:
        server.stop()
        if not server.running():
            server.wipe()


@pytest.fixture
def etcd_client(etcd):
    """A client for the `etcd` fixture's server, closed afterwards."""
    from muster.coordinator.etcd.client import connect

    client = connect([etcd.endpoint])
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def coordinators(etcd, tmp_path):
    """Start coordinator replicas against the `etcd` fixture; all are stopped afterwards."""
    from muster.local import CoordinatorProcess

    started = []

    def start(n: int = 1, extra: list[str] | None = None):
        new = [CoordinatorProcess([etcd.endpoint], tmp_path / f"coordinator-{len(started) + i}.log", extra).start()
               for i in range(n)]
        started.extend(new)
        return new

    yield start
    for c in started:
        c.stop()


@pytest.fixture
def training(tmp_path):
    """Start ranks of examples/train_ddp.py; all are killed (by PID) afterwards if still running.
    Forked from the worker's zygote (`warm=False`: started as `python SCRIPT`): the library behaves
    the same, and a rank's start costs no `import torch` (6 s of CPU where it takes 3.4)."""
    from muster.local import TrainingProcess

    started = []

    def start(coordinators, job: str, n: int = 1, warm: bool = True, **kwargs):
        new = [TrainingProcess(coordinators, job, tmp_path / f"rank-{len(started) + i}.log", warm=warm,
                               **kwargs).start()
               for i in range(n)]
        started.extend(new)
        return new

    yield start
    for p in started:
        p.stop()


@pytest.fixture
def agents(tmp_path):
    """Start node agents (`muster run`); all are killed afterwards, their ranks with them."""
    from muster.local import AgentProcess

    started = []

    def start(coordinators, job: str, node_ids, **kwargs):
        new = [AgentProcess(coordinators, job, node_id, tmp_path / "ranks", **kwargs).start() for node_id in node_ids]
        started.extend(new)
        return new

    yield start
    for a in started:
        a.stop()
