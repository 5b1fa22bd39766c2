"""Shared pytest fixtures: a real etcd server per test and a client for it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import os

import pytest
from hypothesis import settings

# CI runs the same examples every time; HYPOTHESIS_PROFILE=explore searches further (and anew).
settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", max_examples=3000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

if TYPE_CHECKING:
    from muster.coordinator.etcd.server import EtcdServer


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator["EtcdServer"]:
    """A started single-member etcd in tmp_path, stopped (and reaped) afterwards."""
    # Imported here so unit tests never pay for (or depend on) etcd.
    from muster.coordinator.etcd.server import EtcdServer

    server = EtcdServer(tmp_path / "etcd")
    server.start()
    try:
        yield server
    finally:
        server.stop()


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
    """Start ranks of examples/train_ddp.py; all are killed (by PID) afterwards if still running."""
    from muster.local import TrainingProcess

    started = []

    def start(coordinators, job: str, n: int = 1, **kwargs):
        new = [TrainingProcess(coordinators, job, tmp_path / f"rank-{len(started) + i}.log", **kwargs).start()
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
