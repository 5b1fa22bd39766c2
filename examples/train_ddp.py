"""A tiny DDP model trained with the Muster worker library: the script `muster demo` runs, shipped in
the package as `muster.examples.train_ddp` (this file runs that one, for checkouts and the docs).
    MUSTER_COORDINATOR=127.0.0.1:7600 MUSTER_JOB=demo python examples/train_ddp.py --steps 100
"""

import sys

from muster.examples.train_ddp import DataPosition, batch, main  # noqa: F401  (importable as before)

if __name__ == "__main__":
    sys.exit(main())
