"""Where a rank's steps go: computing, or waiting for the others.

In synchronous data parallelism every rank's step takes as long as the slowest rank's, so step
times cannot tell a straggler. What can is the part of each step before the rank's gradients were
all computed (its forward and backward): a slow rank spends its step computing while the others
wait in the gradients' all-reduce. `ComputeClock` takes that moment from a hook on the gradient
computed last (the model's first parameter: backward runs the forward in reverse), and keeps the
compute times of the last `WINDOW` steps; the rank reports their median (`RankReport.compute_us`),
read off the training thread. The training thread pays one hook call and one append a step.
"""

from __future__ import annotations

import time
from collections import deque

import torch

WINDOW = 32  # steps the reported median is taken over: one slow step is noise, a slow window is not


class ComputeClock:
    __slots__ = ("ready_at", "samples", "_hooked")

    def __init__(self) -> None:
        self.ready_at = 0.0  # perf_counter() when the last gradient of the step was computed
        self.samples: deque[int] = deque(maxlen=WINDOW)  # compute µs of the latest steps
        self._hooked: set[int] = set()  # ids of the parameters hooked (a module wrapped again after a reform)

    def watch(self, module: torch.nn.Module) -> None:
        """Hook the gradient `module` computes last. Without a parameter that takes gradients
        (or before torch 2.2) nothing is measured and the rank reports 0."""
        self.watch_parameter(next((p for p in module.parameters() if p.requires_grad), None))

    def watch_parameter(self, param: torch.Tensor | None) -> None:
        """Hook `param`'s gradient: the step's compute ends with the last hooked gradient computed."""
        if param is None or not param.requires_grad or id(param) in self._hooked or \
                not hasattr(param, "register_post_accumulate_grad_hook"):
            return
        param.register_post_accumulate_grad_hook(self._gradients_ready)
        self._hooked.add(id(param))

    def _gradients_ready(self, _param) -> None:
        self.ready_at = time.perf_counter()

    def step_done(self, started: float) -> None:
        """A step that began at `started` completed: its compute time, if the hook fired in it (with
        gradient accumulation, the last micro-batch's backward ends the compute)."""
        if self.ready_at > started:
            self.samples.append(int((self.ready_at - started) * 1e6))

    def compute_us(self) -> int:
        """The median compute time of the latest steps (0: none measured). Any thread: the copy is
        made while holding the GIL, so an append from the training thread cannot interleave."""
        samples = sorted(tuple(self.samples))
        return samples[len(samples) // 2] if samples else 0
