"""CPU time of a process, or of one of its threads, from /proc: what the benchmarks charge a
coordinator (or a bare gRPC server) per message. Imports nothing heavy: spawned benchmark
processes import it too."""

from __future__ import annotations

import os

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int, thread: int | None = None) -> float:
    """user + system CPU of a process (all its threads), or of one of its threads."""
    with open(f"/proc/{pid}/task/{thread}/stat" if thread else f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def loop_seconds(pid: int) -> float:
    """CPU of a process's main thread: a coordinator's event loop (gRPC's own threads run beside it)."""
    return cpu_seconds(pid, pid)
