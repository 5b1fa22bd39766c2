"""The Lightning strategy's collectives outside the optimizer step, over a stand-in for the worker
(the real ones: tests/integration/test_lightning_trainer.py). A failure cuts the ranks at different
places, some in a step, which they redo, some between steps; they must meet again at the step's
collectives, or the group hangs until the progress timeout (a CI run, accumulate_grad_batches=2)."""

import pytest

pytest.importorskip("lightning")

from muster.worker.integrations.lightning import MusterDDPStrategy, _Run  # noqa: E402
from muster.worker.library.comm import StepCut  # noqa: E402


class Worker:
    """What the strategy asks of the library between steps: its group aborted (StepCut) or not;
    a failure re-forms it."""

    def __init__(self):
        self.aborted, self.generation, self.step = False, 1, 5

    def check_group(self):
        if self.aborted:
            raise StepCut(f"generation {self.generation} was aborted")

    def step_failed(self, exc):
        self.aborted, self.generation = False, self.generation + 1
        return True

    def step_begins(self):
        pass

    def boundary(self):
        pass


class Strategy:
    def __init__(self):
        self._muster = _Run.__new__(_Run)
        self._muster.strategy, self._muster.worker = self, Worker()
        self._muster.in_step, self._muster.cut_between_steps = False, False

    def set_world_ranks(self):
        pass

    collective = MusterDDPStrategy._collective
    sigterm_said = MusterDDPStrategy._sigterm_said


def test_after_a_collective_cut_between_steps_the_rank_makes_none_until_its_next_step():
    strategy, made = Strategy(), []
    run = strategy._muster
    assert strategy.collective(lambda: made.append("before") or "group's", "own") == "group's"
    run.worker.aborted = True  # a peer lost: this rank is cut at its next collective, others in their step
    assert strategy.collective(lambda: made.append("cut"), "own") == "own"
    assert run.worker.generation == 2, "re-formed"
    # its others before its next step: not made in the new group, where the others are in a step's
    assert strategy.collective(lambda: made.append("after"), "own") == "own"
    run.begin_step()
    run.in_step = False  # (the step completed)
    assert strategy.collective(lambda: made.append("next") or "group's", "own") == "group's"
    assert made == ["before", "next"]


def test_between_a_steps_micro_batches_rank_0s_word_waits_for_the_next_step():
    """No broadcast in a step: a rank redoing the step runs its micro-batches without one."""
    strategy = Strategy()
    strategy._muster.in_step = True
    assert strategy.sigterm_said() is None  # (it touched neither the group nor the trainer)
