"""examples/train_ddp.py with a C call that holds the GIL for GIL_HOLD_S seconds where NCCL's long
C++ calls hold it: in forming (init) or in abort (GIL_HOLD_AT=form|abort), on every rank, once per
generation. A healthy rank held off the GIL this way must not be taken for silent."""

import ctypes
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))

import train_ddp  # noqa: E402

from muster.worker import comm  # noqa: E402

_sleep = ctypes.PyDLL("libc.so.6").sleep  # PyDLL: the GIL stays held during the call
HOLD_S = int(os.environ["GIL_HOLD_S"])
AT = os.environ["GIL_HOLD_AT"]
_held: set[int] = set()


def holding(method, generation_of):
    def wrapper(self, *args, **kwargs):
        generation = generation_of(*args)
        if generation not in _held:
            _held.add(generation)
            _sleep(HOLD_S)
        return method(self, *args, **kwargs)
    return wrapper


if AT == "form":
    comm.Comm.form = holding(comm.Comm.form, lambda spec, *_: spec.generation)
else:
    comm.Comm.abort = holding(comm.Comm.abort, lambda below, *_: below)

if __name__ == "__main__":
    sys.exit(train_ddp.main())
