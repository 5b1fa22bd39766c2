"""`muster logs`, the files' side: what an agent writes with `muster run --log-dir DIR`, its ranks'
output (DIR/<node>-slot<K>-<start>.log, one file per start of a slot: worker/agent/supervisor.py) and its
own log (DIR/<node>-agent.log, JSON lines), their last lines, and following them as they grow and
as a restarted slot starts a new file."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

NAME = re.compile(r"^(?P<node>.+)-slot(?P<slot>\d+)-(?P<start>\d+)\.log$")
BLOCK = 1 << 16  # a tail reads this much at a time from a file's end: never the whole (multi-GB) file


def agent_log(log_dir: Path, node: str) -> Path:
    return log_dir / f"{node}-agent.log"


def starts(log_dir: Path, node: str, slot: int | None = None) -> dict[int, list[tuple[int, Path]]]:
    """Each slot of `node` (or only `slot`) with its files, (start, path) oldest first."""
    found: dict[int, list[tuple[int, Path]]] = {}
    for entry in os.scandir(log_dir):
        m = NAME.match(entry.name)
        if m and m["node"] == node and (slot is None or int(m["slot"]) == slot):
            found.setdefault(int(m["slot"]), []).append((int(m["start"]), Path(entry.path)))
    return {k: sorted(v) for k, v in found.items()}


def tail(path: Path, lines: int) -> tuple[list[str], int]:
    """The last `lines` complete lines of `path`, and the offset after them (where following goes on)."""
    with open(path, "rb") as f:
        end = f.seek(0, os.SEEK_END)
        start, chunk = end, b""
        while start > 0 and chunk.count(b"\n") <= lines:
            start = max(0, start - BLOCK)
            f.seek(start)
            chunk = f.read(end - start)
    cut = chunk.rfind(b"\n") + 1  # a partial last line is the writer's, still to come
    kept = chunk[:cut].splitlines()[-lines:] if lines else []
    return [b.decode(errors="replace") for b in kept], start + cut


@dataclass
class Follower:
    """One slot's latest file, read on from an offset; a newer start (a restart) is switched to
    once the old file's last lines are out."""

    node: str
    slot: int | None  # None: the agent's own log (never restarted into another file)
    path: Path
    offset: int = 0
    _partial: bytes = field(default=b"", repr=False)

    def read(self, log_dir: Path) -> list[str]:
        out = self._new_lines()
        newest = starts(log_dir, self.node, self.slot).get(self.slot, []) if self.slot is not None else []
        if newest and newest[-1][1] != self.path:
            out += self._new_lines(final=True)
            self.path, self.offset, self._partial = newest[-1][1], 0, b""
            out.append(f"--- {self.node} slot {self.slot} started again: {self.path.name} ---")
            out += self._new_lines()
        return out

    def _new_lines(self, final: bool = False) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        data = self._partial + data
        cut = len(data) if final else data.rfind(b"\n") + 1
        self._partial = data[cut:]
        return [b.decode(errors="replace") for b in data[:cut].splitlines()]
