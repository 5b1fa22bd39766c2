"""Accelerate hand-written loops on the worker library: one line, and a lost rank's survivors re-form
in-process while the replacement takes the state from its peers.

    from muster.worker.integrations import accelerate as muster_accelerate
    muster_accelerate.resilient(max_steps=1000)   # the line: before Accelerator()
    accelerator = Accelerator()
    model, optimizer, train_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, scheduler)
    for batch in train_dl:
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step(); scheduler.step(); optimizer.zero_grad()

Outside Muster (no MUSTER_JOB: plain python, accelerate launch, torchrun) the call does nothing.
Under `muster run`:

- **Who forms the group.** Accelerator() would start torch.distributed itself (env://); the call
  hides WORLD_SIZE/LOCAL_RANK so it sees a process alone, and the library forms every generation's
  group. The rank joins the job at its first batch (the train loader's first `next`), once model,
  optimizer and scheduler are prepared: a replacement's set-up runs while the others train. Each
  formation tells accelerate's state the group's rank and world size.
- **A step.** A batch drawn from the train loader begins the step; the prepared optimizer's
  `step()` ends it. prepare() returns the model unwrapped (no DDP of accelerate's: its constructor's
  collectives would pair with the others' steps); its training forward goes through the library's
  DDP wrapper on the current group (`worker.ddp`). A collective that fails in the step (the forward,
  `accelerator.backward`, a gather or reduce), or the library's guards cutting it short on an
  abort, discards the attempt: the group re-forms, the RNG goes back to the step's start, the rest
  of the attempt runs without collectives or effect (backward is skipped, `optimizer.step()` and
  the scheduler's step are skipped as accelerate skips an overflowed step, the gradients are
  zeroed), and the loader's next batch is the same step drawn for the new group. A script counting
  its loop's iterations counts the discarded attempt too; the step count is `worker(accelerator).step`.
- **The state.** Model, optimizer (the torch one inside accelerate's), and as one extra: the LR
  schedulers, the RNG as the step began, the gradient scaler and the data position. A joiner
  receives it all in place, with no checkpoint read.
- **The data.** The first DataLoader prepared is the train loader: one pass over it spans the run
  (`max_steps` batches; a later pass yields nothing), each batch drawn by position
  (common.Positions: rank r's slice of the next world x batch samples of a seeded permutation per
  epoch, the seed `resilient(seed=)`). The per-device batch is kept, so the global batch follows the
  world. Other loaders (evaluation) are prepared unsharded: every rank reads all of it.
- **Collectives outside a step** (`gather`, `reduce`, `wait_for_everyone` after the step, for
  logging) that fail re-form and give the rank's own value.

What it refuses (ValueError, at prepare): gradient accumulation (gradient_accumulation_steps > 1),
more than one model or optimizer, an iterable train dataset or one without a batch_size, and sharded
state (accelerate's FSDP, DeepSpeed and Megatron plugins, an FSDP module): see
docs/guide/accelerate.md. Tested with accelerate 1.15 on CPU/gloo; it patches Accelerator.prepare,
backward, gather, reduce, wait_for_everyone and unwrap_model.
"""

from __future__ import annotations

import atexit
import time
from typing import Any

import structlog
import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils import send_to_device

from muster.worker.integrations.common import (SHARDED, Positions, Replicated, alone, refuse, rng, run_ends,
                                               set_rng, tell_accelerate, under_muster)
from muster.worker.library.api import Worker
from muster.worker.library.config import WorkerConfig
from muster.worker.errors import WorkerError

log = structlog.get_logger(__name__)

_config: WorkerConfig | None = None  # set by resilient() under Muster
_run_steps = 0  # resilient(max_steps=)
_seed = 0
_ORIGINAL: dict[str, Any] = {}  # the Accelerator methods replaced


def resilient(max_steps: int, seed: int = 0) -> bool:
    """Make every `accelerate.Accelerator` of this process re-form in-process under Muster, training
    `max_steps` steps (one pass over the prepared train loader) with its data in a permutation seeded
    by `seed`. Call it before creating the Accelerator. False (and nothing changed): not under Muster."""
    global _config, _run_steps, _seed
    if not isinstance(max_steps, int) or max_steps <= 0:
        raise ValueError(f"max_steps must be a positive int (the run's steps), not {max_steps!r}")
    if _config is not None:
        return True
    _config = under_muster("accelerate")
    if _config is None:
        return False
    _run_steps, _seed = max_steps, seed
    alone(hide_world=True)
    for name in ("prepare", "backward", "gather", "reduce", "wait_for_everyone", "unwrap_model"):
        _ORIGINAL[name] = getattr(Accelerator, name)
        setattr(Accelerator, name, globals()[f"_{name}"])
    return True


def worker(accelerator: Accelerator) -> Worker | None:
    """The worker an Accelerator trains with (None: not under Muster, or before its first batch): its
    rank, world size, generation, completed steps and state's fingerprint, for a script's records."""
    run = accelerator.__dict__.get("_muster")
    return run.worker if run is not None else None


