"""The durable tier's files (src/muster/worker/library/checkpoints.py): what the writer thread leaves, that a
checkpoint is used only complete and with the bytes its marker recorded, the ranks' agreement on
one step, retention, and the "auto" cadence."""

import json
import math

import pytest
import torch

from muster.worker.library.checkpoints import AUTO_FIRST, Checkpoints, CorruptCheckpoint, Durable
from muster.worker.errors import StateLost

pytestmark = pytest.mark.timeout(60)


def tree(step: int) -> dict:
    return {"model": {"w": torch.full((4, 4), float(step))}, "optimizer": {"state": {}, "lr": 0.1},
            "extras": {"data": {"epoch": step}}}


class OneRank:
    """A store exchange of a single rank (what Channel.exchange returns: every rank's value)."""

    def exchange(self, key: str, value: str) -> list[bytes]:
        return [value.encode()]


def written(tmp_path, steps, every=2, keep=5, shards=1) -> Durable:
    d = Durable(Checkpoints(str(tmp_path), every=every, keep=keep), shards)
    for step in steps:
        d.stepped(step, 1000, 0, lambda s=step: tree(s))
        assert d.flush(30)
    return d


def test_a_checkpoint_reads_back_bit_for_bit_and_each_file_was_renamed_into_place(tmp_path):
    d = written(tmp_path, range(1, 7))
    assert d.complete() == [6, 4, 2] and d.written == 3 and d.copies_s
    back = d.read(6, 0)
    assert torch.equal(back["model"]["w"], tree(6)["model"]["w"]) and back["extras"]["data"]["epoch"] == 6
    assert back["optimizer"]["lr"] == 0.1
    assert not list(tmp_path.rglob("*.partial"))


def test_a_checkpoint_written_half_way_is_never_used(tmp_path):
    d = written(tmp_path, [2, 4], shards=2)  # shard 0 only: neither is complete
    assert d.complete() == []
    d = written(tmp_path, [2, 4])
    (tmp_path / "step-000000000006").mkdir()
    (tmp_path / "step-000000000006" / "shard-0.bin").write_bytes(b"half")  # its marker never came
    assert d.complete() == [4, 2]
    loaded = []
    assert d.resume(OneRank(), 0, loaded.append, above=0) == 4 and loaded[0]["extras"]["data"]["epoch"] == 4


def test_bytes_that_differ_from_the_marker_fall_through_to_the_next_older_then_to_state_lost(tmp_path):
    d = written(tmp_path, [2, 4])
    newest = tmp_path / "step-000000000004" / "shard-0.bin"
    raw = bytearray(newest.read_bytes())
    raw[-1] ^= 1
    newest.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpoint):
        d.read(4, 0)
    loaded = []
    assert d.resume(OneRank(), 0, loaded.append, above=-1) == 2 and [t["extras"]["data"]["epoch"] for t in loaded] == [2]
    marker = tmp_path / "step-000000000002" / "shard-0.json"
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "digest": "0" * 32}))
    with pytest.raises(StateLost, match="could be read"):
        d.resume(OneRank(), 0, loaded.append, above=-1)
    assert d.resume(OneRank(), 0, loaded.append, above=4) is None, "the ranks hold a newer step: nothing to load"


def test_ranks_that_read_different_steps_agree_on_the_oldest():
    class Ranks:
        """Two ranks: the other could read only step 2."""

        def exchange(self, key, value):
            return [value.encode(), b"2" if key.startswith("durable/loaded") else value.encode()]

    class Files(Durable):
        def __init__(self):
            self.spec = Checkpoints("unused")

        def complete(self):
            return [4, 2]

        def read(self, step, shard):
            return tree(step)

    loaded = []
    assert Files().resume(Ranks(), 0, loaded.append, above=0) == 2
    assert [t["extras"]["data"]["epoch"] for t in loaded] == [4, 2], "read 4, then went back to the step all hold"


def test_each_writer_keeps_the_newest_complete_ones(tmp_path):
    written(tmp_path, range(1, 11), keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000000008", "step-000000000010"]


def test_auto_is_a_power_of_two_near_youngs_interval_and_keeps_the_copy_under_1_percent():
    d = Durable.__new__(Durable)
    d.spec, d.copy_s, d.step_s, d.write_s, d.failures = Checkpoints("x"), 0.0, 0.0, 0.0, 0
    assert d.every() == AUTO_FIRST, "before its cost is known"
    d.started = __import__("time").monotonic()
    d.copy_s, d.step_s = 0.05, 0.1
    steps = math.sqrt(2 * 0.05 * 3600) / 0.1  # ~190
    assert d.every() == 128 and 128 <= steps < 256
    d.failures = 15  # 16 x the failure rate: a quarter of Young's interval (32), but the copy would cost 1.6 %
    assert d.every() == 64 and d.copy_s / (64 * d.step_s) <= 0.01
    d.copy_s = 0.01  # a cheaper copy: Young's interval again (16), its cost 0.6 %
    assert d.every() == 16
    d.copy_s = 0.05
    d.write_s = 30.0  # never shorter than a write takes
    assert d.every() == 256
