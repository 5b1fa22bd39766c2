"""`make gpu-check` without CUDA: CI passes it by (exit 0, saying so); --require-gpu fails it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"


def gpu_check(*args: str) -> subprocess.CompletedProcess:
    # No device visible, even on a machine with one: this is the path CI takes.
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})


@pytest.mark.timeout(90)
def test_without_cuda_it_says_so_and_passes():
    done = gpu_check()
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("gpu-check: skipped, no CUDA device")
    assert "bench/recovery.py --backend nccl --ranks 8" in done.stdout


@pytest.mark.timeout(90)
def test_require_gpu_fails_without_cuda():
    done = gpu_check("--require-gpu")
    assert done.returncode == 2
    assert "--require-gpu and no CUDA device" in done.stderr and not done.stdout
