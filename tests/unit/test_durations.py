"""The suite's durations are kept and read back: a pytest run with --junitxml (as `make test`
writes build/tests.xml) carries the machine beside each test's seconds, tests/durations.py sums it
up, and the collection starts with the files that took longest in the run tests/durations.json sums up."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FAST = "tests/unit/test_net.py"  # a few fast tests of its own


def load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pytest_run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.timeout(150)
def test_a_junit_run_is_summed_up_with_its_machine_and_each_tests_seconds(tmp_path):
    xml = tmp_path / "tests.xml"
    done = pytest_run("-q", FAST, f"--junitxml={xml}")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    collected = pytest_run("--collect-only", "-q", FAST).stdout.split()
    ids = {line for line in collected if "::" in line}

    summary = load("durations", ROOT / "tests" / "durations.py").summary(xml, top=3)
    assert summary["tests"] == {"passed": len(ids)} and summary["tiers_s"].keys() == {"unit"}
    assert summary["machine"]["cpus"] == str(os.cpu_count()) and summary["machine"]["workers"] == "1"
    assert len(summary["machine"]["loadavg_at_start"].split()) == 3 and FAST in summary["machine"]["args"]
    slowest = summary["slowest"]
    assert len(slowest) == min(3, len(ids)) and {t["test"] for t in slowest} <= ids  # pytest's own node ids
    assert [t["s"] for t in slowest] == sorted((t["s"] for t in slowest), reverse=True)
    assert summary["test_seconds"] >= sum(t["s"] for t in slowest) - 0.1 and summary["wall_s"] > 0


BURN_AND_WAIT = """
import subprocess, sys, time

def test_burns():  # CPU in a child process, as a test's ranks spend it
    subprocess.run([sys.executable, "-c", "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.6: pass"],
                   check=True, timeout=60)

def test_waits():
    time.sleep(0.6)
"""


@pytest.mark.timeout(150)
def test_each_tests_cpu_seconds_are_kept_beside_its_wall_seconds(tmp_path):
    """conftest.py's CPU seconds (the test's own and its reaped processes') tell a test that computes
    from one that waits: the summary carries them per test and per tier."""
    (tmp_path / "test_burn_and_wait.py").write_text(BURN_AND_WAIT)
    xml = tmp_path / "tests.xml"
    done = pytest_run("-q", "-p", "tests.conftest", "--rootdir", str(tmp_path), str(tmp_path), f"--junitxml={xml}")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    summary = load("durations", ROOT / "tests" / "durations.py").summary(xml, top=2)
    by_name = {t["test"].split("::")[1]: t for t in summary["slowest"]}
    assert by_name["test_burns"]["cpu_s"] >= 0.5, by_name
    assert by_name["test_waits"]["s"] >= 0.6 and by_name["test_waits"]["cpu_s"] < 0.3, by_name
    assert summary["cpu_seconds"] >= by_name["test_burns"]["cpu_s"] and len(summary["tiers_cpu_s"]) == 1


def junit(cases: list[tuple[str, str, float, float | None, str]]) -> str:
    """A JUnit XML of (module, name, seconds, cpu_s, outcome) cases, as pytest with conftest.py writes it."""
    rows = []
    for module, name, seconds, cpu, result in cases:
        props = f'<properties><property name="cpu_s" value="{cpu}"/></properties>' if cpu is not None else ""
        skipped = "<skipped/>" if result == "skipped" else ""
        rows.append(f'<testcase classname="tests.unit.{module}" name="{name}" time="{seconds}">{props}{skipped}</testcase>')
    return f'<testsuites><testsuite name="pytest" time="9">{"".join(rows)}</testsuite></testsuites>'


def test_each_files_seconds_are_summed_longest_first(tmp_path):
    xml = tmp_path / "tests.xml"
    xml.write_text(junit([
        ("test_short", "test_one", 1.0, 1.0, "passed"),
        ("test_long", "test_waits", 2.0, 0.1, "passed"),
        ("test_long", "test_skipped", 0.0, 0.0, "skipped"),
        ("test_long", "test_unmeasured", 1.5, None, "passed"),
        ("test_short", "test_two", 0.5, 0.5, "passed"),
    ]))
    summary = load("durations", ROOT / "tests" / "durations.py").summary(xml, top=2)
    assert list(summary["files_s"].items()) == [("tests/unit/test_long.py", 3.5), ("tests/unit/test_short.py", 1.5)]


def test_a_file_that_is_no_junit_xml_is_refused_in_a_line(tmp_path):
    bad = tmp_path / "tests.xml"
    bad.write_text("<html/>")
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "durations.py"), str(bad)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.startswith("durations: ") and "no <testsuite>" in done.stderr
    missing = subprocess.run([sys.executable, str(ROOT / "tests" / "durations.py"), str(tmp_path / "none.xml")],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "run `make test` first" in missing.stderr


@pytest.mark.timeout(150)
def test_the_files_that_took_longest_are_collected_first():
    files = json.loads((ROOT / "tests" / "durations.json").read_text())["files_s"]
    longest = max(files, key=files.get)
    assert files[FAST] < files[longest]
    collected = pytest_run("--collect-only", "-q", FAST, longest).stdout.split()
    ids = [line for line in collected if "::" in line]
    assert ids and ids[0].startswith(longest + "::") and ids[-1].startswith(FAST + "::"), ids
