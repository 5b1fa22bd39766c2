"""What the trainer integrations (hf, lightning, accelerate) share: the switch that makes a process
form its groups through the worker library, the data position, the model a trainer holds in place of
its own DDP wrapper, the RNG a discarded step is redone from, and the end of a run."""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Callable, Iterator

import structlog
import torch
import torch.distributed as dist

from muster.worker.rank import group_end, step_probe
from muster.worker.library.api import Worker
from muster.worker.library.config import WorkerConfig
from muster.worker.errors import Drained, RunEnded
from muster.worker.outcome import exit_code

log = structlog.get_logger(__name__)


def under_muster(integration: str) -> WorkerConfig | None:
    """The worker's config under `muster run` (None, logged: not under Muster, the integration is off).
    The runner's hooks for scripts without the library are detached: the library forms and ends the groups."""
    if not os.environ.get("MUSTER_JOB"):
        log.info(f"{integration}_resilience_off", reason="MUSTER_JOB is not set: not under `muster run`")
        return None
    group_end.detach()
    step_probe.detach()
    return WorkerConfig.from_env()


def alone(*, hide_world: bool = False) -> None:
    """A default group of this process alone, until the library forms the job's at the first step: the
    trainer's set-up collectives (barriers, a length's all-reduce) then pair with nobody else's steps.
    `hide_world`: accelerate starts torch.distributed itself (env://) when it sees WORLD_SIZE/LOCAL_RANK,
    and reads its world from this group instead once they are gone (tell_accelerate sets them per group)."""
    if hide_world:
        for name in ("WORLD_SIZE", "LOCAL_RANK"):
            os.environ.pop(name, None)
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


@contextlib.contextmanager
def run_ends(worker: Callable[[], Worker | None], step: Callable[[], int]) -> Iterator[None]:
    """A drain or the run's end raised at a step boundary is a clean end of the rank's process."""
    try:
        yield
    except Drained as exc:  # this node leaves the job at a step boundary
        log.info("training_drained", step=step(), reason=str(exc))
        worker().close(leave=False)
        raise SystemExit(0) from None
    except RunEnded as exc:
        log.info("training_ended", step=step(), outcome=exc.outcome, reason=exc.reason)
        worker().close(leave=False)
        raise SystemExit(exit_code(exc.outcome)) from None


class Replicated(torch.nn.Module):
    """What a trainer holds where its DDP wrapper would be: the model's parameters (for clipping,
    zeroing, saving) without a wrapper of its own; training steps go through the library's (`worker.ddp`),
    rebuilt on each generation's group. `ddp(module)`: the wrapper a training forward goes through (without
    it, or outside training, the model is called: the trainer's own step passes the wrapper in)."""

    def __init__(self, module: torch.nn.Module, ddp: Callable[[torch.nn.Module], torch.nn.Module] | None = None):
        super().__init__()
        self.module = module
        self._ddp = ddp

    def forward(self, *args, **kwargs):
        training = self._ddp is not None and self.module.training and torch.is_grad_enabled()
        return (self._ddp(self.module) if training else self.module)(*args, **kwargs)


class Positions:
    """A map-style dataset read by position: position p is sample perm_e[p mod n] of epoch e = p // n,
    perm_e a seeded permutation; a batch is `size` consecutive positions, whatever the world.

    The position is one number, the samples the job consumed: step s takes the next world x batch
    positions (x accumulation), rank r's micro-batch k the slice at (k x world + r) x batch, so a
    shrink or grow draws the redone step and the next ones for the new world, none skipped or seen twice."""

    def __init__(self, dataset, collate, batch_size: int, seed: int):
        self.dataset, self.collate, self.batch_size, self.seed = dataset, collate, batch_size, seed
        self.samples = len(dataset)
        self._perms: dict[int, torch.Tensor] = {}

    def indices(self, start: int, count: int) -> list[int]:
        out = []
        for p in range(start, start + count):
            epoch, i = divmod(p, self.samples)
            perm = self._perms.get(epoch)
            if perm is None:
                perm = torch.randperm(self.samples, generator=torch.Generator().manual_seed(self.seed + epoch))
                self._perms = {e: v for e, v in self._perms.items() if e >= epoch - 1}
                self._perms[epoch] = perm
            out.append(int(perm[i]))
        return out

    def batch(self, start: int, count: int):
        return self.collate([self.dataset[i] for i in self.indices(start, count)])

    def micro_batch(self, consumed: int, worker: Worker, k: int = 0):
        """Rank `worker.rank`'s micro-batch k of the step that begins at position `consumed`."""
        return self.batch(consumed + (k * worker.world_size + worker.rank) * self.batch_size, self.batch_size)


def tell_accelerate(w: Worker) -> None:
    """Tell accelerate's shared state (and the environment, for the script) this rank's place in the
    group the library formed: its gather, reduce and scheduler steps then count this world."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    place = {"num_processes": w.world_size, "process_index": w.rank, "local_process_index": w.config.local_rank,
             "backend": w.backend.torch_backend,
             "distributed_type": DistributedType.MULTI_GPU if w.device.type == "cuda" else DistributedType.MULTI_CPU}
    for shared in (PartialState._shared_state, AcceleratorState._shared_state):
        if shared:
            shared.update(place)
    os.environ.update(RANK=str(w.rank), WORLD_SIZE=str(w.world_size), LOCAL_RANK=str(w.config.local_rank))


def refuse(integration: str, why: list[str]) -> None:
    if why:
        raise ValueError(f"muster.worker.integrations.{integration} cannot keep this training in-process: "
                         + "; ".join(why))


SHARDED = ("sharded state (FSDP, DeepSpeed, model parallel): a lost shard exists nowhere else, and the library's "
           "sharded layouts (Replicas, Snapshots: docs/guide/sharded.md) are not mapped onto {what} yet; train "
           "with DDP, or write the loop on the worker library with register(build=..., layout=...)")


# ---- RNG ------------------------------------------------------------------------------------


def rng() -> dict:
    import numpy

    kind, keys, pos, has_gauss, cached = numpy.random.get_state()
    state = {"python": random.getstate(), "numpy": [kind, keys.tolist(), pos, has_gauss, cached],
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng(state: dict) -> None:
    import numpy

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    numpy.random.set_state((kind, numpy.array(keys, dtype=numpy.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
