"""PyTorch Lightning 2.x on the worker library: one strategy, and a lost rank's survivors re-form
in-process while the replacement takes the state from its peers.

    from muster.worker.integrations.lightning import MusterDDPStrategy
    trainer = Trainer(strategy=MusterDDPStrategy(), max_steps=10_000, ...)   # the line

Outside Muster (no MUSTER_JOB: plain python, torchrun) it is Lightning's DDPStrategy. Under `muster run`:

- **Who forms the group.** Lightning's set-up (its barriers, the loader length's all-reduce, the
  checkpoint directory's broadcast) runs in a group of the process alone; the rank joins the job at
  its first training step, once model and optimizer exist, so a replacement's set-up runs while the
  others train. Each formation sets the strategy's rank and world size (a ClusterEnvironment that
  reads the worker) and `rank_zero_only.rank`.
- **A step.** The model Lightning holds is not wrapped in DDP; its training forward goes through
  the library's wrapper on the current group (`worker.ddp`). The optimizer step is the unit: its
  closures (training_step, zero_grad, backward), one per micro-batch with `accumulate_grad_batches`
  (the strategy handles the accumulation: all but the last under the wrapper's `no_sync`), and a
  collective failing anywhere in them, or the library's guards cutting one short on an abort,
  discards the step (its gradients, the RNG back to the step's start); the group re-forms and the
  step's micro-batches so far run again, drawn for the new group, before the one in flight; the
  optimizer steps once, for the attempt that completed. (A LightningModule.optimizer_step override
  is called for every micro-batch, as under DeepSpeed; the optimizer steps on the last.) A
  collective Lightning runs outside a step (a barrier, a broadcast, a `sync_dist` reduction of
  validation or epoch metrics) that fails re-forms and gives the rank's own value, as do the rank's
  collectives after it until its next step begins: a failure cuts the ranks at different places (some
  in a step, which they redo, some between steps), and they meet again at the step's collectives.
  For the same reason rank 0's word on a SIGTERM (Lightning's broadcast before every batch) is
  heard before a step's first micro-batch only: a step redone runs its micro-batches without it.
- **The state.** Model, optimizer, and as one extra: the LR schedulers, the fit loop's progress
  (global step, epoch and batch counters, optimizer and scheduler steps), the RNG as the step began,
  the callbacks' states (ModelCheckpoint's best) and the data position. A joiner receives it in its
  first training step, where the others stand at their next one, with no checkpoint read.
- **The data.** The train loader Lightning would shard with a DistributedSampler is replaced by one
  of max_steps placeholders (one Lightning epoch spans the run); each step's batch is drawn in
  training_step from the loader's dataset and collate_fn by position (common.Positions: rank r's
  slice of the next world x batch samples of a seeded permutation per epoch, the seed PL_GLOBAL_SEED).
  The per-device batch is kept, so the global batch follows the world. The data epoch is the
  position over the dataset's size (`epoch()`); Lightning's own epoch counter counts loops.
- **The step's end.** The library counts a step when the optimizer stepped, and takes a membership
  change at the next training step's start, after the step's callbacks (checkpoints), scheduler,
  validation and logging.

What it refuses (ValueError, at fit): no max_steps, manual optimization,
more than one optimizer, limit_train_batches, an iterable dataset or a loader without a batch_size,
DDP communication hooks, and sharded state (an FSDP or model-parallel module, a
ZeroRedundancyOptimizer): see docs/guide/lightning.md. Tested with lightning 2.6 on CPU/gloo.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import time
from typing import Any

import structlog
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

from muster.worker.integrations.common import (SHARDED, Positions, Replicated, alone, refuse, rng, run_ends,
                                               set_rng, under_muster)
from muster.worker.library.api import Worker
from muster.worker.library.config import WorkerConfig
from muster.worker.errors import Drained, RunEnded, WorkerError

log = structlog.get_logger(__name__)


class MusterDDPStrategy(DDPStrategy):
    """DDPStrategy whose groups the worker library forms, one per generation (see the module's doc).
    Takes DDPStrategy's arguments (find_unused_parameters, static_graph, ...)."""

    strategy_name = "muster_ddp"

    def __init__(self, **kwargs):
        config = under_muster("lightning")
        self._muster = _Run(self, config) if config is not None else None
        if config is not None:
            kwargs["cluster_environment"] = _Place(self._muster)
        super().__init__(**kwargs)

    @property
    def root_device(self) -> torch.device:
        devices = self.parallel_devices
        if self._muster is None or self.local_rank < len(devices):
            return super().root_device
        return devices[0] if devices[0].type == "cpu" else torch.device(devices[0].type, self.local_rank)

    def run(self) -> _Run | None:
        """This process's run under the library (None: not under Muster)."""
        return self._muster

    # ---- set-up: a group of one until the first step ----------------------------------

    def setup_distributed(self) -> None:
        if self._muster is None:
            return super().setup_distributed()
        self.set_world_ranks()
        self._process_group_backend = "gloo"
        alone()

    def set_world_ranks(self) -> None:
        if self._muster is None:
            return super().set_world_ranks()
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def setup(self, trainer) -> None:
        super().setup(trainer)
        if self._muster is not None and trainer.state.fn == TrainerFn.FITTING:
            self._muster.refuse_unsupported(trainer)
            # The epoch loop's word from rank 0 on a SIGTERM goes straight to torch.distributed before
            # every batch, outside a step: started on a group just aborted it waited for a lost peer
            # until the survivor was ended as stuck. As the strategy's other collectives, it is guarded.
            trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = self._sigterm_said

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        if self._muster is None:
            return super()._setup_model(model)
        self._muster.module = model
        return Replicated(model, lambda module: self._muster.worker.ddp(module, **self._ddp_kwargs))

    def _register_ddp_hooks(self) -> None:
        if self._muster is None:
            super()._register_ddp_hooks()

    def process_dataloader(self, dataloader: object) -> object:
        if self._muster is None or not self.lightning_module.trainer.training:
            return dataloader
        return self._muster.loader(dataloader)

    @property
    def handles_gradient_accumulation(self) -> bool:
        return self._muster is not None or super().handles_gradient_accumulation  # (every micro-batch: optimizer_step)

    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        if isinstance(batch, _Due):
            return batch  # drawn (and moved) in training_step, for the group the step runs in
        return super().batch_to_device(batch, device, dataloader_idx)

    # ---- a step -----------------------------------------------------------------------

    def training_step(self, *args: Any, **kwargs: Any):
        if self._muster is None:
            return super().training_step(*args, **kwargs)
        return super().training_step(self._muster.draw(), *args[1:], **kwargs)

    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any) -> Any:
        run = self._muster
        if run is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.lightning_module.trainer.fit_loop._should_accumulate():
            return run.redone(closure, last=False)()  # a micro-batch before the step's last: no optimizer step
        out = super().optimizer_step(optimizer, run.redone(closure, last=True), model, **kwargs)
        run.step_completed()
        return out

    # ---- collectives outside a step: re-formed on a failure, the rank's own value --------

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self._collective(lambda: super(MusterDDPStrategy, self).barrier(*args, **kwargs), None)

    def broadcast(self, obj, src: int = 0):
        return self._collective(lambda: super(MusterDDPStrategy, self).broadcast(obj, src), obj)

    def reduce(self, tensor, group=None, reduce_op="mean"):
        return self._collective(lambda: super(MusterDDPStrategy, self).reduce(tensor, group, reduce_op), tensor)

    def all_gather(self, tensor, group=None, sync_grads: bool = False):
        return self._collective(lambda: super(MusterDDPStrategy, self).all_gather(tensor, group, sync_grads),
                                tensor.unsqueeze(0) if isinstance(tensor, torch.Tensor) else tensor)

    def _sigterm_said(self) -> None:
        """Lightning's `_broadcast_sigterm_tensor`, before every batch: rank 0's word (a SIGTERM it
        received) on the current group, never started on an aborted one; the rank's own where it failed.
        Between a step's micro-batches it waits for the next step's first: a rank redoing a step cut
        short runs the step's micro-batches without these broadcasts, and the others, had they made
        one, would wait in it for that rank in the step's all-reduce (CI: a hang with
        accumulate_grad_batches=2, every survivor stalled until the progress timeout)."""
        run = self._muster
        if run is not None and run.worker is not None and run.in_step:
            return
        own = torch.tensor([1 if getattr(self.lightning_module.trainer, "received_sigterm", False) else 0],
                           device=self.root_device)

        def said():
            word = own.clone()
            dist.broadcast(word, src=0)
            return word
        word = self._collective(said, own)
        if word.item() == 1:
            with contextlib.suppress(Exception):
                self.barrier()  # (as Lightning's: every rank before any exits)
            raise SIGTERMException()

    def _collective(self, call, own):
        run = self._muster
        if run is None or run.worker is None or run.in_step:
            return call()  # (in a step: a failure is the step's, redone whole)
        if run.cut_between_steps:
            return own  # the others meet this rank at its next step's collectives, not at this one
        try:
            run.worker.check_group()  # (never started on an aborted group: StepCut, re-formed below)
            return call()
        except Exception as exc:
            run.failed(exc)
            run.cut_between_steps = True
            log.warning("lightning_collective_dropped", step=run.worker.step, generation=run.worker.generation,
                        error=str(exc)[:200], note="outside a step: the rank's own value stands in for the "
                                                   "group's, and for its collectives until its next step")
            return own

    # ---- the end ------------------------------------------------------------------------

    def on_exception(self, exception: BaseException) -> None:
        run = self._muster
        if run is not None and run.worker is not None and isinstance(exception, (Drained, RunEnded)):
            with run_ends(lambda: run.worker, lambda: run.worker.step):
                raise exception  # a drain or the run's end: a clean exit of the rank
        super().on_exception(exception)

    def teardown(self) -> None:
        run = self._muster
        if run is not None and run.worker is not None and not run.closing:
            run.closing = True
            atexit.register(run.worker.close)  # the group outlives fit(): validate(), test() after it
        super().teardown()


