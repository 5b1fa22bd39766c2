"""What the library adds to a registered model and optimizer so that an aborted group costs as
little as it can and never corrupts the state:

- a step in flight when its group is aborted is lost anyway, yet its compute would go on until
  its next collective failed (a second for a large model on a CPU): a check as the forward reaches
  each module with parameters, and as the backward makes each gradient, ends it at once (StepCut);
  the worker's DDP wrappers check first too, before DDP's own collectives of a new group's first
  steps (its bucket rebuild: two broadcasts that, on an aborted NCCL group, wait for the abort);
- on CUDA, a step's all-reduce runs on the GPU after the host has moved on, and an abort that cuts
  it short leaves each rank with its own partial sums. Applied by the optimizer, they would make
  every survivor's state different (seen on an H200: after a kill each survivor held another
  state). Before the optimizer's step the host waits for the step's GPU work and refuses the step
  if the group was aborted meanwhile: it is discarded with its gradients and redone in the new
  group, the state untouched.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from muster.worker.library.backends import NCCL_ABORTED
from muster.worker.library.comm import Comm, StepCut


class StepGuards:
    def __init__(self, generation: Callable[[], int], step: Callable[[], int], comm: Callable[[], Comm | None],
                 closing: Callable[[], bool], device: torch.device):
        self.generation, self.step, self.comm, self.closing, self.device = generation, step, comm, closing, device
        self.cut_below = 0  # a step in a generation below this is cut short (its group was aborted)

    def install(self, model: torch.nn.Module | None, optimizer) -> None:
        if model is not None:
            for module in model.modules():
                if next(module.parameters(recurse=False), None) is not None:
                    module.register_forward_pre_hook(self.cut_short)
            for p in model.parameters():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self.cut_short)
        if self.device.type == "cuda" and hasattr(optimizer, "register_step_pre_hook"):
            optimizer.register_step_pre_hook(self._refuse_partial_step)

    def aborted(self, below_generation: int) -> None:
        """The abort thread left (or is leaving) the groups below this generation."""
        self.cut_below = max(self.cut_below, below_generation)

    def cut_short(self, *_) -> None:
        if self.generation() < self.cut_below and not self.closing():
            raise StepCut(f"generation {self.generation()} was aborted: the step in flight is cut short")

    def _refuse_partial_step(self, optimizer, args, kwargs) -> None:
        comm = self.comm()
        if comm is None or not comm.formed:
            return
        torch.cuda.current_stream(self.device).synchronize()
        if comm.aborted():
            raise RuntimeError(f"{NCCL_ABORTED[0]} while step {self.step() + 1}'s collectives ran: its gradients are "
                               "partial, so the optimizer step is refused")
