"""The durable tier under the in-memory ones: checkpoints of the registered state that the library
writes itself, and resumes from when no rank holds a step (every copy of a shard lost, every rank
lost, the job started again).

    worker.register(model=model, optimizer=opt, data=position, checkpoint=Checkpoints("/shared/ckpt", every=100))

What is written is each shard of the state (the whole state for a replicated job: shard 0), packed as
a peer snapshot is (src/muster/worker/library/snapshot_ring.py's `pack`: the skeleton in the closed format of
transfer.py, then the tensors; no pickle, since a checkpoint directory is read back by every rank)
and written by one holder of the shard: rank 0 of a replicated job, replica group 0's rank of each
shard index for Replicas(R, S), every slot for Snapshots(N). The shard count is fixed by the layout,
so a checkpoint restores at any world size the layout allows.

On the training thread only the host copy: at a due step boundary the shard is copied into a
buffer allocated once; a thread of the writer's writes it while the next steps run (a checkpoint
still being written when the next one is due is skipped, never waited for). Each shard goes to
DIR/step-<step>/shard-<s>.bin, then its marker shard-<s>.json (its size and xxh3-128 digest),
each written under another name and renamed: a checkpoint is complete when every shard's marker is
there, and is never read otherwise. DIR is a local path, a shared filesystem, or any fsspec URL.

At a reform whose ranks hold no step newer than the newest complete checkpoint, every rank reads
its shard back, checks its bytes against the marker's digest (a mismatch: the next older
checkpoint), and the ranks agree on one step before the state is used; none readable on some rank
is StateLost.
"""

from __future__ import annotations

import json
import math
import posixpath
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import structlog
import torch
import xxhash

from muster.worker.errors import StateLost
from muster.worker.library.snapshot_ring import Snapshot, pack

log = structlog.get_logger(__name__)

AUTO_FIRST = 64  # steps to the first checkpoint with every="auto", before its cost is known
AUTO_MAX = 1 << 16
PRIOR_MTBF_S = 3600.0  # the failure rate "auto" assumes before it has seen any (one an hour)
COST_TARGET = 0.01  # "auto" keeps the host copy under this share of the training thread's time


@dataclass(frozen=True)
class Checkpoints:
    """Where and how often the library checkpoints the registered state. `every`: steps between
    checkpoints, or "auto": a power of two near Young's optimum sqrt(2 x cost x MTBF), from the host
    copy's measured cost and the failures this rank has seen, and no shorter than keeps the copy
    under COST_TARGET (1 %) of the training thread's time (powers of two, so that ranks whose
    measures differ still meet at the larger one's steps). `keep`: complete checkpoints kept."""

    dir: str
    every: int | Literal["auto"] = "auto"
    keep: int = 2

    def __post_init__(self) -> None:
        if self.every != "auto" and (not isinstance(self.every, int) or self.every < 1):
            raise ValueError(f"Checkpoints(every={self.every!r}): a number of steps >= 1, or 'auto'")
        if self.keep < 1:
            raise ValueError(f"Checkpoints(keep={self.keep}): at least the newest one")