class _Due:
    """What the train loader yields under Muster: the step's batch is drawn in training_step."""


class _Steps(torch.utils.data.IterableDataset):
    """max_steps placeholders, ending where the loop's progress says (a joiner's loop counted from 0
    before it took the others' progress): Lightning fetches batch k + 1 in step k, before counting it."""

    def __init__(self, length: int, progress):
        self.length, self.progress = length, progress

    def __len__(self) -> int:
        return self.length

    def __iter__(self):
        yield _Due()
        while self.progress.current.ready + 1 < self.length:
            yield _Due()


class _Run:
    """One process's training under the library: its worker, the data position, the step in flight."""

    def __init__(self, strategy: MusterDDPStrategy, config: WorkerConfig):
        self.strategy, self.config = strategy, config
        self.worker: Worker | None = None  # made and started at the first training step
        self.module: torch.nn.Module | None = None  # what the library's DDP wrapper wraps (_setup_model)
        self.data: Positions | None = None
        self.consumed = 0  # samples the job consumed: the data position
        self.span = 0  # samples the step in flight consumes
        self.micro = 0  # the step's micro-batch in flight (accumulate_grad_batches)
        self.rng: dict = {}  # the RNG as the step in flight began
        self.in_step = False
        self.cut_between_steps = False  # a collective outside a step failed: the rank's own values until its next
        self.began = 0.0
        self.closing = False
        self.position = _Position(self)

    @property
    def trainer(self):
        return self.strategy.lightning_module.trainer

    def epoch(self) -> float:
        """The data epoch: the samples consumed over the dataset's size."""
        return self.consumed / self.data.samples if self.data is not None else 0.0

    def refuse_unsupported(self, trainer) -> None:
        why = []
        if trainer.max_steps is None or trainer.max_steps < 0:
            why.append("set max_steps (the steps an epoch takes change with the world)")
        if not trainer.lightning_module.automatic_optimization:
            why.append("manual optimization: the step the library redoes is Lightning's closure")
        if trainer.limit_train_batches not in (None, 1.0):
            why.append("limit_train_batches: bound the run with max_steps")
        s = self.strategy
        if s._ddp_comm_hook is not None or s._model_averaging_period is not None:
            why.append("DDP communication hooks and model averaging: the library's DDP wrapper is plain")
        sharded = [m for m in trainer.lightning_module.modules() if type(m).__name__.startswith(("FSDP", "FullyShard"))]
        if sharded or any(type(o).__name__ == "ZeroRedundancyOptimizer" for o in s.optimizers):
            why.append(SHARDED.format(what="Lightning's FSDPStrategy and ModelParallelStrategy"))
        if len(s.optimizers) > 1:
            why.append("more than one optimizer")
        refuse("lightning", why)
        if not any(isinstance(c, _Position) for c in trainer.callbacks):
            trainer.callbacks.append(self.position)  # the position, in Lightning's checkpoints

    def loader(self, dataloader) -> torch.utils.data.DataLoader:
        dataset = getattr(dataloader, "dataset", None)
        batch_size = getattr(dataloader, "batch_size", None)
        why = []
        if dataset is None or isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
            why.append("the train dataset must be map-style (indexable, with a length): the position indexes it")
        if batch_size is None:
            why.append("the train DataLoader needs a batch_size (a batch_sampler is not used)")
        refuse("lightning", why)
        seed = int(os.environ.get("PL_GLOBAL_SEED", "0"))  # seed_everything's
        self.data = Positions(dataset, dataloader.collate_fn, batch_size, seed)
        t = self.trainer
        steps = _Steps(t.max_steps * t.accumulate_grad_batches, t.fit_loop.epoch_loop.batch_progress)
        return torch.utils.data.DataLoader(steps, batch_size=None, collate_fn=lambda d: d)

    # ---- the step ---------------------------------------------------------------------

    def draw(self):
        """The micro-batch in flight for this rank in the current group, moved as Lightning moves batches."""
        w, t, s = self.worker, self.trainer, self.strategy
        batch = self.data.micro_batch(self.consumed, w, self.micro)
        self.span = w.world_size * self.data.batch_size * t.accumulate_grad_batches
        batch = t.lightning_module._on_before_batch_transfer(t.precision_plugin.convert_input(batch))
        batch = super(MusterDDPStrategy, s).batch_to_device(batch)
        t._results.batch, t._results.batch_size = batch, None  # (the loop saw the placeholder)
        return batch

    def begin_step(self) -> None:
        if self.worker is None:
            self.start()
        else:
            self.worker.step_begins()  # (Drained past the drain's step)
            self.worker.boundary()  # a membership change due: the last step's callbacks and logging are done
        self.began = time.perf_counter()
        self.rng, self.in_step, self.micro, self.cut_between_steps = rng(), True, 0, False

    def start(self) -> None:
        """Join the job at the first step: a replacement receives the state here."""
        s = self.strategy
        self.worker = Worker(self.config).register(model=s.lightning_module, optimizer=s.optimizers[0],
                                                   lightning=_Progress(self))
        self.worker.step = self.trainer.global_step
        dist.destroy_process_group()  # this process's own (alone()): the library forms the job's
        self.worker.start()
        s.set_world_ranks()

    def redone(self, closure, last: bool):
        """The micro-batch's closure (gradients synchronised on the step's `last`); after a failed
        collective, in the new group, the step's micro-batches before it again, then it, until it completes.
        (A redo's closures are this one's: each draws the micro-batch in flight, and only the step's
        first zeroes the gradients, which the failure discarded anyway.)"""
        def attempt():
            if not self.in_step:  # the step's first micro-batch joins the job (the first step) or takes a change due
                self.begin_step()
            k, redo = self.micro, False
            while True:
                try:
                    for j in range(k if redo else 0):
                        self.micro = j
                        with self.unsynced():
                            closure()
                    self.micro = k
                    with contextlib.nullcontext() if last else self.unsynced():
                        out = closure()
                    self.micro = k + 1
                    return out
                except Exception as exc:
                    self.failed(exc)
                    set_rng(self.rng)  # the redo draws what the attempt drew (or, state received, what the others did)
                    redo = True
        return attempt

    def unsynced(self):
        """The library's DDP wrapper of this generation, its gradients accumulated without all-reducing."""
        return self.worker.ddp(self.module, **self.strategy._ddp_kwargs).no_sync()

    def failed(self, exc: Exception) -> None:
        """A collective failed: re-formed (the library discarded the step's gradients), or raise."""
        if isinstance(exc, WorkerError) or not self.worker.step_failed(exc):
            raise exc
        self.strategy.set_world_ranks()

    def step_completed(self) -> None:
        """The optimizer stepped: count the step, move the position."""
        self.consumed += self.span
        self.in_step = False
        self.worker.step_done(int((time.perf_counter() - self.began) * 1e6), at_boundary=False)


