"""src/muster/examples/train_ddp.py (the worker library) whose process lingers SECONDS in interpreter
teardown, as a script that writes a last checkpoint on its way out would: slow_exit.py SECONDS ARGS..."""

import atexit
import runpy
import sys
import time

from muster.local import AgentProcess

atexit.register(time.sleep, float(sys.argv.pop(1)))
sys.argv[0] = str(AgentProcess.SCRIPT)
runpy.run_path(sys.argv[0], run_name="__main__")
