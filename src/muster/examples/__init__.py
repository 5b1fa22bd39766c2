"""Training scripts shipped with Muster: `train_ddp` (the worker library, used by `muster demo`,
the tests and the benchmarks). Run one with `python -m muster.examples.train_ddp`."""
