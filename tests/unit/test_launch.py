"""What `muster run` decides before it runs anything: job names, torchrun's options, the verdicts
it prints (pure: no processes)."""

import re

import pytest

from muster.names import JOB_NAME
from muster.worker.agent.agent_config import AgentConfig
from muster.worker.agent.crash_report import failure_report
from muster.names import job_name
from muster.worker.agent.launch import LaunchError, plan
from muster.worker.agent.slot import Crash, Slot


def test_valid_job_names_are_kept_and_any_other_id_is_mapped_deterministically_without_collisions():
    assert job_name("llm-train.v2_1") == "llm-train.v2_1"
    assert job_name("12345") == "12345"  # a Slurm job id
    ids = ["MyRun", "myRun", "MYRUN", "run 1", "run/1", "$SLURM_JOB_ID", "Ünïcode", "-lead", "_", "a" * 63 + "b",
           "A" * 200, "x" * 64, "job\n", "日本"]
    names = [job_name(i) for i in ids]
    assert all(JOB_NAME.fullmatch(n) for n in names), names
    assert len(set(names) | {"myrun", "run-1"}) == len(ids) + 2  # distinct, and never a valid id's own name
    assert names == [job_name(i) for i in ids]  # every node maps alike
    assert re.fullmatch(r"myrun-[0-9a-f]{10}", job_name("MyRun"))
    assert job_name("$SLURM_JOB_ID").startswith("slurm_job_id-")
    with pytest.raises(ValueError):
        job_name("")


def test_torchrun_max_restarts_is_the_agents_budget_and_checked():
    assert plan(["torchrun", "--max-restarts=5", "--nproc-per-node", "2", "t.py"]).max_restarts == 5
    assert plan(["torchrun", "--max_restarts", "0", "t.py"]).max_restarts == 0
    assert plan(["torchrun", "t.py"]).max_restarts is None
    with pytest.raises(LaunchError, match="not a number"):
        plan(["torchrun", "--max-restarts=many", "t.py"])


def test_the_report_of_a_slot_given_up_names_rank_exit_code_and_its_last_lines():
    config = AgentConfig(("127.0.0.1:1",), "job", "node-a", 2, ("python", "train.py", "--lr", "x y"), max_restarts=2)
    slot = Slot(1, restarts=5, charged=2, rank=3)  # restarted 3 more times for maps: not charged
    crash = Crash(code=-9, pid=42, rank=3, generation=4, at=0.0, tail=("Traceback (most recent call last):",
                                                                     "ValueError: bad --lr"), error="ValueError: bad --lr")
    text = failure_report(config, slot, "its process ended (killed by SIGKILL)", crash, crash.tail)
    assert "slot 1 of node 'node-a' in job 'job' is given up: its process ended (killed by SIGKILL), and its 2 " \
           "restart(s) (--max-restarts 2) are spent" in text
    assert "rank      : 3 (local rank 1)" in text and "killed by SIGKILL (pid 42, generation 4" in text
    assert "error     : ValueError: bad --lr" in text and "command   : python train.py --lr 'x y'" in text
    assert text.splitlines()[-2] == "    ValueError: bad --lr"
