"""The runner's hooks on a script's process group (group_end): destroy_process_group() waits until
no collective holds what backward stashed (gloo frees it with the GIL), and says that the script's
collective work is done by a file it keeps touching until __main__ returns."""

import json
import os
import subprocess
import sys
import textwrap
import time

from muster.worker.rank.group_end import ENDED_SUFFIX, EndedFile
from muster.worker.rank.runner import COMPLETED_FILE_ENV

PROGRAM = """
import contextvars, json, os, sys, threading, time
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

ended = sys.argv[1]
dist.init_process_group("gloo", init_method=sys.argv[2], rank=0, world_size=1)
ddp = DistributedDataParallel(torch.nn.Linear(4, 1))
for _ in range(3):
    ddp(torch.randn(2, 4)).sum().backward()
# As a gloo worker does with the state a collective of backward captured: it lets go 0.5 s from now.
held = contextvars.copy_context()
torch._C._stash_obj_in_tls("context", held)
torch._C._remove_obj_from_tls("context")
keep = [held]
del held
started = time.monotonic()  # before the timer: it lets go no sooner than 0.5 s after this
threading.Timer(0.5, keep.clear).start()
dist.destroy_process_group()  # (with `ddp` alive, as the DDP tutorial does)
waited = time.monotonic() - started
before = os.stat(ended).st_mtime_ns
time.sleep(2.5)
print(json.dumps({"waited": waited, "pulsed": os.stat(ended).st_mtime_ns > before}))
"""


def test_destroy_waits_for_backwards_state_then_marks_the_group_ended_until_the_script_returns(tmp_path):
    (tmp_path / "prog.py").write_text(textwrap.dedent(PROGRAM))
    marker = tmp_path / "completed"
    ended = f"{marker}{ENDED_SUFFIX}"
    done = subprocess.run([sys.executable, "-m", "muster.worker.rank.runner", "prog.py", ended,
                           f"file://{tmp_path / 'store'}"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={**os.environ, COMPLETED_FILE_ENV: str(marker)})
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert 0.5 <= seen["waited"] < 5, seen  # held until the "worker" let go, not to the drain's bound
    assert seen["pulsed"]  # touched while the script ran on after destroy_process_group()
    assert marker.exists() and not os.path.exists(ended)  # completed; the pulse's file gone with it


def test_the_agent_sees_how_long_a_pulse_has_not_changed(tmp_path):
    path = tmp_path / f"completed{ENDED_SUFFIX}"
    ended = EndedFile(str(path))
    assert ended.frozen_s() == 0.0  # no file: the script has not ended its group
    path.touch()
    assert ended.frozen_s() < 0.05
    time.sleep(0.2)
    assert ended.frozen_s() >= 0.2
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 1))  # touched again
    assert ended.frozen_s() < 0.05
    path.unlink()
    assert ended.frozen_s() == 0.0
