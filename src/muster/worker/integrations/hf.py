"""Hugging Face `Trainer` on the worker library: one line, and a lost rank's survivors re-form
in-process while the replacement takes the state from its peers.

    from muster.worker.integrations import hf
    hf.resilient()   # before TrainingArguments; every Trainer this process makes then re-forms in-process

Outside Muster (no MUSTER_JOB: plain python, torchrun) the call does nothing. Under `muster run`:

- **Who forms the group.** TrainingArguments would start torch.distributed itself (accelerate's
  PartialState, env://); the library forms every generation's group instead, so the call hides
  WORLD_SIZE/LOCAL_RANK from accelerate and the rank joins at its first step, once its model,
  optimizer and scheduler exist: a replacement's setup (imports, model, Trainer) runs while the
  others train, and it enters where they are, before the next step's first collective. Each
  formation tells accelerate's state the group's rank and world size.
- **A step.** The update step is the unit: its micro-batches are drawn (below), the token count
  gathered (get_batch_samples), forward and backward run through the library's DDP wrapper on the
  current group (`worker.ddp`; accelerate's own wrapper is not built: its constructor's collectives
  would pair with the others' steps). A collective that fails anywhere in it, or the library's
  step guards cutting it short on an abort, discards it (gradients zeroed, RNG back to the step's
  start), the group re-forms, the step's micro-batches are drawn again for the new group and
  redone, and the Trainer's loop goes on at the same global step: its optimizer and scheduler
  step once, for the step that completed.
- **The state.** Model, optimizer (the torch one inside accelerate's), and as one extra: the LR
  scheduler, the TrainerState's counters (global step, epoch, best metric, FLOs), the RNG as the
  step began, the gradient scaler, and the data position. A joiner receives it all in place, with
  no checkpoint read.
- **The data.** One number, the samples the job consumed, is the position: step s's samples are
  the next world x batch x accumulation positions of a seeded permutation per epoch (args.data_seed
  or args.seed), rank r's micro-batch k the slice (k x world + r) x batch. A shrink or grow draws
  the redone step and the next ones from the same position for the new world: no sample is skipped
  or seen twice. The per-device batch and accumulation are kept, so the global batch follows the
  world (3/4 of it while a rank of 4 is replaced). The Trainer's epoch counter is a loop counter
  only; TrainerState.epoch is the position over the dataset's size.
- **The step's end.** A step counts (the library's step) when the Trainer's step ends; a membership
  change is taken after its logging and checkpoint, where every rank and a joiner stand before the
  next step's first collective. A fault inside the logging or checkpoint collectives drops that
  step's log line, evaluation or checkpoint (the next comes at its step): ranks that had not
  finished the step take the completed state and are already at the next one.

What it refuses (ValueError, at train()): epoch-based schedules (set max_steps), "epoch" logging,
evaluation or save strategies, iterable datasets, include_num_input_tokens_seen, FSDP and
DeepSpeed (sharded state: see docs/guide/hugging-face.md). Tested with transformers 5.24 and
accelerate 1.15 on CPU/gloo; it patches Trainer methods those versions have
(get_train_dataloader, get_batch_samples, training_step, _wrap_model, _maybe_log_save_evaluate).
"""

from __future__ import annotations

import atexit
import contextlib
import time
from typing import Any

import structlog
import torch
import torch.distributed as dist
from transformers import Trainer, TrainerCallback

from muster.worker.integrations.common import (SHARDED, Positions, Replicated, alone, refuse, rng, run_ends,
                                               set_rng, tell_accelerate, under_muster)
from muster.worker.library.api import Worker
from muster.worker.library.config import WorkerConfig

log = structlog.get_logger(__name__)

_config: WorkerConfig | None = None  # set by resilient() under Muster
_ORIGINAL: dict[str, Any] = {}  # the Trainer methods replaced
# TrainerState fields every rank holds alike (log_history is per rank: timings)
_STATE_FIELDS = ("global_step", "epoch", "max_steps", "total_flos", "best_metric", "best_global_step",
                 "best_model_checkpoint")


def resilient() -> bool:
    """Make every `transformers.Trainer` (and subclass) of this process re-form in-process under
    Muster. Call it before creating TrainingArguments. False (and nothing changed): not under Muster."""
    global _config
    if _config is not None:
        return True
    _config = under_muster("hf")
    if _config is None:
        return False
    alone(hide_world=True)
    for name in ("train", "get_train_dataloader", "_wrap_model", "get_batch_samples", "training_step",
                 "_maybe_log_save_evaluate"):
        _ORIGINAL[name] = getattr(Trainer, name)
        setattr(Trainer, name, globals()[f"_{name.lstrip('_')}"])
    return True


def worker(trainer) -> Worker | None:
    """The worker a Trainer's run trains with (None: not under Muster, or before its first step):
    its rank, world size, generation and state's fingerprint, for a script's records."""
    run = trainer.__dict__.get("_muster")
    return run.worker if run is not None else None


# ---- the Trainer's methods, replaced ----------------------------------------------------


