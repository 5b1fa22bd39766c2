"""`python -m muster.worker.rank.orphan_guard PARENT_PID CMD...`: make this process die with its parent
(PR_SET_PDEATHSIG survives execve), then become CMD. The agent starts ranks through it because
running Python between fork and exec in a process with gRPC threads crashes the child."""

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def prefix() -> list[str]:
    """The command line that runs what follows it so that it dies with this process, even on SIGKILL."""
    return [sys.executable, "-m", "muster.worker.rank.orphan_guard", str(os.getpid())]


def main() -> None:
    parent, argv = int(sys.argv[1]), sys.argv[2:]
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the agent died before prctl took effect
        os._exit(1)
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main()
