"""Security review 5, H1, as a test (the scenario is bench/store_planting.py's, which the abuse
suite reports): an attacker with only a TCPStore client lists the generation's prefix and plants
every state key it sees (a pickle that would run a command, forged cards that would choose the
source and the plan) during a real gloo state transfer. No payload runs, no plan changes: each rank
either ends with the source's state or fails the generation with a named error."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import store_planting  # noqa: E402

pytestmark = pytest.mark.timeout(180)
NAMED = ("StoreTampered", "SkeletonRefused", "StateMismatch")


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
            else:
                assert r["error"] in NAMED or "did not publish" in r["message"], r
                tampered += r["error"] == "StoreTampered"
    assert tampered, "no rank ever read a planted value: the attack never reached a reader"
