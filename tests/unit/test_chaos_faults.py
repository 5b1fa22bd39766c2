"""The chaos faults are one list of records (tests/chaos/faults.py): every kind is injected by
methods the harness has, named once, and read by the sequences and the reliability page."""

import builtins
import sys
from pathlib import Path

CHAOS = Path(__file__).resolve().parents[1] / "chaos"
sys.path.insert(0, str(CHAOS))

import compound  # noqa: E402
import faults  # noqa: E402
from harness import Chaos  # noqa: E402


def test_every_kind_is_named_once_and_calls_what_the_harness_has():
    names = [k.name for k in faults.KINDS]
    assert len(names) == len(set(names)), f"a kind named twice: {names}"
    for kind in faults.KINDS:
        for call in (kind.inject, kind.repair):
            if call is not None:
                missing = [n for n in call.__code__.co_names  # (netns: the cluster's; victims: the fault's)
                           if not hasattr(Chaos, n) and not hasattr(builtins, n) and n not in ("netns", "victims")]
                assert not missing, f"{kind.name}: the harness has no {missing}"


def test_the_sequences_and_the_page_read_the_records():
    assert compound.TABLE == faults.named(faults.SINGLE) and "rank" in compound.TABLE
    assert compound.COMPOUND == faults.named(faults.COMPOUND) and "etcd_outage" in compound.COMPOUND
    page = (CHAOS.parents[1] / "docs" / "reliability.md").read_text()
    for kind in faults.KINDS:
        if kind.table != faults.RELAYS:
            assert f"| {kind.fault} | {kind.answer} |" in page, f"{kind.name} is not in docs/reliability.md's tables"
