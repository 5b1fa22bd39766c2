"""An Accelerate script with a hand-written loop: a small GPT-2 built from a config, a dataset of random
tokens, AdamW with a warm-up schedule, DDP over gloo on CPU, `accelerator.save_state` every few steps,
resumed from the last one at start. It stands for the scripts people run under torchrun or
`accelerate launch`. Needs `pip install transformers accelerate` (not a Muster dependency).

With `--resilient` it runs the one line of Muster's Accelerate integration
(`muster.worker.integrations.accelerate.resilient(max_steps=...)`, docs/guide/accelerate.md): under
`muster run` a lost rank's survivors re-form in-process and its replacement takes the state from them
(no checkpoint is resumed then: a replacement's state comes from its peers).

    muster run --coordinator HOST:PORT --job NAME --slots 2 -- python examples/train_accelerate.py --checkpoint-dir /tmp/ckpt [--resilient]

Each completed step prints one JSON record ({"event": "step", ...}, the keys of
examples/train_plain.py): the benchmarks and tests read those.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, Dataset
from transformers import GPT2Config, GPT2LMHeadModel

from muster.worker.integrations import accelerate as muster_accelerate

VOCAB, CONTEXT, BATCH = 512, 64, 4


class RandomTokens(Dataset):
    """Random token ids, the same for an index on every run."""

    def __init__(self, samples: int):
        self.samples = samples

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, VOCAB, (CONTEXT,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def last_checkpoint(directory: Path) -> Path | None:
    """The newest state save_state finished (its `done` marker is written after it)."""
    done = [d for d in directory.glob("step-*") if (d / "done").exists()]
    return max(done, key=lambda d: int(d.name.split("-")[1])) if done else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--checkpoint-dir", type=Path, required=True)
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument("--samples", type=int, default=100_000, help="the dataset's size (an epoch)")
    p.add_argument("--log-every", type=int, default=0, help="print rank 0's loss every N steps (0: never)")
    p.add_argument("--until-world", type=int, default=0,
                   help="after --steps, go on (up to 10x) to the first step run by this many ranks (a test's: "
                        "a replacement's imports take what they take)")
    p.add_argument("--resilient", action="store_true",
                   help="Muster's Accelerate integration: survivors re-form in-process (its one line)")
    args = p.parse_args()
    last_step = args.steps * (10 if args.until_world else 1)
    if args.resilient:
        muster_accelerate.resilient(max_steps=last_step)  # the one line: before Accelerator()
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=CONTEXT, n_embd=64, n_layer=2, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
    loader = DataLoader(RandomTokens(args.samples), batch_size=BATCH, shuffle=True,
                        generator=torch.Generator().manual_seed(0))
    model, optimizer, loader, warmup = accelerator.prepare(model, optimizer, loader, warmup)
    last = None if args.resilient else last_checkpoint(args.checkpoint_dir)
    step = resumed_from = 0
    if last is not None:
        accelerator.load_state(str(last))
        step = resumed_from = int(last.name.split("-")[1])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    epochs = 0
    while step < last_step:
        batches = loader if last is None or epochs else accelerator.skip_first_batches(loader, step % len(loader))
        epochs += 1
        for batch in batches:
            if args.step_sleep:
                time.sleep(args.step_sleep)
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            warmup.step()
            optimizer.zero_grad()
            w = muster_accelerate.worker(accelerator)
            if w is not None and w.step == step:
                continue  # a discarded attempt (the group re-formed): the loader gives the step again
            step = w.step if w is not None else step + 1
            record = {"event": "step", "step": step, "rank": accelerator.process_index,
                      "world_size": accelerator.num_processes, "generation": restart, "resumed_from": resumed_from,
                      "restart_count": restart, "pid": os.getpid(), "time": time.time(),
                      "epoch": step * accelerator.num_processes * BATCH / args.samples,
                      "lr": optimizer.param_groups[0]["lr"]}
            if w is not None:  # the library's generation, the data epoch and the state's fingerprint
                record.update(generation=w.generation, epoch=muster_accelerate.epoch(accelerator),
                              digest=w.state.fingerprint(w.device).hex())
            out = [record]
            if args.log_every and step % args.log_every == 0 and accelerator.is_main_process:
                out.append({"event": "loss", "step": step, "loss": loss.item()})
            # one write per record: ranks may share a stdout (torchrun)
            sys.stdout.write("".join(json.dumps(r) + "\n" for r in out))
            sys.stdout.flush()
            if not args.resilient and step % args.checkpoint_every == 0:
                target = args.checkpoint_dir / f"step-{step}"
                accelerator.save_state(str(target))
                accelerator.wait_for_everyone()
                if accelerator.is_main_process:
                    (target / "done").touch()
            if args.until_world and step >= args.steps and accelerator.num_processes == args.until_world:
                last_step = step  # every rank of the group sees the same step and world
            if step >= last_step:
                break
        if muster_accelerate.worker(accelerator) is not None:
            break  # under Muster one pass over the train loader spans the run
    return 0


if __name__ == "__main__":
    sys.exit(main())
