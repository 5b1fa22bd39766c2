"""A Hugging Face Trainer script: a small GPT-2 built from a config, a dataset of random tokens,
DDP over gloo on CPU, a checkpoint every few steps (`save_steps`), resumed from the last one at start.
It stands for the scripts people run under torchrun; the benchmarks time its restarts. Needs
`pip install transformers accelerate` (not a Muster dependency).

With `--resilient` it runs the one line of Muster's Hugging Face integration
(`muster.worker.integrations.hf.resilient()`, docs/guide/hugging-face.md): under `muster run` a
lost rank's survivors re-form in-process and its replacement takes the state from them (no
checkpoint is resumed then: a replacement's state comes from its peers).

    muster run --coordinator HOST:PORT --job NAME --slots 2 -- python examples/train_trainer.py --checkpoint-dir /tmp/ckpt [--resilient]

Each completed step prints one JSON record ({"event": "step", ...}, the keys of
examples/train_plain.py) from a TrainerCallback: the benchmarks read those.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from muster.worker.integrations import hf

VOCAB, CONTEXT = 512, 64


class RandomTokens(Dataset):
    """Random token ids, the same for an index on every run: a map-style dataset, as most are, so
    a resumed Trainer skips the batches it has seen by index instead of producing them again."""

    def __init__(self, samples: int):
        self.samples = samples

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, VOCAB, (CONTEXT,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


class StepRecords(TrainerCallback):
    def __init__(self, step_sleep_s: float, resumed_from: int, steps: int, until_world: int):
        self.step_sleep_s, self.resumed_from = step_sleep_s, resumed_from
        self.steps, self.until_world = steps, until_world
        self.trainer = None  # set once made

    def on_step_begin(self, args, state, control, **kwargs):
        if self.step_sleep_s:
            time.sleep(self.step_sleep_s)

    def on_step_end(self, args, state, control, **kwargs):
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        record = {"event": "step", "step": state.global_step, "rank": args.process_index,
                  "world_size": args.world_size, "generation": restart, "resumed_from": self.resumed_from,
                  "restart_count": restart, "master": f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}",
                  "pid": os.getpid(), "time": time.time(), "epoch": state.epoch}
        worker = hf.worker(self.trainer) if self.trainer is not None else None
        if worker is not None:  # the library's generation, and the state's fingerprint to compare replicas
            record.update(generation=worker.generation, digest=worker.state.fingerprint(worker.device).hex())
        # one write per record: ranks may share a stdout (torchrun)
        sys.stdout.write(json.dumps(record) + "\n")
        sys.stdout.flush()
        if self.until_world and state.global_step >= self.steps and args.world_size == self.until_world:
            control.should_training_stop = True  # every rank of the group sees the same step and world


class LossRecords(TrainerCallback):
    """The loss the Trainer logs (averaged over the ranks and the steps since the last log), from rank 0."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if args.process_index == 0 and logs and "loss" in logs:
            sys.stdout.write(json.dumps({"event": "loss", "step": state.global_step, "loss": logs["loss"]}) + "\n")
            sys.stdout.flush()


def last_complete_checkpoint(directory: Path) -> str | None:
    """The newest checkpoint the Trainer finished writing. It writes a checkpoint-N directory in
    place, trainer_state.json last: a rank killed during a save leaves one without it, which
    get_last_checkpoint would pick and train() would refuse ("Can't find a valid checkpoint")."""
    done = [d for d in directory.glob(f"{PREFIX_CHECKPOINT_DIR}-*") if (d / TRAINER_STATE_NAME).exists()]
    return str(max(done, key=lambda d: int(d.name.rsplit("-", 1)[1]))) if done else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--checkpoint-dir", type=Path, required=True)
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument("--samples", type=int, default=100_000, help="the dataset's size (an epoch)")
    p.add_argument("--accumulation", type=int, default=1, help="gradient accumulation steps")
    p.add_argument("--log-every", type=int, default=0, help="log the loss every N steps (0: never)")
    p.add_argument("--until-world", type=int, default=0,
                   help="after --steps, go on (up to 10x) to the first step run by this many ranks (a test's: "
                        "a replacement's imports take what they take)")
    p.add_argument("--resilient", action="store_true",
                   help="Muster's Hugging Face integration: survivors re-form in-process (its one line)")
    args = p.parse_args()
    if args.resilient:
        hf.resilient()  # the one line: before TrainingArguments
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=CONTEXT, n_embd=64, n_layer=2, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    last = None if args.resilient else last_complete_checkpoint(args.checkpoint_dir)
    training = TrainingArguments(
        output_dir=str(args.checkpoint_dir), max_steps=args.steps * (10 if args.until_world else 1),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=args.accumulation,
        learning_rate=1e-3, save_strategy="steps", save_steps=args.checkpoint_every, save_total_limit=2,
        logging_strategy="steps" if args.log_every else "no", logging_steps=args.log_every or 500, report_to=[], use_cpu=True, ddp_backend="gloo", dataloader_num_workers=0,
        disable_tqdm=True)
    resumed_from = int(last.rsplit("-", 1)[1]) if last else 0
    records = StepRecords(args.step_sleep, resumed_from, args.steps, args.until_world)
    trainer = records.trainer = Trainer(model=model, args=training, train_dataset=RandomTokens(args.samples),
                                        callbacks=[records, LossRecords()])
    trainer.train(resume_from_checkpoint=last)
    return 0


if __name__ == "__main__":
    sys.exit(main())
