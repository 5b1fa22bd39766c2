"""The step probe of scripts without the library: installed by the runner in a real rank process
(a subprocess, as the agent starts one), read by the agent's side of the file."""

import os
import subprocess
import sys
import textwrap

import pytest

from muster.worker.rank import step_probe
from muster.worker.rank.step_probe import STEP_FILE_ENV, StepFile

TRAIN = """
import os, sys, time, torch
{before}
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
first = torch.optim.SGD(model.parameters(), lr=0.01)
second = torch.optim.SGD(model.parameters(), lr=0.01)  # a second optimizer's steps are not the job's steps
for _ in range(30):
    time.sleep(0.01)  # compute
    model(torch.randn(4, 8)).sum().backward()
    time.sleep(0.005)  # what the all-reduce would wait
    first.step(); second.step(); first.zero_grad()
child = os.fork()
if child == 0:  # a child of the rank (a data loader's worker) stepping writes nothing
    for _ in range(5):
        first.step()
    os._exit(0)
os.waitpid(child, 0)
print("done", flush=True)
"""


def run_rank(tmp_path, script: str) -> tuple[subprocess.CompletedProcess, StepFile]:
    steps = StepFile(str(tmp_path / "steps"))
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(script))
    done = subprocess.run([sys.executable, "-m", "muster.worker.rank.runner", str(path)], capture_output=True, text=True,
                          env={**os.environ, STEP_FILE_ENV: steps.path}, timeout=60)
    return done, steps


@pytest.mark.timeout(60)
def test_an_unmodified_scripts_steps_and_compute_are_measured_from_its_first_optimizer(tmp_path):
    done, steps = run_rank(tmp_path, TRAIN.format(before=""))
    assert done.returncode == 0 and done.stdout == "done\n", done.stderr
    step, step_time_us, compute_us = steps.read()
    assert step == 30
    assert 15_000 <= step_time_us < 200_000 and 10_000 <= compute_us < step_time_us, (step_time_us, compute_us)


RESUMED = """
import torch
model = torch.nn.Linear(8, 1)
adam = torch.optim.Adam(model.parameters())
model(torch.randn(4, 8)).sum().backward()
adam.step()
saved = adam.state_dict()
saved["state"][0]["step"] = torch.tensor(41.0)  # a checkpoint of step 41, as a restarted rank loads it
adam.load_state_dict(saved)
for _ in range(3):
    model(torch.randn(4, 8)).sum().backward()
    adam.step()
"""


@pytest.mark.timeout(60)
def test_a_restarted_script_reports_its_own_step_where_its_optimizer_keeps_one(tmp_path):
    done, steps = run_rank(tmp_path, RESUMED)
    assert done.returncode == 0, done.stderr
    assert steps.read()[0] == 44  # Adam's step from the checkpoint, not the process's 4 (SGD keeps none: above)


@pytest.mark.timeout(60)
def test_a_library_rank_removes_the_probe_and_a_script_without_torch_is_untouched(tmp_path):
    done, steps = run_rank(tmp_path, TRAIN.format(before="from muster.worker.rank import step_probe; step_probe.detach()"))
    assert done.returncode == 0 and steps.read() == (0, 0, 0), done.stderr
    done, steps = run_rank(tmp_path, "import json, sys; print(json.dumps(sys.argv[1:])); sys.exit(3)")
    assert (done.returncode, done.stdout, done.stderr) == (3, "[]\n", "")
    assert steps.read() == (0, 0, 0)


def test_a_read_that_meets_a_write_keeps_the_last_whole_record(tmp_path):
    import mmap
    import struct

    steps = StepFile(str(tmp_path / "steps"))
    with open(steps.path, "r+b") as f:
        board = mmap.mmap(f.fileno(), step_probe.SIZE)
    record = struct.Struct("<QQIIQ")
    record.pack_into(board, 0, 1, 7, 900, 500, 1)
    assert steps.read() == (7, 900, 500)
    record.pack_into(board, 0, 2, 8, 1, 1, 1)  # half written: its sequence numbers differ
    assert steps.read() == (7, 900, 500)
    struct.pack_into("<Q", board, record.size - 8, 2)
    assert steps.read() == (8, 1, 1)
