"""src/muster/examples/train_ddp.py (the worker library) whose process on node NODE, local rank 0,
also holds MIB MiB of memory, touched, as a big model's rank does: the kernel frees it page by page
before the process's sockets close when it is killed. ballast.py NODE MIB ARGS..."""

import os
import runpy
import sys

from muster.local import AgentProcess

node, mib = sys.argv.pop(1), int(sys.argv.pop(1))
if os.environ.get("MUSTER_NODE_ID") == node and os.environ.get("LOCAL_RANK") == "0":
    ballast = b"\x01" * (mib << 20)
sys.argv[0] = str(AgentProcess.SCRIPT)
runpy.run_path(sys.argv[0], run_name="__main__")
