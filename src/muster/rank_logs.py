"""`muster logs`, the files' side: what an agent writes with `muster run --log-dir DIR`, in the
directory of its job's run, DIR/<job>/<run>/ (made at its Join, when the run is known): its ranks'
output (<node>-slot<K>-<start>.log, one file per start of a slot: src/muster/worker/agent/supervisor.py) and its
own log (<node>-agent.log, JSON lines); their last lines, and following them as they grow and as a
restarted slot starts a new file. Directories are made 0700 and files 0600, the agent's user's alone:
a rank prints what it likes (its loss, a secret), and node ids are unique only within a job."""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

NAME = re.compile(r"^(?P<node>.+)-slot(?P<slot>\d+)-(?P<start>\d+)\.log$")
BLOCK = 1 << 16  # a tail reads this much at a time from a file's end: never the whole (multi-GB) file


def run_dir(log_dir: Path, job: str, run: int) -> Path:
    return log_dir / job / str(run)  # job names are [a-z0-9._-] starting alphanumeric: never "..", never a "/"


def made_dir(log_dir: Path, job: str, run: int | None = None) -> Path:
    """DIR/<job>, or DIR/<job>/<run>, each missing level made 0700 (os.makedirs leaves the levels
    above its last to the umask)."""
    os.makedirs(log_dir, 0o700, exist_ok=True)  # DIR's own parents: the operator's path, as mkdir -p makes them
    levels = [log_dir / job] + ([run_dir(log_dir, job, run)] if run is not None else [])
    for level in levels:
        with contextlib.suppress(FileExistsError):
            os.mkdir(level, 0o700)
    return levels[-1]


def open_log(path: Path) -> int:
    """A log file's descriptor, appending; made 0600 at most whatever the umask, never through a link."""
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def agent_log(run: Path, node: str) -> Path:
    return run / f"{node}-agent.log"


def slot_log(run: Path, node: str, slot: int, start: int) -> Path:
    return run / f"{node}-slot{slot}-{start}.log"


def starts(run: Path, node: str, slot: int | None = None) -> dict[int, list[tuple[int, Path]]]:
    """Each slot of `node` (or only `slot`) with its files in a run's directory, (start, path) oldest first."""
    found: dict[int, list[tuple[int, Path]]] = {}
    for entry in os.scandir(run):
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

    def read(self, run: Path) -> list[str]:
        out = self._new_lines()
        newest = starts(run, self.node, self.slot).get(self.slot, []) if self.slot is not None else []
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