def epoch(accelerator: Accelerator) -> float:
    """The data epoch: the samples the job consumed over the train dataset's size (0 before training)."""
    run = accelerator.__dict__.get("_muster")
    return run.consumed / run.data.samples if run is not None and run.data is not None else 0.0


# ---- the Accelerator's methods, replaced ------------------------------------------------


def _prepare(self, *args, device_placement=None):
    prepared = _ORIGINAL["prepare"](self, *args, device_placement=device_placement)
    run = self.__dict__.get("_muster") or _Run(self)
    self._muster = run
    out = [run.take(given, made) for given, made in zip(args, prepared if len(args) > 1 else (prepared,))]
    return tuple(out) if len(out) > 1 else out[0]


def _backward(self, loss, **kwargs):
    run = self.__dict__.get("_muster")
    if run is None or run.worker is None:
        return _ORIGINAL["backward"](self, loss, **kwargs)
    if run.discarded:
        return None  # the attempt is discarded: nothing of it is trained on
    try:
        return _ORIGINAL["backward"](self, loss, **kwargs)
    except Exception as exc:
        run.failed(exc)
        return None


def _collective(name: str, own):
    """A collective that re-forms on a failure and gives the rank's own value (`own(*args)`); in a
    discarded attempt it is skipped: the group's others are in another step's collectives."""
    def call(self, *args, **kwargs):
        run = self.__dict__.get("_muster")
        if run is None or run.worker is None:
            return _ORIGINAL[name](self, *args, **kwargs)
        if run.discarded:
            return own(*args)
        try:
            run.worker.check_group()  # (never started on an aborted group: a lost peer would hold it)
            return _ORIGINAL[name](self, *args, **kwargs)
        except Exception as exc:
            run.failed(exc)
            log.warning("accelerate_collective_dropped", call=name, step=run.worker.step,
                        generation=run.worker.generation, error=str(exc)[:200],
                        note="the rank's own value stands in for the group's")
            return own(*args)
    return call


def _own_gathered(tensor, *_):
    return tensor.unsqueeze(0) if isinstance(tensor, torch.Tensor) and tensor.dim() == 0 else tensor


_gather = _collective("gather", _own_gathered)
_reduce = _collective("reduce", lambda tensor, *_: tensor)
_wait_for_everyone = _collective("wait_for_everyone", lambda: None)


def _unwrap_model(self, model, *args, **kwargs):
    if isinstance(model, Replicated):
        model = model.module
    return _ORIGINAL["unwrap_model"](self, model, *args, **kwargs)


# ---- one training run ---------------------------------------------------------------------


class _Model(Replicated):
    """The prepared model: training forwards through the library's DDP wrapper; a forward that fails
    (a collective, or the guards cutting the step short on an abort) re-forms, discards the attempt
    and runs the model alone (no collectives: its output is not trained on)."""

    def __init__(self, module: torch.nn.Module, run: _Run):
        super().__init__(module, run.ddp)
        self._run = run

    def forward(self, *args, **kwargs):
        run = self._run
        if run.worker is None or run.discarded:
            return self.module(*args, **kwargs)
        try:
            return super().forward(*args, **kwargs)
        except Exception as exc:
            run.failed(exc)
            return self.module(*args, **kwargs)