def _train(self, *args, **kwargs):
    _refuse_unsupported(self)
    run = self.__dict__.get("_muster") or _Run(self)
    self._muster = run
    self.args.ignore_data_skip = True  # a resumed run's data position is its checkpoint's epoch (_Run.start)
    if not any(isinstance(c, _StepEnd) for c in self.callback_handler.callbacks):
        self.callback_handler.callbacks.insert(0, _StepEnd(run))  # first: the others see the position's epoch
    with run_ends(lambda: run.worker, lambda: self.state.global_step):
        out = _ORIGINAL["train"](self, *args, **kwargs)
    if run.worker is not None:
        atexit.register(run.worker.close)  # the group outlives train(): evaluate(), save_model() after it
    return out


def _get_train_dataloader(self):
    loader = _ORIGINAL["get_train_dataloader"](self)  # never iterated: its dataset and collator, columns removed
    run = self.__dict__.get("_muster")
    if run is None:
        return loader
    run.data = Positions(loader.dataset, loader.collate_fn, self._train_batch_size,
                         self.args.data_seed if self.args.data_seed is not None else self.args.seed)
    return _Loader(run.data, self.args.gradient_accumulation_steps)


def _wrap_model(self, model, training: bool = True, dataloader=None):
    if training and "_muster" in self.__dict__:
        return Replicated(self.model)  # its steps call the library's wrapper themselves (_forward_backward)
    return _ORIGINAL["_wrap_model"](self, model, training, dataloader)


def _get_batch_samples(self, epoch_iterator, num_batches: int, device):
    run = self.__dict__.get("_muster")
    if run is None:
        return _ORIGINAL["get_batch_samples"](self, epoch_iterator, num_batches, device)
    return run.begin_step(num_batches, device)


def _training_step(self, model, inputs, num_items_in_batch=None):
    run = self.__dict__.get("_muster")
    if run is None:
        return _ORIGINAL["training_step"](self, model, inputs, num_items_in_batch)
    return run.micro_step()  # its own draw of the micro-batch: the Trainer's is stale after a reform


def _maybe_log_save_evaluate(self, *args, **kwargs):
    run = self.__dict__.get("_muster")
    if run is None:
        return _ORIGINAL["_maybe_log_save_evaluate"](self, *args, **kwargs)
    return run.step_end(lambda: _ORIGINAL["_maybe_log_save_evaluate"](self, *args, **kwargs))


def _refuse_unsupported(trainer) -> None:
    a = trainer.args
    why = []
    if a.max_steps <= 0:
        why.append("set max_steps (the step count of an epoch changes with the world)")
    for name in ("logging_strategy", "eval_strategy", "save_strategy"):
        if str(getattr(a, name, "")).lower().endswith("epoch"):
            why.append(f"{name}='epoch': use 'steps' (a joiner's loop does not count the others' epochs)")
    dataset = trainer.train_dataset
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
        why.append("the train dataset must be map-style (indexable, with a length): the position indexes it")
    if str(getattr(a, "include_num_input_tokens_seen", "no")).lower() not in ("no", "false"):
        why.append("include_num_input_tokens_seen: its gather runs outside the step's recovery")
    if trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled:
        why.append(SHARDED.format(what="accelerate's FSDP and DeepSpeed plugins"))
    refuse("hf", why)


# ---- one training run ---------------------------------------------------------------------


