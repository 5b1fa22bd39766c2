"""Steps and compute time from a script that does not use the library, with no change to it.

Under `muster run` the runner installs a probe in each Python rank (`attach`): a global optimizer
step post-hook (every `optimizer.step()` of the script's first optimizer is a step) and, once that
optimizer has stepped, a post-accumulate-grad hook on the first parameter of each of its parameter
groups (the gradients backward computes last: `ComputeClock`). The step reported is the script's
own where its optimizer keeps one (Adam's and most others' per-parameter `step`, restored with the
optimizer's state from a checkpoint: a restarted rank reports the step it resumed from, not 1),
else the optimizer's steps in this process. A step's compute is the time from the
previous step's end until its gradients were all computed: data loading, forward and backward, the
rest being the wait for the others in the gradients' all-reduce and the update. Torch is never
imported for it: installed when the script imports torch (or at once, in a rank forked from a zygote
that imported it). The probe never fails the script: a probe that cannot be installed reports nothing.

Where it goes: a small file of the agent's (`StepFile`, named in $MUSTER_STEP_FILE), mapped into
both processes. The rank writes (step, step time, median compute) at each step as one record between
two copies of a sequence number (a read that finds them unequal met a write, and is retried), no
system call on the training thread; the agent reads it whenever it builds its node's frame. The
rank is in state `script` for the leader: its steps feed the straggler watch and `muster status`,
never a stall verdict (a script may pause for anything). A library rank removes the probe when it
starts (`detach`): it reports its own steps.
"""

from __future__ import annotations

import mmap
import os
import struct
import sys
import time
import weakref

from muster.worker.rank.after_import import when_imported

STEP_FILE_ENV = "MUSTER_STEP_FILE"
# seq, step, step_time_us, compute_us, seq: written whole; a read that finds the two seqs unequal
# met a write and is retried
_RECORD = struct.Struct("<QQIIQ")
SIZE = _RECORD.size
_U32 = 0xFFFFFFFF
MEDIAN_EVERY = 4  # steps between two medians of the compute window (a sort of 32 on the training thread)


class StepFile:
    """The agent's side: the file of one process it starts, read at each frame (in the agent's
    private directory, removed with it)."""

    def __init__(self, path: str):
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, SIZE)
            self._map = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        self._last = (0, 0, 0)

    def read(self) -> tuple[int, int, int]:
        """(step, step_time_us, compute_us) as the rank last wrote them; the last whole read while it writes."""
        for _ in range(3):
            head, step, step_time_us, compute_us, tail = _RECORD.unpack_from(self._map, 0)
            if head == tail:
                self._last = (step, step_time_us, compute_us)
                break
        return self._last


# ---- in the rank ------------------------------------------------------------------------------

_hook = None  # the installed probe's optimizer hook (a RemovableHandle), once installed


class StepProbe:
    __slots__ = ("_map", "_clock", "_optimizer", "_param", "_seq", "_compute_us", "step", "started")

    def __init__(self, board: mmap.mmap, clock):
        self._map = board
        self._clock = clock
        self._optimizer = None  # weakref to the optimizer whose steps count (the script's first)
        self._param = None  # its first parameter, whose optimizer state may hold the script's own step
        self._seq = 0
        self._compute_us = 0
        self.step = 0
        self.started = time.perf_counter()

    def stepped(self, optimizer, _args, _kwargs) -> None:
        """The global optimizer post-step hook: one step of the script's first optimizer completed.
        (A few µs of the training thread a step: one record written whole, a median every few steps.)"""
        mine = self._optimizer() if self._optimizer is not None else None
        if mine is not optimizer:
            if mine is not None:
                return  # another optimizer of the script (a GAN's second)
            self._optimizer = weakref.ref(optimizer)
            for group in optimizer.param_groups:
                self._clock.watch_parameter(next(iter(group["params"]), None))
            self._param = next((p for g in optimizer.param_groups for p in g["params"]), None)
        now = time.perf_counter()
        started, clock = self.started, self._clock
        clock.step_done(started)
        self.step = step = self.step + 1
        if step % MEDIAN_EVERY == 1:
            self._compute_us = min(clock.compute_us(), _U32)
        own = own_step(optimizer, self._param)
        self._seq = seq = self._seq + 1
        _RECORD.pack_into(self._map, 0, seq, step if own is None else own, min(int((now - started) * 1e6), _U32),
                          self._compute_us, seq)
        self.started = now


def own_step(optimizer, param) -> int | None:
    """The script's own step as its optimizer keeps it for `param` (a count from the job's start,
    checkpointed with the optimizer's state); None where it keeps none, or where reading it would
    wait for a device (a `capturable` or fused optimizer keeps it there)."""
    state = optimizer.state.get(param) if param is not None else None
    step = state.get("step") if state else None
    if isinstance(step, (int, float)):
        return int(step)
    if step is not None and getattr(step, "device", None) is not None and step.device.type == "cpu":
        return int(step.item())
    return None


def attach(path: str) -> None:
    """In a rank the runner starts: install the probe now if torch is loaded (a warm start), else
    once the script imports torch."""
    if path:
        when_imported("torch", lambda: _install(path))


def detach() -> None:
    """The rank uses the library, which reports its steps itself."""
    global _hook
    if _hook is not None:
        _hook.remove()
    _hook = None


def _install(path: str) -> None:
    global _hook
    if _hook is not None:
        return
    try:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        from muster.worker.compute_clock import ComputeClock

        fd = os.open(path, os.O_RDWR)
        try:
            board = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        _hook = register_optimizer_step_post_hook(StepProbe(board, ComputeClock()).stepped)
        os.register_at_fork(after_in_child=detach)  # a child the script forks (a data loader's worker) writes nothing
    except Exception as exc:  # an old torch, the agent's file gone: the rank runs, unmeasured
        print(f"muster: steps are not measured in this rank ({type(exc).__name__}: {exc})", file=sys.stderr)
