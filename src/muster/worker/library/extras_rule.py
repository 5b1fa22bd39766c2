"""The rule for registered extras (a data position, a scheduler: `Worker.register(**extras)`): they
are updated inside the step scope. One changed after the scope ended, before the next step began,
was updated where a reform or a peer snapshot at that boundary had already taken it, so a
replacement or a rollback gets it a step stale. Looked at once, around a process's first step
boundary (the extras' fingerprint as the step left them, and as the next one begins), and said as
a warning."""

from __future__ import annotations

import structlog
import torch

from muster.worker.library.state import ReplicatedState

log = structlog.get_logger(__name__)


class ExtrasRule:
    def __init__(self, device: torch.device):
        self.device = device
        self._after: bytes | None = None  # the extras as the step scope left them, until the next step looks
        self._looked = False

    def noted(self, extras: dict) -> None:
        """A step ended (its scope, or a reform at its boundary): the extras as they are now."""
        if not self._looked and extras:
            self._after = self._fingerprint(extras)

    def check(self, extras: dict, step: int) -> None:
        """A step begins: warn if the extras changed since the last one ended."""
        if self._after is None:
            return
        changed = self._fingerprint(extras) != self._after
        self.excused()
        if changed:
            log.warning("extras_updated_after_step", step=step, extras=sorted(extras),
                        why="a registered extra changed after the step scope ended: a reform or peer snapshot at "
                            "that boundary takes it before the change, so a replacement or a rollback gets it one "
                            "step stale. Update it inside `with worker.step_scope()`")

    def excused(self) -> None:
        """Not looked at (again): a caller whose step ends at `Worker.boundary()` takes its extras whole."""
        self._after, self._looked = None, True

    def _fingerprint(self, extras: dict) -> bytes:
        return ReplicatedState(extras=extras).fingerprint(self.device)
