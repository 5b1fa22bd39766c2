"""A rank's peer snapshots: copies of its own shard, and of its predecessor's, in host memory, and
their exchange with the buddy over a gloo group of their own.

A snapshot is the rank's local state (its parameters' local shards, optimizer state, extras) packed
into one flat byte buffer: the skeleton (structure, shapes, dtypes, and plain values such as an
optimizer's learning rate, in the closed format of src/muster/worker/library/transfer.py's `encode`: no pickle,
since a buddy's bytes are read back) then every tensor at a 64-byte aligned offset.

Taking one (at the step boundary, on the training thread) is a copy into a buffer allocated once and
reused, then a non-blocking send to the buddy: gloo's own threads move the bytes while the next steps
run. The predecessor's snapshot is received by a thread of the ring's, asked one step later (when the
predecessor has provably sent it: its next step's collectives needed this rank). So the ring only
ever waits for bytes already on their way, and a reform finds it done, or failed by the abort.

Each rank keeps two snapshots of its own and two of its predecessor's (4 x its shard of host memory):
while the newest is in flight the one before stays complete.

A process that exits stuck (src/muster/worker/library/stuck.py) writes its complete snapshots to a file of its
agent's (`leave`), and the slot's next process reads them back (`take_over`): its buddy may be lost in
the same fault, and then these are the only copies of two shards.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import structlog
import torch
import torch.distributed as dist

from muster.worker.library.transfer import DTYPES, SkeletonRefused, TensorRef, decode, describe, encode, flatten, unflatten

log = structlog.get_logger(__name__)

ALIGN = 64
KEPT = 2  # snapshots of each kind kept: the newest may be in flight, the one before is complete
STOP_WAIT_S = 30.0  # a reform waits this long for the receiving thread (it waits only for bytes already sent)
TIMEOUT = timedelta(seconds=300)  # the ring group's: a peer gone without an abort
_YOURS, _HEADER, _PAYLOAD = 0, 1, 2  # message tags: a shard sent to its owner at recovery; a snapshot's size; its bytes


@dataclass
class Snapshot:
    step: int
    data: torch.Tensor  # uint8: [skeleton length (8 bytes) | skeleton | tensors], possibly larger than nbytes
    nbytes: int

    def tree(self) -> Any:
        """The packed state, every tensor a clone (what is loaded must not alias a reused buffer)."""
        n = int(self.data[:8].view(torch.int64).item())
        if not 0 <= n <= self.nbytes - 8:
            raise SkeletonRefused(f"snapshot {self.step}: a skeleton of {n} bytes in {self.nbytes}")
        described = decode(self.data[8:8 + n].numpy().tobytes())
        refs = sorted(_refs(described), key=lambda r: r.index)
        offsets = _offsets(refs, 8 + n)
        if refs and offsets[-1] + refs[-1].nbytes > self.nbytes:
            raise SkeletonRefused(f"snapshot {self.step}: its tensors need {offsets[-1] + refs[-1].nbytes} bytes, "
                                  f"it has {self.nbytes}")
        tensors = [self.data[off:off + r.nbytes].view(DTYPES[r.dtype]).view(r.shape).clone()
                   for r, off in zip(refs, offsets)]
        return unflatten(described, tensors)


def pack(tree: Any, step: int, reuse: torch.Tensor | None = None) -> Snapshot:
    """`tree` copied into one flat host buffer (`reuse` where it is large enough)."""
    leaves: list = []
    skeleton = flatten(tree, leaves)
    tensors = [t.detach() for _, t in leaves]
    refs = [TensorRef(i, tuple(t.shape), str(t.dtype).removeprefix("torch."), t.element_size(), False)
            for i, t in enumerate(tensors)]
    head = encode(describe(skeleton, refs))
    offsets = _offsets(refs, 8 + len(head))
    nbytes = offsets[-1] + refs[-1].nbytes if refs else 8 + len(head)
    data = reuse if reuse is not None and reuse.numel() >= nbytes else host_buffer(nbytes)
    data[:8].view(torch.int64).fill_(len(head))
    data[8:8 + len(head)].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
    cuda = False
    for t, r, off in zip(tensors, refs, offsets):
        data[off:off + r.nbytes].view(t.dtype).view(t.shape).copy_(t, non_blocking=t.is_cuda)
        cuda = cuda or t.is_cuda
    if cuda:
        torch.cuda.current_stream().synchronize()  # the copies must land before gloo reads the buffer
    return Snapshot(step, data, nbytes)


def host_buffer(nbytes: int) -> torch.Tensor:
    """Pinned where a GPU is, so that device-to-host copies run at link speed."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())


