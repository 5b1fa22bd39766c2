"""The Hugging Face integration's parts that need no job: the line is a no-op outside Muster, and
the data position reads every sample of an epoch once, whatever world sizes read it."""

import pytest

pytest.importorskip("transformers")

from transformers import Trainer  # noqa: E402

from muster.worker.integrations import hf  # noqa: E402
from muster.worker.integrations.common import Positions  # noqa: E402


def test_outside_muster_the_line_changes_nothing(monkeypatch):
    monkeypatch.delenv("MUSTER_JOB", raising=False)
    before = {name: getattr(Trainer, name) for name in ("train", "training_step", "get_batch_samples")}
    assert hf.resilient() is False
    assert {name: getattr(Trainer, name) for name in before} == before


def test_positions_read_each_sample_of_an_epoch_once_across_world_changes():
    data = Positions(list(range(50)), list, batch_size=3, seed=7)
    consumed, seen = 0, []
    for world in (4, 4, 3, 3, 3, 4, 2, 4, 4):  # a step each: rank r's batch k is (k * world + r) * batch on
        seen += [i for r in range(world) for i in data.batch(consumed + r * 3, 3)]
        consumed += world * 3
    assert len(seen) == consumed == 93
    assert sorted(seen[:50]) == list(range(50)) and len(set(seen[50:])) == 43  # epoch 1 is a new permutation
    assert seen[:50] != list(range(50))
