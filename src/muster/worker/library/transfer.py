"""Who holds the training state after a reform, who lacks it, and how its bytes are cut up: the
pure part of the state transfer (no torch.distributed, no devices), the same on every rank.

Every rank says what it holds in a Card (its step, a fingerprint of all its state, the layout of
its model). plan() picks the reference: the highest step; among the ranks at it, the state most of
them share. Ranks holding the reference are its sources, the others receive it, and ranks whose
model has another layout (a joiner built from other code) cannot take it. Where every rank holds
the reference, the common case after a kill in steady DDP training, nothing moves.

What moves is described by a skeleton (the state's structure with each tensor replaced by a
TensorRef), sent between ranks in a closed format (`encode`/`decode`: tagged JSON of plain values,
never a pickle, so whoever writes it chooses data, not code), and cut into pieces of at most a
bucket: a large tensor on the exchange device is sent in place, in slices; small ones, and those
elsewhere (an optimizer's step counters on the host), are packed into staging buckets. Piece k
comes from source k mod len(sources): the sources share the sending.
"""

from __future__ import annotations

import base64
import json
import math
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

SKELETON_MAX_BYTES = 256 << 20  # a skeleton this large is refused unread (a state's is kilobytes to megabytes)
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


def undecided(cards: Sequence[Card]) -> str:
    """Whether the ranks at the highest step (past a first formation) hold different states with no
    majority among them (two replicas, one corrupted): then none is the reference. "" if decided,
    else the split (fingerprint prefixes and their counts)."""
    best = max(c.step for c in cards)
    at_best = Counter(c.fingerprint for c in cards if c.step == best)
    if best == 0 or len(at_best) < 2 or 2 * max(at_best.values()) > sum(at_best.values()):
        return ""
    return ", ".join(f"{n} x {fp[:8]}" for fp, n in at_best.most_common())


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


class SkeletonRefused(ValueError):
    """A skeleton this rank cannot carry (a value of a type the closed format lacks) or will not
    take (not a well-formed skeleton: made by something other than this library)."""


# The dtypes a TensorRef may name: torch's own, by name, never an arbitrary attribute of torch.
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64)}


def encode(skeleton: Any) -> bytes:
    """A described skeleton (or any state of plain values) in the closed format: tagged JSON.
    Carries dicts (any of these as keys), lists, tuples, TensorRefs, str, int, float (nan and inf
    too), bool, None, bytes and numpy arrays and scalars; anything else is refused by its path."""
    try:
        tagged = _tagged(skeleton)
    except _Foreign as exc:
        raise SkeletonRefused(f"the state at {_path_to(skeleton, exc.args[0]) or '/'} holds a "
                              f"{type(exc.args[0]).__module__}.{type(exc.args[0]).__qualname__}, which the state "
                              "transfer cannot carry: a state_dict may hold tensors, numbers, strings, bytes, None, "
                              "numpy arrays, and lists, tuples and dicts of them") from None
    return json.dumps(tagged, separators=(",", ":"), allow_nan=False).encode()


def decode(data: bytes) -> Any:
    """The inverse of `encode`, for bytes another process wrote: only the tags it makes, every
    TensorRef checked (a known dtype and its size, non-negative dimensions, indices 0..n-1 once
    each); anything else raises SkeletonRefused."""
    if len(data) > SKELETON_MAX_BYTES:
        raise SkeletonRefused(f"a skeleton of {len(data)} bytes (more than {SKELETON_MAX_BYTES})")
    try:
        tree = _plain(json.loads(data))
    except SkeletonRefused:
        raise
    except (ValueError, TypeError, KeyError, IndexError, RecursionError) as exc:
        raise SkeletonRefused(f"not a skeleton: {type(exc).__name__}: {str(exc)[:200]}") from None
    indices = sorted(r.index for r in paths(tree).values())
    if indices != list(range(len(indices))):
        raise SkeletonRefused("its tensor indices are not 0..n-1, each once")
    return tree


class _Foreign(Exception):
    """A value the closed format lacks (args[0]); its path is found only then (encode is on the
    fingerprint's path: every reform of every rank)."""


def _tagged(v: Any) -> Any:
    t = type(v)  # exact types first: a described skeleton is made of these
    if t is TensorRef:
        return {"T": [v.index, list(v.shape), v.dtype, v.itemsize, v.on_device]}
    if t is dict:
        return {"d": [[_tagged(k), _tagged(x)] for k, x in v.items()]}
    if t is str or t is bool or v is None:
        return v
    if t is int:
        return v if -(1 << 63) <= v < 1 << 64 else {"I": str(v)}
    if t is float:
        return v if math.isfinite(v) else {"F": repr(v)}
    if t is list:
        return [_tagged(x) for x in v]
    if t is tuple:
        return {"t": [_tagged(x) for x in v]}
    if isinstance(v, (bytes, bytearray)):
        return {"b": base64.b64encode(v).decode()}
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(v, (numpy.ndarray, numpy.generic)) and v.dtype.kind in "biufc":
        a = numpy.asarray(v)  # (tobytes is in C order whatever the strides)
        return {"n": [a.dtype.str, list(a.shape), base64.b64encode(a.tobytes()).decode(),
                      isinstance(v, numpy.generic)]}
    for plain in (bool, int, float, str, dict, list, tuple):  # subclasses (an IntEnum, a namedtuple) as their base
        if isinstance(v, plain):
            return _tagged(plain(v) if plain is not dict else dict(v))
    raise _Foreign(v)


def _path_to(tree: Any, value: Any, path: str = "") -> str | None:
    if tree is value:
        return path
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    for k, x in items:
        found = _path_to(x, value, f"{path}/{k}")
        if found is not None:
            return found
    return None


def _plain(v: Any) -> Any:
    if v is None or isinstance(v, (bool, str, int, float)):
        return v
    if isinstance(v, list):
        return [_plain(x) for x in v]
    (tag, body), = v.items()  # (a dict of another shape raises: not a skeleton)
    if tag == "d":
        return {_key(_plain(k)): _plain(x) for k, x in body}
    if tag == "t":
        return tuple(_plain(x) for x in body)
    if tag == "T":
        return _ref(*body)
    if tag == "I":
        return int(body)
    if tag == "F" and body in ("nan", "inf", "-inf"):
        return float(body)
    if tag == "b":
        return base64.b64decode(body, validate=True)
    if tag == "n":
        import numpy

        dtype, shape, data, scalar = body
        dtype = numpy.dtype(dtype)
        if dtype.kind not in "biufc" or not all(type(d) is int and d >= 0 for d in shape):
            raise SkeletonRefused(f"an array of dtype {dtype} and shape {shape}")
        a = numpy.frombuffer(base64.b64decode(data, validate=True), dtype=dtype).reshape(shape).copy()
        return a[()] if scalar else a
    raise SkeletonRefused(f"an unknown tag {tag!r}")


def _key(k: Any) -> Any:
    if isinstance(k, (list, dict)):
        raise SkeletonRefused("a dict key that is a list or dict")
    return k


def _ref(index: Any, shape: Any, dtype: Any, itemsize: Any, on_device: Any) -> TensorRef:
    d = DTYPES.get(dtype) if isinstance(dtype, str) else None
    if (d is None or type(index) is not int or index < 0 or type(on_device) is not bool
            or not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape)
            or itemsize != d.itemsize):
        raise SkeletonRefused(f"a malformed tensor reference {[index, shape, dtype, itemsize, on_device]!r:.200}")
    return TensorRef(index, tuple(shape), dtype, itemsize, on_device)