class _Place(ClusterEnvironment):
    """The strategy's rank and world: the worker's group once joined, a world of one before."""

    def __init__(self, run: _Run):
        super().__init__()
        self.run, self.config = run, run.config

    @property
    def _worker(self) -> Worker | None:
        w = self.run.worker
        return w if w is not None and w.world_size else None

    @property
    def creates_processes_externally(self) -> bool:
        return True  # the agent starts the ranks

    @property
    def main_address(self) -> str:
        return self.config.host

    @property
    def main_port(self) -> int:
        return 0  # the library's groups have their own stores

    @staticmethod
    def detect() -> bool:
        return False

    def world_size(self) -> int:
        w = self._worker
        return w.world_size if w is not None else 1

    def set_world_size(self, size: int) -> None:
        pass  # the library's generations set it

    def global_rank(self) -> int:
        # before joining, the launch's rank: one process does rank-zero set-up (a logger's directory)
        w = self._worker
        return w.rank if w is not None else int(os.environ.get("RANK", "0"))

    def set_global_rank(self, rank: int) -> None:
        pass

    def local_rank(self) -> int:
        return self.config.local_rank

    def node_rank(self) -> int:
        return int(os.environ.get("GROUP_RANK", "0"))


# ModelCheckpoint's record of its last save, not in its state_dict (a resumed process starts anew): a
# joiner without it saves again at train end, in collectives the others, who saved, never run.
_LAST_SAVE = ("_last_global_step_saved", "_last_checkpoint_saved")


