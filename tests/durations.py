"""What the suite spends its time on: the JUnit XML `make test` writes (build/tests.xml) summed up
as JSON on stdout: the run (tests by outcome, its wall time, the machine's CPUs and load average at
its start), the seconds each tier's tests took together, and the slowest tests with their seconds
(setup and teardown included), and where conftest.py measured them the CPU seconds of each test's
processes beside them: wall far above CPU is a test that waits, CPU near twice its wall one that
keeps both cores busy. `make durations` writes it to tests/durations.json, from which
docs/generate.py builds the design page's table of the ten slowest, and from which conftest.py
takes the order of the next run (`files_s`, each file's seconds: the longest first).

Usage: python tests/durations.py [build/tests.xml] [--top N] [--note TEXT] > tests/durations.json
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def case_id(case: ET.Element) -> str:
    """`tests/tier/test_x.py::test_name[param]`, from the case's dotted classname and its name."""
    *module, last = case.get("classname", "").split(".")
    path = "/".join(module) if last[:1].isupper() else "/".join([*module, last])  # a test class: its own part
    return f"{path}.py::" + (f"{last}::" if last[:1].isupper() else "") + case.get("name", "")


def outcome(case: ET.Element) -> str:
    for child, name in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
        if case.find(child) is not None:
            return name
    return "passed"


def cpu_seconds(case: ET.Element, name: str = "cpu_s") -> float | None:
    """The CPU seconds conftest.py recorded for the case (a property: `cpu_s` of all its processes,
    `own_cpu_s` of the test process alone), or None (a run without it)."""
    value = next((p.get("value") for p in case.iterfind("properties/property") if p.get("name") == name), None)
    return None if value is None else float(value)


def summary(xml: Path, top: int, note: str = "") -> dict:
    root = ET.parse(xml).getroot()
    suite = root.find("testsuite") if root.tag == "testsuites" else root if root.tag == "testsuite" else None
    if suite is None:
        raise ValueError(f"{xml}: no <testsuite> (not a pytest --junitxml file?)")
    properties = {p.get("name"): p.get("value") for p in suite.iterfind("properties/property")}
    named = [c for c in suite.iter("testcase") if c.get("name")]  # (a run interrupted by ^C ends with nameless cases)
    cases = [(case_id(c), float(c.get("time", 0)), outcome(c), cpu_seconds(c)) for c in named]
    outcomes, tiers, tiers_cpu, files = defaultdict(int), defaultdict(float), defaultdict(float), defaultdict(float)
    for name, seconds, result, cpu in cases:
        outcomes[result] += 1
        tier = name.split("/")[1] if name.startswith("tests/") else "other"
        tiers[tier] += seconds
        tiers_cpu[tier] += cpu or 0.0
        files[name.split("::")[0]] += seconds
    slowest = sorted((c for c in cases if c[2] != "skipped"), key=lambda c: -c[1])[:top]
    measured = any(c[3] is not None for c in cases)
    harness = [cpu_seconds(c, "own_cpu_s") for c in named]
    return {
        "wall_s": round(float(suite.get("time", 0)), 3),
        "timestamp": suite.get("timestamp"),
        "machine": {k: properties[k] for k in ("cpus", "loadavg_at_start", "workers", "args") if k in properties},
        "tests": dict(sorted(outcomes.items())),
        "test_seconds": round(sum(c[1] for c in cases), 1),  # over every worker: wall_s x workers at best
        "tiers_s": {tier: round(s, 1) for tier, s in sorted(tiers.items(), key=lambda t: -t[1])},
        **({"cpu_seconds": round(sum(c[3] or 0.0 for c in cases), 1),
            "tiers_cpu_s": {tier: round(tiers_cpu[tier], 1) for tier in sorted(tiers, key=lambda t: -tiers[t])}}
           if measured else {}),
        # the test processes' own share (their waits' polls, their log reads): the rest is what they started
        **({"harness_cpu_seconds": round(sum(h or 0.0 for h in harness), 1)} if any(h is not None for h in harness)
           else {}),
        "slowest": [{"test": name, "s": round(seconds, 1), "outcome": result,
                     **({"cpu_s": round(cpu, 1)} if cpu is not None else {})}
                    for name, seconds, result, cpu in slowest],
        "files_s": {path: round(seconds, 1) for path, seconds in sorted(files.items(), key=lambda f: -f[1])},
        **({"note": note} if note else {}),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("xml", nargs="?", default=str(ROOT / "build" / "tests.xml"), help="pytest's --junitxml file")
    p.add_argument("--top", type=int, default=20, help="how many of the slowest tests to keep (default 20)")
    p.add_argument("--note", default="", help="what the XML cannot say about its run (shown under the table)")
    args = p.parse_args(argv)
    xml = Path(args.xml)
    if not xml.is_file():
        print(f"durations: {xml} does not exist: run `make test` first (it writes build/tests.xml)", file=sys.stderr)
        return 2
    try:
        print(json.dumps(summary(xml, args.top, args.note), indent=2))
    except (ET.ParseError, ValueError) as exc:
        print(f"durations: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
