"""Security review 5, H1, as a test (the scenario is bench/store_planting.py's, which the abuse
suite reports): an attacker with only a TCPStore client lists the generation's prefix and plants
every state key it sees (a pickle that would run a command, forged cards that would choose the
source and the plan) during a real gloo state transfer. No payload runs, no plan changes: each rank
either ends with the source's state or fails the generation with a named error (or, its peer having
refused, finds the connection closed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import store_planting  # noqa: E402

pytestmark = pytest.mark.timeout(180)
NAMED = ("StoreTampered", "SkeletonRefused", "StateMismatch")


def refused(r: dict) -> bool:
    """A rank that failed the generation with a named error (or found a peer's state never published)."""
    return r["outcome"] == "failed" and (r["error"] in NAMED or "did not publish" in r["message"])


def closed_by(r: dict) -> bool:
    return r["outcome"] == "failed" and r["error"] == "RuntimeError" and "Connection closed by peer" in r["message"]


def test_a_list_keys_attacker_runs_no_code_and_changes_no_plan(tmp_path):
    tampered = 0
    for n in range(3):
        t = store_planting.trial(str(tmp_path), n)
        assert not t["payload_ran"], "the planted pickle ran"
        assert any("/state/" in k for k in t["planted"]), t  # it found the prefix and planted
        source_before = t["ranks"][0]["before"]
        for rank, r in t["ranks"].items():
            assert r["outcome"] in ("ok", "failed"), r
            if r["outcome"] == "ok":
                assert r["role"] == ("source" if rank == 0 else "receiver")  # the forged cards chose nothing
                assert r["after"] == source_before  # the source's state as it was, whatever was planted
            elif not refused(r):
                # A rank that refused by name leaves the group, and its peer, mid-transfer, sees the
                # connection closed (in a job: a transport failure, the step discarded, a reform)
                assert closed_by(r) and any(refused(o) for k, o in t["ranks"].items() if k != rank), t["ranks"]
            tampered += r["outcome"] == "failed" and r["error"] == "StoreTampered"
    assert tampered, "no rank ever read a planted value: the attack never reached a reader"
