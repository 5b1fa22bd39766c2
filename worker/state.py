"""The training state that must stay identical on every rank, and its transfer after a reform:
the rank with the highest completed step (lowest rank on a tie) sends model, optimizer, step
and extras to all; afterwards every rank holds bit-identical state."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


@dataclass
class TrainingState:
    model: torch.nn.Module | None = None
    optimizer: Stateful | None = None
    extras: dict[str, Stateful] = field(default_factory=dict)

    def tensors(self) -> list[torch.Tensor]:
        return list(self.model.state_dict().values()) if self.model is not None else []

    def discard_step(self) -> None:
        """Gradients of an aborted step must not leak into the redo."""
        if self.model is not None:
            self.model.zero_grad(set_to_none=True)

    def sync(self, step: int, rank: int, world_size: int, device: torch.device) -> tuple[int, int]:
        """Collective over the current group. Returns (source rank, the step everyone now holds)."""
        steps = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world_size)]
        dist.all_gather(steps, torch.tensor([step], dtype=torch.int64, device=device))
        values = [int(s.item()) for s in steps]
        best = max(values)
        source = values.index(best)
        for t in self.tensors():  # state_dict tensors share storage with parameters and buffers
            dist.broadcast(t.data, source)
        if self.optimizer is not None or self.extras:
            payload = [{
                "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
                "extras": {name: obj.state_dict() for name, obj in self.extras.items()},
            } if rank == source else None]
            dist.broadcast_object_list(payload, source, device=device)
            if rank != source:
                if self.optimizer is not None:
                    self.optimizer.load_state_dict(payload[0]["optimizer"])
                for name, obj in self.extras.items():
                    obj.load_state_dict(payload[0]["extras"][name])
        return source, best

    def digest(self) -> bytes:
        """16 bytes over every parameter and buffer, to compare replicas."""
        h = hashlib.blake2b(digest_size=16)
        for t in self.tensors():
            h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return h.digest()