class _Run:
    """One Accelerator's training under the library: its worker, the data position, the step in flight."""

    def __init__(self, accelerator: Accelerator):
        self.accelerator = accelerator
        self.worker: Worker | None = None  # made and started at the first batch
        self.model: torch.nn.Module | None = None
        self.optimizer: AcceleratedOptimizer | None = None
        self.schedulers: list[AcceleratedScheduler] = []
        self.data: Positions | None = None
        self.consumed = 0  # samples the job consumed: the data position
        self.span = 0  # samples the step in flight consumes
        self.rng: dict = {}  # the RNG as the step in flight began
        self.in_step = False
        self.discarded = False  # the attempt in flight failed: the rest of it has no effect
        self.began = 0.0
        self.generation = 0  # the group accelerate was last told of
        handler = accelerator.ddp_handler
        self.ddp_kwargs = handler.to_kwargs() if handler is not None else {}

    def ddp(self, module: torch.nn.Module) -> torch.nn.Module:
        return self.worker.ddp(module, **self.ddp_kwargs)

    def take(self, given, made):
        """prepare()'s result for one object (`given` as the script passed it, `made` accelerate's)."""
        why = []
        if isinstance(made, torch.nn.Module):
            if self.model is not None:
                why.append("more than one model")
            self._refuse_unsupported(made, why)
            self.model = made
            return _Model(made, self)
        if isinstance(made, AcceleratedOptimizer):
            if self.optimizer is not None:
                why.append("more than one optimizer")
            refuse("accelerate", why)
            self.optimizer = made
            made.step = self._optimizer_step(made.step)  # (the instance's: its class's step stays accelerate's)
            return made
        if isinstance(made, AcceleratedScheduler):
            self.schedulers.append(made)
            return made
        if isinstance(given, torch.utils.data.DataLoader) and self.data is None:
            dataset = given.dataset
            if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
                why.append("the train dataset must be map-style (indexable, with a length): the position indexes it")
            if given.batch_size is None:
                why.append("the train DataLoader needs a batch_size (a batch_sampler is not used)")
            refuse("accelerate", why)
            self.data = Positions(dataset, given.collate_fn, given.batch_size, _seed)
            return _Loader(self)
        return made

    def _refuse_unsupported(self, model: torch.nn.Module, why: list[str]) -> None:
        a = self.accelerator
        if a.gradient_accumulation_steps > 1:
            why.append("gradient_accumulation_steps > 1: a discarded step would redo its earlier micro-batches")
        state = a.state
        sharded = [m for m in model.modules() if type(m).__name__.startswith(("FSDP", "FullyShard"))]
        if (sharded or getattr(state, "fsdp_plugin", None) is not None or getattr(state, "deepspeed_plugins", None)
                or getattr(state, "megatron_lm_plugin", None) is not None):
            why.append(SHARDED.format(what="accelerate's FSDP, DeepSpeed and Megatron plugins"))
        refuse("accelerate", why)

    # ---- the step ---------------------------------------------------------------------

    def next_batch(self):
        """The train loader's next batch: the step's for this rank in the current group (None: the run's
        steps are done). The first joins the job; each takes a membership change due first."""
        with run_ends(lambda: self.worker, lambda: self.worker.step if self.worker is not None else 0):
            if self.worker is None:
                self.start()
            else:
                self.worker.step_begins()  # (Drained past the drain's step)
                self.worker.boundary()  # a membership change due: the last step's tail is done
                self.adopt()
        w = self.worker
        if w.step >= _run_steps:
            return None
        if not self.in_step:  # (a discarded attempt's redo keeps the step's start: its RNG is back there)
            self.began, self.rng, self.in_step = time.perf_counter(), rng(), True
        self.discarded = False
        self.span = w.world_size * self.data.batch_size
        return send_to_device(self.data.micro_batch(self.consumed, w), self.accelerator.device)

    def start(self) -> None:
        """Join the job at the first batch: a replacement receives the state here."""
        if self.model is None or self.optimizer is None:
            raise ValueError("muster.worker.integrations.accelerate: prepare() the model and the optimizer "
                             "before drawing from the train loader (the state a joiner receives)")
        self.worker = Worker(_config).register(model=self.model, optimizer=self.optimizer.optimizer,
                                               accelerate=_Progress(self))
        if dist.is_initialized():
            dist.destroy_process_group()  # this process's own (resilient()): the library forms the job's
        self.worker.start()
        atexit.register(self.worker.close)  # the group outlives the loop: an evaluation, a save after it
        self.adopt()

    def _optimizer_step(self, step):
        def stepped(closure=None):
            if self.worker is None:
                return step(closure)
            if self.discarded or not self.in_step:  # nothing to step on: skipped as an overflowed step is
                self.optimizer._is_overflow = True  # (the AcceleratedSchedulers skip their step with it)
                self.optimizer.optimizer.zero_grad(set_to_none=True)
                return None
            out = step(closure)
            if self.optimizer.scaler is None:
                self.optimizer._is_overflow = False
            self.step_completed()
            return out
        return stepped

    def step_completed(self) -> None:
        """The optimizer stepped: count the step, move the position."""
        self.consumed += self.span
        self.in_step = False
        self.worker.step_done(int((time.perf_counter() - self.began) * 1e6), at_boundary=False)

    def failed(self, exc: Exception) -> None:
        """A collective failed: re-formed (the library discarded the step's gradients), or raise."""
        if isinstance(exc, WorkerError) or not self.worker.step_failed(exc):
            raise exc
        self.adopt()
        if self.in_step:
            set_rng(self.rng)  # the redo draws what the attempt drew (or, state received, what the others did)
            self.discarded = True

    def adopt(self) -> None:
        if self.worker.generation != self.generation:
            self.generation = self.worker.generation
            tell_accelerate(self.worker)


class _Progress:
    """The training state besides model and optimizer, as one extra of the library's state."""

    def __init__(self, run: _Run):
        self.run = run

    def state_dict(self) -> dict:
        run = self.run
        scaler = run.accelerator.scaler
        return {"consumed": run.consumed, "rng": run.rng if run.in_step else rng(),
                "schedulers": [s.scheduler.state_dict() for s in run.schedulers],
                "scaler": scaler.state_dict() if scaler is not None else None}

    def load_state_dict(self, d: dict) -> None:
        run = self.run
        run.consumed, run.rng = d["consumed"], d["rng"]
        set_rng(run.rng)
        for s, state in zip(run.schedulers, d["schedulers"]):
            s.scheduler.load_state_dict(dict(state))
        if d["scaler"] is not None:
            run.accelerator.scaler.load_state_dict(d["scaler"])


class _Loader:
    """The prepared train loader under Muster: one pass spans the run, each batch drawn by position for
    the group the step runs in (a discarded attempt's redo: the same step again)."""

    def __init__(self, run: _Run):
        self.run = run
        self.dataset, self.batch_size = run.data.dataset, run.data.batch_size

    def __len__(self) -> int:
        return _run_steps

    def __iter__(self):
        while (batch := self.run.next_batch()) is not None:
            yield batch