class Durable:
    """A rank's view of the checkpoint directory: the writer (the host copy, then a thread) and the
    reader (complete checkpoints, their verified shards)."""

    def __init__(self, spec: Checkpoints, shards: int):
        import fsspec  # (torch's dependency; a URL's filesystem comes from what the environment installs)

        self.spec, self.shards = spec, shards
        self.fs, self.root = fsspec.core.url_to_fs(spec.dir)
        self.fs.makedirs(self.root, exist_ok=True)
        self._buffer: torch.Tensor | None = None  # the host copy's, reused
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._busy = threading.Event()  # a checkpoint is being written
        self._thread: threading.Thread | None = None
        self.started = time.monotonic()
        self.failures = 0  # recoveries this rank saw (the "auto" cadence's failure rate)
        self.step_s = 0.0  # the step time, smoothed
        self.copy_s = self.write_s = 0.0  # the last checkpoint's host copy (training thread) and write
        self.written = self.skipped = 0
        self.copies_s: list[float] = []  # every host copy's seconds (benchmarks)

    # ---- writing -----------------------------------------------------------------------

    def every(self) -> int:
        """Steps between checkpoints now."""
        if self.spec.every != "auto":
            return self.spec.every
        if not self.copy_s or not self.step_s:
            return AUTO_FIRST
        mtbf = (time.monotonic() - self.started + PRIOR_MTBF_S) / (self.failures + 1)
        # Young: the interval that minimises cost/interval + interval/(2 MTBF); not shorter than a write,
        # nor than keeps the host copy under COST_TARGET of the steps (rounded up to a power of two)
        steps = max(math.sqrt(2 * self.copy_s * mtbf), self.write_s) / self.step_s
        cheap = self.copy_s / (COST_TARGET * self.step_s)
        return min(AUTO_MAX, max(1 << max(0, int(math.log2(max(steps, 1)))), 1 << math.ceil(math.log2(max(cheap, 1)))))

    def stepped(self, step: int, step_us: int, shard: int | None, tree: Callable[[], Any]) -> None:
        """At a completed step's boundary, on the training thread: `shard` (None: this rank writes
        none) is copied to host memory if a checkpoint is due; a thread writes it."""
        if step_us:
            self.step_s = step_us / 1e6 if not self.step_s else 0.9 * self.step_s + 0.1 * step_us / 1e6
        if shard is None or step % self.every():
            return
        if self._busy.is_set():
            self.skipped += 1
            log.warning("checkpoint_skipped", step=step, why="the previous one is still being written",
                        write_s=round(self.write_s, 3))
            return
        began = time.perf_counter()
        snap = pack(tree(), step, self._buffer)
        self._buffer = snap.data
        self.copy_s = time.perf_counter() - began
        self.copies_s.append(self.copy_s)
        self._busy.set()
        if self._thread is None:
            self._thread = threading.Thread(target=self._write_loop, name="muster-checkpoint", daemon=True)
            self._thread.start()
        self._queue.put((snap, shard))

    def flush(self, timeout_s: float = 600.0) -> bool:
        """Wait for the checkpoint being written (at the end of training): True when none is."""
        deadline = time.monotonic() + timeout_s
        while self._busy.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._busy.is_set()

    def _write_loop(self) -> None:
        while True:
            snap, shard = self._queue.get()
            try:
                self._write(snap, shard)
            except Exception as exc:  # a full disk, a lost mount: the in-memory tiers go on; said, not fatal
                log.error("checkpoint_write_failed", step=snap.step, shard=shard, error=str(exc)[:200])
            finally:
                self._busy.clear()

    def _write(self, snap: Snapshot, shard: int) -> None:
        began = time.perf_counter()
        data = memoryview(snap.data[:snap.nbytes].numpy())
        folder = self._folder(snap.step)
        self.fs.makedirs(folder, exist_ok=True)
        self._put(posixpath.join(folder, f"shard-{shard}.bin"), data)
        marker = {"step": snap.step, "shard": shard, "shards": self.shards, "bytes": snap.nbytes,
                  "digest": xxhash.xxh3_128(data).hexdigest()}
        self._put(posixpath.join(folder, f"shard-{shard}.json"), json.dumps(marker).encode())  # last: "complete"
        self.write_s = time.perf_counter() - began
        self.written += 1
        log.info("checkpoint_written", step=snap.step, shard=shard, mib=round(snap.nbytes / (1 << 20), 2),
                 copy_s=round(self.copy_s, 4), write_s=round(self.write_s, 3), path=folder)
        self._retire(shard)

    def _put(self, path: str, data: bytes | memoryview) -> None:
        """Whole or not at all: written under another name, then renamed."""
        partial = f"{path}.partial"
        with self.fs.open(partial, "wb") as f:
            f.write(data)
        self.fs.mv(partial, path)

    def _retire(self, shard: int) -> None:
        """This shard's files of checkpoints older than the `keep` newest complete ones (each writer
        removes its own: no two ranks remove the same file)."""
        complete = self.complete()
        if len(complete) <= self.spec.keep:
            return
        for step in [s for s in self._steps() if s < complete[self.spec.keep - 1]]:
            folder = self._folder(step)
            for name in (f"shard-{shard}.json", f"shard-{shard}.bin"):  # the marker first: never half "complete"
                try:
                    self.fs.rm(posixpath.join(folder, name))
                except (FileNotFoundError, OSError):
                    pass
            try:
                if not self.fs.ls(folder, detail=False):
                    self.fs.rmdir(folder)
            except (FileNotFoundError, OSError):
                pass

    # ---- reading -----------------------------------------------------------------------

    def _folder(self, step: int) -> str:
        return posixpath.join(self.root, f"step-{step:012d}")

    def _steps(self) -> list[int]:
        try:
            names = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        steps = []
        for name in names:
            base = posixpath.basename(name.rstrip("/"))
            if base.startswith("step-") and base[5:].isdigit():
                steps.append(int(base[5:]))
        return sorted(steps)

    def complete(self) -> list[int]:
        """Steps of the complete checkpoints, newest first: every shard's marker is there."""
        out = []
        for step in reversed(self._steps()):
            try:
                names = {posixpath.basename(n) for n in self.fs.ls(self._folder(step), detail=False)}
            except FileNotFoundError:
                continue
            if all(f"shard-{s}.json" in names and f"shard-{s}.bin" in names for s in range(self.shards)):
                out.append(step)
        return out

    def read(self, step: int, shard: int) -> Any:
        """Shard `shard` of checkpoint `step` as a state tree, its bytes checked against its marker's
        digest (CorruptCheckpoint otherwise)."""
        folder = self._folder(step)
        with self.fs.open(posixpath.join(folder, f"shard-{shard}.json"), "rb") as f:
            marker = json.loads(f.read())
        if (marker.get("step"), marker.get("shard"), marker.get("shards")) != (step, shard, self.shards):
            raise CorruptCheckpoint(f"checkpoint {step} shard {shard}: its marker says {marker}")
        with self.fs.open(posixpath.join(folder, f"shard-{shard}.bin"), "rb") as f:
            raw = bytearray(f.read())
        digest = xxhash.xxh3_128(raw).hexdigest()
        if len(raw) != marker["bytes"] or digest != marker["digest"]:
            raise CorruptCheckpoint(f"checkpoint {step} shard {shard}: {len(raw)} bytes, digest {digest}; "
                                    f"its marker recorded {marker['bytes']} bytes, digest {marker['digest']}")
        return Snapshot(step, torch.frombuffer(raw, dtype=torch.uint8), len(raw)).tree()

    def resume(self, channel: Any, shard: int, load: Callable[[Any], None], above: int,
               newest: int | None = None) -> int | None:
        """At a reform, on every rank of `channel` (collectively): load this rank's `shard` of the
        newest complete checkpoint past step `above` (the newest step a rank holds, the same on
        every rank; -1: the ranks' state is lost, any checkpoint), the ranks agreeing on one step.
        `newest`: the newest complete one any rank sees, if the ranks told each other already.
        Returns the step loaded, or None where no checkpoint is newer than `above`. Raises
        StateLost where none can be read on some rank."""
        if newest is None:
            seen = self.complete()
            newest = max(int(v) for v in channel.exchange("durable/newest", str(seen[0] if seen else -1)))
        if newest <= above:
            return None
        began = time.perf_counter()
        target, loaded, tries = newest, -1, 0
        while True:
            if loaded != target:
                loaded = self._load_newest(target, above, shard, load)
            got = [int(v) for v in channel.exchange(f"durable/loaded/{tries}", str(loaded))]
            if min(got) < 0:
                raise StateLost(f"no complete checkpoint past step {max(above, 0)} in {self.spec.dir} could be read "
                                f"on rank(s) {[r for r, s in enumerate(got) if s < 0][:8]} (the newest: step "
                                f"{newest}); the state is lost beyond every tier")
            if min(got) == max(got):
                log.info("checkpoint_resumed", step=loaded, shard=shard, above=above, seconds=round(time.perf_counter() - began, 3))
                return loaded
            target, tries = min(got), tries + 1  # another rank could read only an older one: every rank takes it

    def _load_newest(self, target: int, above: int, shard: int, load: Callable[[Any], None]) -> int:
        """Load the newest readable checkpoint at or below `target` and past `above`: its step, or -1."""
        for step in [s for s in self.complete() if above < s <= target]:
            try:
                load(self.read(step, shard))
                return step
            except (CorruptCheckpoint, OSError, ValueError, KeyError) as exc:
                log.error("checkpoint_unusable", step=step, shard=shard, error=str(exc)[:300])
        return -1


class CorruptCheckpoint(ValueError):
    """A checkpoint's shard whose bytes are not those its marker recorded."""