class _Progress:
    """The training state besides model and optimizer, as one extra of the library's state: what a
    joiner needs to stand where the others stand, at their next training step."""

    def __init__(self, run: _Run):
        self.run = run

    def _loops(self) -> dict:
        fit = self.run.trainer.fit_loop
        epoch = fit.epoch_loop
        return {"epoch": fit.epoch_progress, "batch": epoch.batch_progress, "scheduler": epoch.scheduler_progress,
                "optimizer": epoch.automatic_optimization.optim_progress}

    def state_dict(self) -> dict:
        run, t = self.run, self.run.trainer
        scaler = getattr(t.precision_plugin, "scaler", None)
        return {"loops": {k: p.state_dict() for k, p in self._loops().items()},
                "batches_that_stepped": t.fit_loop.epoch_loop._batches_that_stepped,
                "consumed": run.consumed, "rng": run.rng if run.in_step else rng(),
                "schedulers": [c.scheduler.state_dict() for c in t.lr_scheduler_configs],
                "callbacks": {c.state_key: c.state_dict() for c in t.callbacks if not isinstance(c, _Position)},
                "saves": {c.state_key: {a: getattr(c, a) for a in _LAST_SAVE} for c in t.callbacks
                          if isinstance(c, ModelCheckpoint)},
                "scaler": scaler.state_dict() if scaler is not None else None}

    def load_state_dict(self, d: dict) -> None:
        run, t = self.run, self.run.trainer
        for k, p in self._loops().items():
            p.load_state_dict(d["loops"][k])
        t.fit_loop.epoch_loop._batches_that_stepped = d["batches_that_stepped"]
        run.consumed, run.rng = d["consumed"], d["rng"]
        set_rng(run.rng)
        for c, state in zip(t.lr_scheduler_configs, d["schedulers"]):
            c.scheduler.load_state_dict(dict(state))
        for c in t.callbacks:
            if c.state_key in d["callbacks"]:
                c.load_state_dict(dict(d["callbacks"][c.state_key]))
            for a, v in d["saves"].get(c.state_key, {}).items():
                setattr(c, a, v)
        if d["scaler"] is not None:
            t.precision_plugin.scaler.load_state_dict(d["scaler"])


class _Position(Callback):
    """The data position in Lightning's checkpoints: a run resumed from one (ckpt_path) reads on from it."""

    def __init__(self, run: _Run):
        self.run = run

    def state_dict(self) -> dict:
        return {"consumed": self.run.consumed}

    def load_state_dict(self, state_dict: dict) -> None:
        self.run.consumed = state_dict["consumed"]
