"""A job ends once: a rank whose script completed and that then dies or hangs in interpreter
teardown (torch/gloo destructors under Hugging Face's Trainer) has finished. Nothing restarts it,
nothing re-forms the job, and every agent exits 0."""

import sys
import time
from pathlib import Path

import pytest

from muster.local import json_lines, record_time

SCRIPT = Path(__file__).parent / "scripts" / "teardown.py"
STEPS = 5


def steps_by_rank(out: Path) -> dict[int, list[tuple[int, int]]]:
    return {int(p.stem.split("-")[1]): [tuple(map(int, line.split())) for line in p.read_text().splitlines()]
            for p in out.glob("rank-*.steps")}


def run_job(coordinators, agents, tmp_path, job: str, teardown: str, warm: bool, exit_timeout_s: float = 30.0):
    (leader,) = coordinators(1)
    out = tmp_path / "steps"
    out.mkdir()
    command = [sys.executable, "-u", str(SCRIPT), "--steps", str(STEPS), "--out", str(out), "--teardown", teardown]
    extra = ["--exit-timeout", str(exit_timeout_s)] + (["--warm-start"] if warm else [])
    nodes = agents([leader.address], job, ["a", "b"], nodes="2:2", command=command, extra=extra)
    for node in nodes:
        assert node.wait(60) == 0, node.log_path.read_text()[-3000:]
    # Every rank ran its steps exactly once, in one process; no slot was started twice.
    ranks = steps_by_rank(out)
    assert sorted(ranks) == [0, 1, 2, 3]
    for rank, lines in ranks.items():
        assert [s for s, _ in lines] == list(range(1, STEPS + 1)), f"rank {rank} ran {lines}"
        assert len({pid for _, pid in lines}) == 1
    for node in nodes:
        assert sorted(r["slot"] for r in node.records("rank_started")) == [0, 1]
        assert not node.records("rank_restart_scheduled")
    (said,) = [line for node in nodes for line in node.log_path.read_text().splitlines()
               if "finished its script, then" in line]
    assert said.startswith("muster run: rank 0 (slot ")
    return nodes, said


@pytest.mark.timeout(90)
@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_a_rank_aborting_in_teardown_after_its_script_completed_is_finished_not_restarted(
        coordinators, agents, tmp_path, warm):
    _, said = run_job(coordinators, agents, tmp_path, f"abort-{'warm' if warm else 'cold'}", "abort", warm)
    assert said.endswith("then died in interpreter teardown (killed by SIGABRT): counted as finished")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_a_rank_hanging_in_teardown_is_ended_after_the_exit_timeout_and_counted_finished(
        coordinators, agents, tmp_path, warm):
    nodes, said = run_job(coordinators, agents, tmp_path, f"hang-{'warm' if warm else 'cold'}", "hang", warm,
                          exit_timeout_s=3)
    assert "hung in interpreter teardown, ended after --exit-timeout 3s (killed by SIGTERM)" in said
    (node,) = [n for n in nodes if n.records("rank_exit_timeout")]
    completed = record_time(node.records("rank_completed")[-1])
    stopped = record_time(node.records("agent_stopped")[-1])
    assert 3 <= stopped - completed < 3 + 5, "ended within --exit-timeout and a few seconds"
