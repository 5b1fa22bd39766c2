"""The Accelerate integration (src/muster/worker/integrations/accelerate.py) with the real libraries:
examples/train_accelerate.py, a hand-written loop with its one line (`--resilient`), a tiny GPT-2 from a
config, 2 `muster run` agents x 2 ranks over a real coordinator and etcd, DDP over gloo on CPU. A rank
is SIGKILLed: the survivors keep their processes and re-form in-process, the replacement takes the
state (model, optimizer, scheduler, RNG, data position) from them, and every rank ends with the same
state."""

import os
import signal
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from muster.local import wait_until  # noqa: E402
from tests.integration.test_hf_trainer import check_one_run  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_accelerate.py"
PRODUCTION_TIMEOUT = ["--heartbeat-timeout", "2.0"]
STEPS, SAMPLES = 20, 200  # at least 20 steps, then on to the first 4 ranks run (--until-world); an epoch: 12 or 16


@pytest.mark.timeout(330)
def test_a_killed_rank_s_survivors_reform_in_process_and_the_replacement_takes_their_state(
        coordinators, agents, tmp_path):
    (leader,) = coordinators(1, extra=PRODUCTION_TIMEOUT)
    command = [sys.executable, str(SCRIPT), "--resilient", "--steps", str(STEPS), "--until-world", "4", "--step-sleep", "0.05",
               "--samples", str(SAMPLES), "--checkpoint-dir", str(tmp_path / "checkpoints")]
    a, b = agents([leader.address], "acckill", ["a", "b"], command=command, nodes="2:2")
    wait_until(lambda: all(n.steps(s) and n.steps(s)[-1]["step"] >= 5 for n in (a, b) for s in (0, 1)),
               180, "every rank past step 5")  # (90 s was not enough once, on a host 3x slower at a load of 10)
    os.kill(b.rank_pids(0)[-1], signal.SIGKILL)
    wait_until(lambda: len(b.rank_pids(0)) == 2, 30, "the agent starts a replacement")
    survivor = check_one_run([a, b], (b, 0), STEPS, samples=SAMPLES, keys=("digest", "epoch", "lr"),
                             off="accelerate_resilience_off")
    assert {r["world_size"] for r in survivor} >= {3, 4}, "the survivors trained on as 3, then 4 again"
    assert survivor[-1]["epoch"] > 1, "the run crossed an epoch"
    assert not list((tmp_path / "checkpoints").glob("step-*")), "no checkpoint written or read"
    kinds = [r["kind"] for r in leader.find("membership_changed")]
    assert "rank_exited" in kinds and "rank_recovered" in kinds
