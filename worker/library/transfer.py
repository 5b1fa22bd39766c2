"""Who holds the training state after a reform, who lacks it, and how its bytes are cut up: the
pure part of the state transfer (no torch.distributed, no devices), the same on every rank.

Every rank says what it holds in a Card (its step, a fingerprint of all its state, the layout of
its model). plan() picks the reference: the highest step; among the ranks at it, the state most of
them share. Ranks holding the reference are its sources, the others receive it, and ranks whose
model has another layout (a joiner built from other code) cannot take it. Where every rank holds
the reference, the common case after a kill in steady DDP training, nothing moves.

What moves is described by a skeleton (the state's structure with each tensor replaced by a
TensorRef) and cut into pieces of at most a bucket: a large tensor on the exchange device is sent
in place, in slices; small ones, and those elsewhere (an optimizer's step counters on the host),
are packed into staging buckets. Piece k comes from source k mod len(sources): the sources share
the sending.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

BUCKET_BYTES = 64 << 20  # a broadcast's size: large enough for link speed, small enough to stage twice
DIRECT_MIN_BYTES = 1 << 20  # a tensor on the exchange device this large is sent in place, not packed


@dataclass(frozen=True)
class Card:
    """What a rank holds: its completed step, a fingerprint of its whole state (model, optimizer,
    extras), and the layout of its model (names, shapes, dtypes)."""

    step: int
    fingerprint: str
    layout: str

    def encode(self) -> str:
        return f"{self.step} {self.fingerprint} {self.layout}"

    @classmethod
    def decode(cls, text: str | bytes) -> Card:
        text = text.decode() if isinstance(text, bytes) else text
        step, fingerprint, layout = text.split(" ")
        return cls(int(step), fingerprint, layout)


@dataclass(frozen=True)
class SyncPlan:
    reference: Card
    sources: tuple[int, ...]  # ranks holding the reference, in rank order
    receivers: tuple[int, ...]  # ranks that lack it and can take it
    incompatible: tuple[int, ...]  # ranks whose model's layout differs from the reference's

    @property
    def moves(self) -> bool:
        return bool(self.receivers or self.incompatible)

    def role(self, rank: int) -> str:
        return ("source" if rank in self.sources else "receiver" if rank in self.receivers
                else "incompatible")


def plan(cards: Sequence[Card]) -> SyncPlan:
    """The same plan on every rank from the same cards (indexed by rank)."""
    best = max(c.step for c in cards)
    at_best = Counter((c.fingerprint, c.layout) for c in cards if c.step == best)
    layouts = Counter(c.layout for c in cards)
    first = {}
    for rank, c in enumerate(cards):
        first.setdefault((c.fingerprint, c.layout), rank)
    # Most holders at the highest step; then the layout most ranks have (at a first formation every
    # rank's fingerprint is its own: rank 0's is taken unless its model is the odd one); then rank order.
    fingerprint, layout = max(at_best, key=lambda k: (at_best[k], layouts[k[1]], -first[k]))
    reference = Card(best, fingerprint, layout)
    sources = tuple(r for r, c in enumerate(cards) if c == reference)
    incompatible = tuple(r for r, c in enumerate(cards) if c.layout != layout)
    receivers = tuple(r for r in range(len(cards)) if r not in sources and r not in incompatible)
    return SyncPlan(reference, sources, receivers, incompatible)


@dataclass(frozen=True)
class TensorRef:
    """A tensor's place in a skeleton: its index in the flattened state, and what it is."""

    index: int
    shape: tuple[int, ...]
    dtype: str  # torch's name without the prefix, e.g. "float32"
    itemsize: int
    on_device: bool  # on the exchange device (else on the host, e.g. an optimizer's step counter)

    @property
    def nbytes(self) -> int:
        n = self.itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Piece:
    """One broadcast: `direct` sends a slice of one tensor in place, else a staging bucket whose
    `parts` are (tensor index, first byte, end byte, offset in the bucket)."""

    direct: bool
    nbytes: int
    parts: tuple[tuple[int, int, int, int], ...]


def pieces(refs: Sequence[TensorRef], bucket_bytes: int = BUCKET_BYTES,
           direct_min: int = DIRECT_MIN_BYTES) -> list[Piece]:
    """The state's tensors cut into broadcasts of at most `bucket_bytes`, in a fixed order."""
    out: list[Piece] = []
    parts: list[tuple[int, int, int, int]] = []
    used = 0
    for ref in refs:
        n = ref.nbytes
        if ref.on_device and n >= direct_min:
            out.extend(Piece(True, min(bucket_bytes, n - a), ((ref.index, a, min(n, a + bucket_bytes), 0),))
                       for a in range(0, n, bucket_bytes))
            continue
        a = 0
        while a < n:  # (a host tensor larger than a bucket spans several)
            take = min(n - a, bucket_bytes - used)
            parts.append((ref.index, a, a + take, used))
            used, a = used + take, a + take
            if used == bucket_bytes:
                out.append(Piece(False, used, tuple(parts)))
                parts, used = [], 0
    if parts:
        out.append(Piece(False, used, tuple(parts)))
    return out


def flatten(tree: Any, leaves: list, path: str = "") -> Any:
    """`tree` (dicts, lists, tuples) with its tensors appended to `leaves` as (path, tensor) and
    replaced by their index; dict keys in a fixed order, so that equal states flatten equally."""
    if isinstance(tree, dict):
        return {k: flatten(tree[k], leaves, f"{path}/{k}") for k in sorted(tree, key=repr)}
    if isinstance(tree, (list, tuple)):
        items = [flatten(v, leaves, f"{path}/{i}") for i, v in enumerate(tree)]
        return items if isinstance(tree, list) else tuple(items)
    if isinstance(tree, torch.Tensor):
        leaves.append((path, tree))
        return _Leaf(len(leaves) - 1)
    return tree


def unflatten(skeleton: Any, tensors: Sequence[Any]) -> Any:
    """The inverse of flatten: each TensorRef (or leaf index) replaced by tensors[index]."""
    if isinstance(skeleton, dict):
        return {k: unflatten(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        items = [unflatten(v, tensors) for v in skeleton]
        return items if isinstance(skeleton, list) else tuple(items)
    if isinstance(skeleton, (_Leaf, TensorRef)):
        return tensors[skeleton.index]
    return skeleton


def describe(skeleton: Any, refs: Sequence[TensorRef]) -> Any:
    """The skeleton with leaf indices replaced by their TensorRefs (what receivers allocate from)."""
    return unflatten(skeleton, refs)


def paths(skeleton: Any, path: str = "") -> dict[str, TensorRef]:
    """Every TensorRef of a described skeleton by its path."""
    if isinstance(skeleton, dict):
        return {p: r for k, v in skeleton.items() for p, r in paths(v, f"{path}/{k}").items()}
    if isinstance(skeleton, (list, tuple)):
        return {p: r for i, v in enumerate(skeleton) for p, r in paths(v, f"{path}/{i}").items()}
    return {path: skeleton} if isinstance(skeleton, TensorRef) else {}


@dataclass(frozen=True)
class _Leaf:
    index: int