def _offsets(refs: list[TensorRef], start: int) -> list[int]:
    out, at = [], start
    for r in refs:
        at = -(-at // ALIGN) * ALIGN
        out.append(at)
        at += r.nbytes
    return out


def _refs(skeleton: Any) -> list[TensorRef]:
    if isinstance(skeleton, dict):
        return [r for v in skeleton.values() for r in _refs(v)]
    if isinstance(skeleton, (list, tuple)):
        return [r for v in skeleton for r in _refs(v)]
    return [skeleton] if isinstance(skeleton, TensorRef) else []


class Ring:
    """This rank's snapshots (`own`) and its predecessor's (`held`), by step, and their exchange.
    Ranks are the ring group's (its rank is the mesh slot)."""

    def __init__(self) -> None:
        self.own: dict[int, Snapshot] = {}
        self.held: dict[int, Snapshot] = {}  # complete ones only
        self._lock = threading.Lock()
        self._group: dist.ProcessGroup | None = None
        self._buddy = self._predecessor = -1
        self._sends: list = []
        self._sent: int | None = None  # the step of the last snapshot sent whose receipt is not asked yet
        self._asks: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self.broken = ""  # why this generation's exchange stopped (a failed send or receive)

    # ---- within a generation ---------------------------------------------------------

    def connect(self, group: dist.ProcessGroup, buddy: int, predecessor: int) -> None:
        self._group, self._buddy, self._predecessor, self.broken = group, buddy, predecessor, ""
        self._thread = threading.Thread(target=self._receive, args=(group, predecessor), name="muster-snapshots",
                                        daemon=True)
        self._thread.start()

    def take(self, step: int, tree: Any) -> None:
        """On the training thread: copy this rank's state and send it to the buddy (not waited)."""
        if self._group is None or self.broken:
            return
        began = time.perf_counter()
        try:
            for work in self._sends:  # the last snapshot's: long done (its buddy asked for it steps ago)
                work.wait()
            reuse = self.own.pop(min(self.own)).data if len(self.own) >= KEPT else None
            self.own[step] = pack(tree, step, reuse)
            self.send(step)
        except (RuntimeError, dist.DistError) as exc:  # the group broke: the step's collectives fail next
            self._break(f"sending snapshot {step} failed: {str(exc)[:200]}")
            return
        log.info("snapshot_taken", step=step, seconds=round(time.perf_counter() - began, 6),
                 shard_mib=round(self.own[step].nbytes / (1 << 20), 3),
                 memory_mib=round(self.memory_bytes() / (1 << 20), 3))

    def send(self, step: int) -> None:
        """Send own snapshot `step` to the buddy; its receipt is asked at the next step boundary."""
        snap = self.own[step]
        header = torch.tensor([step, snap.nbytes], dtype=torch.int64)
        self._sends = [dist.isend(header, group=self._group, group_dst=self._buddy, tag=_HEADER),
                       dist.isend(snap.data[:snap.nbytes], group=self._group, group_dst=self._buddy, tag=_PAYLOAD)]
        self._sent = step

    def ask(self) -> None:
        """At a step boundary after a snapshot was sent: every rank sent its own by now (this step's
        collectives needed them all past that boundary), so receive the predecessor's."""
        if self._sent is not None and not self.broken:
            self._asks.put(self._sent)
            self._sent = None

    def _receive(self, group: dist.ProcessGroup, predecessor: int) -> None:
        while (step := self._asks.get()) is not None:
            try:
                header = torch.empty(2, dtype=torch.int64)
                dist.irecv(header, group=group, group_src=predecessor, tag=_HEADER).wait()
                got, nbytes = (int(v) for v in header)
                with self._lock:  # the oldest held snapshot's buffer takes the newest
                    old = self.held.pop(min(self.held)) if len(self.held) >= KEPT else None
                data = old.data if old is not None and old.data.numel() >= nbytes else host_buffer(nbytes)
                dist.irecv(data[:nbytes], group=group, group_src=predecessor, tag=_PAYLOAD).wait()
                if got != step:
                    raise RuntimeError(f"expected the predecessor's snapshot of step {step}, got step {got}")
                with self._lock:
                    self.held[step] = Snapshot(step, data, nbytes)
            except (RuntimeError, dist.DistError) as exc:
                self._break(f"receiving snapshot {step} failed: {str(exc)[:200]}")
                return

    def _break(self, why: str) -> None:
        if not self.broken:
            self.broken = why
            log.warning("snapshots_stopped", reason=why)

    # ---- at a reform -----------------------------------------------------------------

    def stop(self) -> None:
        """Leave the generation's exchange: what was received completely is kept, nothing in flight."""
        self._asks.put(None)
        if self._thread is not None:
            self._thread.join(STOP_WAIT_S)
            if self._thread.is_alive():  # (its buffer may still be written: not reused)
                log.warning("snapshot_receive_abandoned", waited_s=STOP_WAIT_S)
        self._thread, self._group, self._sends, self._sent = None, None, [], None
        self._asks = queue.Queue()

    def keep_until(self, step: int) -> None:
        """Drop snapshots newer than `step` (the state rolled back to it)."""
        with self._lock:
            self.own = {s: v for s, v in self.own.items() if s <= step}
            self.held = {s: v for s, v in self.held.items() if s <= step}

    def give(self, group: dist.ProcessGroup, owner: int, step: int) -> tuple[list, int]:
        """Send the held snapshot `step` back to its owner (at a recovery): the sends, to be waited,
        and the bytes."""
        snap = self.held[step]
        header = torch.tensor([step, snap.nbytes], dtype=torch.int64)
        return [dist.isend(header, group=group, group_dst=owner, tag=_YOURS),
                dist.isend(snap.data[:snap.nbytes], group=group, group_dst=owner, tag=_YOURS)], snap.nbytes

    def take_back(self, group: dist.ProcessGroup, holder: int) -> Snapshot:
        """This rank's own snapshot, from the buddy that held it (a fresh process has none)."""
        header = torch.empty(2, dtype=torch.int64)
        dist.recv(header, group=group, group_src=holder, tag=_YOURS)
        step, nbytes = (int(v) for v in header)
        data = host_buffer(nbytes)
        dist.recv(data, group=group, group_src=holder, tag=_YOURS)
        self.own[step] = Snapshot(step, data, nbytes)
        return self.own[step]

    def memory_bytes(self) -> int:
        with self._lock:
            return sum(s.data.numel() for s in (*self.own.values(), *self.held.values()))

    # ---- across a stuck exit -----------------------------------------------------------

    def leave(self, path: str, slot: int, stride: int) -> int:
        """Write the complete snapshots (own ones are, once taken) for the slot's next process; from
        any thread (the training thread is stuck). A header (JSON: the slot, the stride, each
        snapshot's step and size) then the bytes (each snapshot's skeleton in the closed format). Returns the bytes written (0: none held)."""
        with self._lock:
            kinds = {"own": dict(self.own), "held": dict(self.held)}
        if not any(kinds.values()):
            return 0
        header = json.dumps({"slot": slot, "stride": stride, **{k: [[step, snap.nbytes] for step, snap in v.items()]
                                                                 for k, v in kinds.items()}}).encode()
        partial = f"{path}.{os.getpid()}"
        with open(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            f.write(len(header).to_bytes(8, "little") + header)
            for snaps in kinds.values():
                for snap in snaps.values():
                    f.write(memoryview(snap.data[:snap.nbytes].numpy()))
        os.replace(partial, path)  # whole or not at all
        return sum(snap.nbytes for snaps in kinds.values() for snap in snaps.values())

    def take_over(self, path: str) -> tuple[int, int] | None:
        """The snapshots a stuck process left in `path` become this (fresh) ring's; the file is
        removed. Returns (the slot, the stride) they are of, or None: no file."""
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            return None
        with f:
            os.unlink(path)  # read once: a later process of the slot must not take them again
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            for kind in ("own", "held"):
                for step, nbytes in header[kind]:
                    data = host_buffer(nbytes)
                    if f.readinto(memoryview(data.numpy())) != nbytes:
                        raise ValueError(f"{path}: cut short in snapshot {step}")
                    getattr(self, kind)[step] = Snapshot(step, data, nbytes)
        return header["slot"], header["stride"]
