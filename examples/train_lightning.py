"""A PyTorch Lightning script: a small MLP regression on a fixed random dataset, AdamW with a
warm-up schedule, DDP over gloo on CPU, a checkpoint every few steps (ModelCheckpoint), resumed from
the last one at start. It stands for the scripts people run under torchrun; the benchmarks time its
restarts. Needs `pip install lightning` (not a Muster dependency).

With `--resilient` it passes Muster's Lightning strategy (the one line:
`strategy=MusterDDPStrategy()`, docs/guide/lightning.md): under `muster run` a lost rank's survivors
re-form in-process and its replacement takes the state from them (no checkpoint is resumed then).

    muster run --coordinator HOST:PORT --job NAME --slots 2 -- python examples/train_lightning.py --checkpoint-dir /tmp/ckpt [--resilient]

Each completed step prints one JSON record ({"event": "step", ...}, the keys of
examples/train_plain.py) from a Callback: the benchmarks and tests read those.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

from muster.worker.integrations.lightning import MusterDDPStrategy

WIDTH = 64


class Regression(L.LightningModule):
    def __init__(self, steps: int):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(WIDTH, 256), torch.nn.ReLU(), torch.nn.Linear(256, WIDTH))
        self.steps = steps

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3)
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


class StepRecords(Callback):
    def __init__(self, step_sleep_s: float, resumed_from: int, log_every: int, steps: int, until_world: int):
        self.step_sleep_s, self.resumed_from, self.log_every = step_sleep_s, resumed_from, log_every
        self.steps, self.until_world = steps, until_world

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.step_sleep_s:
            time.sleep(self.step_sleep_s)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if (trainer.fit_loop.epoch_loop.batch_idx + 1) % trainer.accumulate_grad_batches:
            return  # a micro-batch before its step's last: the optimizer has not stepped (the loop's
            # batch_idx: a joiner's `batch_idx` argument counts from its own start)
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        record = {"event": "step", "step": trainer.global_step, "rank": trainer.global_rank,
                  "world_size": trainer.world_size, "generation": restart, "resumed_from": self.resumed_from,
                  "restart_count": restart, "batch_idx": trainer.fit_loop.epoch_loop.batch_idx, "epoch": trainer.current_epoch,
                  "master": f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}",
                  "pid": os.getpid(), "time": time.time()}
        run = trainer.strategy.run() if isinstance(trainer.strategy, MusterDDPStrategy) else None
        if run is not None:  # the library's generation, the data epoch and the state's fingerprint
            w = run.worker
            record.update(generation=w.generation, epoch=run.epoch(), digest=w.state.fingerprint(w.device).hex(),
                          lr=trainer.optimizers[0].param_groups[0]["lr"])
        out = [record]
        if self.log_every and trainer.global_step % self.log_every == 0 and trainer.global_rank == 0:
            out.append({"event": "loss", "step": trainer.global_step, "loss": float(outputs["loss"])})
        # one write per record: ranks may share a stdout (torchrun)
        sys.stdout.write("".join(json.dumps(r) + "\n" for r in out))
        sys.stdout.flush()
        if self.until_world and trainer.global_step >= self.steps and trainer.world_size == self.until_world:
            trainer.should_stop = True  # every rank of the group sees the same step and world


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--checkpoint-dir", type=Path, required=True)
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument("--samples", type=int, default=100_000, help="the dataset's size (an epoch)")
    p.add_argument("--batch", type=int, default=4, help="the per-device batch")
    p.add_argument("--accumulation", type=int, default=1, help="accumulate_grad_batches")
    p.add_argument("--log-every", type=int, default=0, help="print rank 0's loss every N steps (0: never)")
    p.add_argument("--until-world", type=int, default=0,
                   help="after --steps, go on (up to 10x) to the first step run by this many ranks (a test's: "
                        "a replacement's imports take what they take)")
    p.add_argument("--resilient", action="store_true",
                   help="Muster's Lightning strategy: survivors re-form in-process (its one line)")
    args = p.parse_args()
    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.samples, WIDTH, generator=g)
    data = TensorDataset(x, torch.tanh(x.roll(1, dims=1)))
    last = args.checkpoint_dir / "last.ckpt"
    resume = str(last) if last.exists() and not args.resilient else None
    resumed_from = torch.load(last, weights_only=False)["global_step"] if resume else 0
    devices = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))  # torchrun's and muster run's: one rank a process (0: a replacement not yet placed)
    trainer = L.Trainer(
        strategy=MusterDDPStrategy() if args.resilient else DDPStrategy(process_group_backend="gloo"),
        accelerator="cpu", devices=devices, num_nodes=max(1, int(os.environ.get("WORLD_SIZE", "1")) // devices),
        max_steps=args.steps * (10 if args.until_world else 1), accumulate_grad_batches=args.accumulation,
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[StepRecords(args.step_sleep, resumed_from, args.log_every, args.steps, args.until_world),
                   ModelCheckpoint(dirpath=args.checkpoint_dir, every_n_train_steps=args.checkpoint_every,
                                   save_last=True, save_top_k=1)])
    trainer.fit(Regression(args.steps), DataLoader(data, batch_size=args.batch, shuffle=True), ckpt_path=resume)
    return 0


if __name__ == "__main__":
    sys.exit(main())