class _Run:
    """One Trainer's run under the library: its worker, the data position and the step in flight."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.worker: Worker | None = None  # made and started at the first step
        self.data: Positions | None = None
        self.consumed = 0  # samples the job consumed: the data position
        self.generation = 0  # the group accelerate was last told of
        self.ddp_kwargs: dict = {}
        self.rng: dict = {}  # the RNG as the step in flight began
        self.in_step = False
        self.batches: list = []
        self.num_items = None
        self.span = 0  # samples the step in flight consumes
        self.n = 0
        self.micro = 0  # the next micro-batch of the step
        self.redo = False  # the step's draw is stale: a reform happened since
        self.device = None
        self.began = 0.0
        self.ended = -1  # the global step whose end (logging, checkpoint) ran last

    def start(self) -> None:
        """Join the job at the first step: a replacement receives the state here."""
        t = self.trainer
        optimizer = getattr(t.optimizer, "optimizer", t.optimizer)  # the torch one inside accelerate's
        self.worker = Worker(_config).register(model=t.model, optimizer=optimizer, trainer=_TrainerProgress(self))
        if t.state.global_step and not self.consumed:  # resumed from a checkpoint: its epoch holds the position
            self.consumed = round((t.state.epoch or 0) * self.data.samples)
        handler = t.accelerator.ddp_handler
        self.ddp_kwargs = handler.to_kwargs() if handler is not None else {}
        self.worker.step = t.state.global_step
        if dist.is_initialized():
            dist.destroy_process_group()  # this process's own (resilient()): the library forms the job's
        self.worker.start()
        self._adopt()

    def begin_step(self, n: int, device) -> tuple[list, Any]:
        w = self.worker
        if w is None:
            self.start()
        else:
            w.step_begins()  # (Drained past the drain's step)
            w.boundary()  # a membership change due: the last step's logging and checkpoint are done
            self._adopt()
        self.began = time.perf_counter()
        self.n, self.device, self.micro = n, device, 0
        self.rng, self.in_step = rng(), True
        while True:
            try:
                self._draw()
                return self.batches, self.num_items
            except Exception as exc:
                self._failed(exc)

    def micro_step(self) -> torch.Tensor:
        k = self.micro
        while True:
            try:
                if self.redo:  # the group re-formed within this step: redraw it for the new one and catch up
                    self._draw()
                    for j in range(k):
                        self._forward_backward(j)
                loss = self._forward_backward(k)
                break
            except Exception as exc:
                self._failed(exc)
        self.micro = k + 1
        return loss

    def step_completed(self, state) -> None:
        """The Trainer's step ended (optimizer and scheduler stepped): count it, move the position."""
        self.consumed += self.span
        state.epoch = self.consumed / self.data.samples
        self.in_step = False
        self.worker.step_done(int((time.perf_counter() - self.began) * 1e6), at_boundary=False)

    def step_end(self, call) -> None:
        step = self.trainer.state.global_step
        if step == self.ended:
            return  # the epoch's end right after its last step's: nothing new (a joiner's loop has no such call)
        self.ended = step
        try:
            self.worker.check_group()  # (its collectives never started on an aborted group)
            call()
        except Exception as exc:
            self._failed(exc)
            log.warning("hf_step_end_dropped", step=step, generation=self.worker.generation, error=str(exc)[:200],
                        note="the step completed; its log, evaluation or checkpoint is not redone")

    def _draw(self) -> None:
        """The step's micro-batches for this rank in the current group, and their token count (gathered)."""
        w = self.worker
        self.batches = [self.data.micro_batch(self.consumed, w, k) for k in range(self.n)]
        self.span = w.world_size * self.data.batch_size * self.n
        _, self.num_items = _ORIGINAL["get_batch_samples"](self.trainer, iter(self.batches), self.n, self.device)
        self.redo = False

    def _forward_backward(self, k: int) -> torch.Tensor:
        t = self.trainer
        ddp = self.worker.ddp(t.model, **self.ddp_kwargs)
        last = k == len(self.batches) - 1  # the step's last micro-batch all-reduces the accumulated gradients
        with contextlib.nullcontext() if last else ddp.no_sync():
            return _ORIGINAL["training_step"](t, ddp, self.batches[k], self.num_items)

    def _failed(self, exc: Exception) -> None:
        """A collective of the step failed: re-formed (the library discarded the step's gradients), or raise."""
        if not self.worker.step_failed(exc):
            raise exc
        self._adopt()
        if self.in_step:
            set_rng(self.rng)  # the redo draws what the attempt drew (or, state received, what the others did)
        self.redo = True

    def _adopt(self) -> None:
        """Tell accelerate (and the environment, for the script) this rank's place in the group formed."""
        w = self.worker
        if w.generation == self.generation:
            return
        self.generation = w.generation
        tell_accelerate(w)
        state = self.trainer.state
        state.is_world_process_zero, state.is_local_process_zero = w.rank == 0, w.config.local_rank == 0


class _TrainerProgress:
    """The Trainer's state besides model and optimizer, as one extra of the library's state."""

    def __init__(self, run: _Run):
        self.run = run

    def state_dict(self) -> dict:
        run, t = self.run, self.run.trainer
        scaler = getattr(t.accelerator, "scaler", None)
        return {"state": {k: getattr(t.state, k) for k in _STATE_FIELDS}, "last_logged": t._globalstep_last_logged,
                "consumed": run.consumed, "rng": run.rng if run.in_step else rng(),
                "scheduler": t.lr_scheduler.state_dict() if t.lr_scheduler is not None else None,
                "scaler": scaler.state_dict() if scaler is not None else None}

    def load_state_dict(self, d: dict) -> None:
        run, t = self.run, self.run.trainer
        for k, v in d["state"].items():
            setattr(t.state, k, v)
        t._globalstep_last_logged = d["last_logged"]
        run.consumed = d["consumed"]
        run.rng = d["rng"]
        set_rng(run.rng)
        if d["scheduler"] is not None:
            t.lr_scheduler.load_state_dict(dict(d["scheduler"]))
        if d["scaler"] is not None:
            t.accelerator.scaler.load_state_dict(d["scaler"])


class _StepEnd(TrainerCallback):
    """Counts the step as the Trainer's ends."""

    def __init__(self, run: _Run):
        self.run = run

    def on_step_end(self, args, state, control, **kwargs):
        self.run.step_completed(state)


class _Loader:
    """The Trainer's train dataloader under Muster: its length bounds the Trainer's loop (a world of
    one's batches, a whole number of accumulation steps: at least the steps any world takes); the
    batches are drawn by position (get_batch_samples), never from this iterator."""

    def __init__(self, data: Positions, accumulation: int):
        self.dataset, self.batch_size = data.dataset, data.batch_size
        self.length = max(accumulation, data.samples // data.batch_size // accumulation * accumulation)

    def __len__(self) -> int:
        return self.length

    def __iter__(self):
        return iter(())
