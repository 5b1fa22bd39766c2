"""Chaos fixtures: one cluster shared by the fault sequence of a module, and the soak option."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # the harness sits beside the tests

from harness import Chaos, started  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--soak", type=float, default=0.0, metavar="MINUTES",
                     help="run the chaos soak (a random fault every 15 s) for MINUTES; off in CI")
    parser.addoption("--slow", action="store_true",
                     help="also run the tests marked slow (the 2-minute outages); off in CI")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: minutes long; run with --slow (and by the soak's runs), not in CI")


def pytest_collection_modifyitems(config, items):
    minutes = config.getoption("--soak")
    slow = config.getoption("--slow")
    for item in items:
        if item.get_closest_marker("slow") and not slow:
            item.add_marker(pytest.mark.skip(reason="slow: pytest tests/chaos --slow"))
        if item.path.name == "test_soak.py":
            if minutes:
                item.add_marker(pytest.mark.timeout(minutes * 60 + 300))
            else:
                item.add_marker(pytest.mark.skip(reason="soak mode: pytest tests/chaos --soak MINUTES -s"))


@pytest.fixture(scope="module")
def chaos(tmp_path_factory, request):
    """A cluster of a 3-member etcd, 2 coordinators, 3 agents x 2 ranks."""
    yield from started(Chaos(tmp_path_factory.mktemp("chaos")), request)
