"""The example training script with a C call that holds the GIL for GIL_HOLD_S seconds where NCCL's
long C++ calls hold it: in forming (init) and/or in abort (GIL_HOLD_AT=form,abort), on every rank,
once per generation. A healthy rank held off the GIL this way must not be taken for silent."""

import ctypes
import os
import sys

from muster.examples import train_ddp
from muster.worker.library import comm

_sleep = ctypes.PyDLL("libc.so.6").sleep  # PyDLL: the GIL stays held during the call
HOLD_S = int(os.environ["GIL_HOLD_S"])
AT = os.environ["GIL_HOLD_AT"].split(",")


def holding(method, generation_of):
    held: set[int] = set()

    def wrapper(self, *args, **kwargs):
        generation = generation_of(*args)
        if generation not in held:
            held.add(generation)
            _sleep(HOLD_S)
        return method(self, *args, **kwargs)
    return wrapper


if "form" in AT:
    comm.Comm.form = holding(comm.Comm.form, lambda spec, *_: spec.generation)
if "abort" in AT:
    comm.Comm.abort = holding(comm.Comm.abort, lambda below, *_: below)

if __name__ == "__main__":
    sys.exit(train_ddp.main())
