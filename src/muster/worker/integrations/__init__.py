"""The trainers people use, on the worker library: a line in their script and a lost rank's
survivors re-form in-process while a joiner takes the state from its peers.

- `hf`: Hugging Face `Trainer` (transformers 5, accelerate 1), `muster.worker.integrations.hf.resilient()`.
- `lightning`: PyTorch Lightning 2.x, `Trainer(strategy=muster.worker.integrations.lightning.MusterDDPStrategy())`.
- `common`: what they share (the data position, the held model, the RNG, the run's end).
"""
