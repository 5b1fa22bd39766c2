"""The training state kept identical on every rank, and how it moves after a reform.

StateTransfer is the seam: what a rank holds (its Card) and how, in a new group, it sends what the
others lack and receives what it lacks. ReplicatedState is its first implementation: every rank
holds the whole state (data parallel). After every reform:

1. each rank publishes its Card on the generation's store (a fingerprint computed where the state
   lives: on the GPU for CUDA tensors, xxh3 over host memory for CPU ones); every rank computes the
   same plan (src/muster/worker/library/transfer.py). Where every rank holds the reference, nothing else happens: a
   survivor's sync costs one store round trip and one fingerprint, whatever the model's size.
2. otherwise the first source publishes the skeleton (the state's structure, tensors replaced by
   shape and dtype, in a closed format: src/muster/worker/library/transfer.py's `encode`, no pickle), checked
   by each rank against the reference's layout before use, and the reference's tensors move in pieces of at most
   a bucket, striped over the sources (point to point on gloo, broadcasts on NCCL), received in
   place (two staging buckets at most); optimizer state a receiver lacks (Adam's, before its first
   step) is allocated from the skeleton.
3. receivers check their new fingerprint against the reference's; a mismatch (a corrupted bucket)
   is sent again, and a rank that still differs, or whose model has another layout, gets
   StateMismatch: it never trains on a state that is not the others'.

The training thread holds the GIL only briefly (collectives and tensor copies release it): the
rank's link keeps reporting while gigabytes move, and a long transfer logs its progress.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

import structlog
import torch
import torch.distributed as dist
import xxhash

from muster.worker.errors import ShardedStateRefused, StateLost, StateMismatch
from muster.worker.library.transfer import (BUCKET_BYTES, DTYPES, Card, Piece, SyncPlan, TensorRef, decode, describe, encode,
                                           flatten, paths, pieces, plan, undecided, unflatten)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from muster.worker.library.checkpoints import Durable

log = structlog.get_logger(__name__)

TRANSFER_ATTEMPTS = 3  # sends of the reference to receivers whose fingerprint still differs
TRANSFER_MIN_S = 60.0  # a transfer is bounded by this plus TRANSFER_SLACK x its size at the rate measured
TRANSFER_SLACK = 4.0
PROGRESS_EVERY_S = 2.0
MAX_IN_FLIGHT = 4  # broadcasts issued ahead of the one awaited (a staged one also takes a staging buffer)
_POSITION_WEIGHTS = 61  # the fingerprint's position-weighted sum cycles over this many words
_LAYOUTS = ("Two ways to recover a lost shard: (1) replica groups (HSDP): register(build=..., layout=Replicas(R, S)) "
            "with R >= 2, the library builds the mesh and a lost shard is taken from another replica (see "
            "docs/guide/sharded.md); (2) peer snapshots, for sharding without replicas (FSDP2 over the whole job, "
            "ZeRO-1): register(build=..., layout=Snapshots(N)), each rank's shard is copied to another rank every "
            "K steps and a lost one is taken from that copy, at most K steps redone "
            "(docs/guide/sharded.md#peer-snapshots)")


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


class Channel(Protocol):
    """What a transfer needs of the new group besides its collectives: its generation's store."""

    rank: int
    world_size: int
    left_out: int  # usable slots of the job outside this generation, where state may be held (Assignment.left_out)

    def exchange(self, key: str, value: str | bytes) -> list[bytes]:
        """Publish this rank's value under `key`; every rank's, in rank order (bounded, abandonable)."""

    def publish(self, key: str, value: bytes) -> None: ...

    def fetch(self, key: str) -> bytes:
        """The value under `key` once published (bounded, abandonable)."""


class Bench:
    """What a benched rank watches in the generation it sits out, besides the next map: the final
    barrier of the ranks that train (Worker.close), which ends its wait with theirs (the reform,
    which owns the link, then finishes the rank: Reform.finish_benched). Posted at once, with no
    timeout of its own: the wait is bounded by the link and the coordinator's long-phase timeout.
    Leaving the bench, the rank must abort the group before destroying it: the pending barrier
    holds gloo's destroy until it completes."""

    def __init__(self, why: str, *, others_train: bool):
        self.why = why
        self._closing = None
        if others_train:  # (with nobody training, every rank of the generation would reach it at once)
            opts = dist.BarrierOptions()
            opts.timeout = timedelta(days=365)
            self._closing = dist.group.WORLD.barrier(opts)

    def others_finished(self) -> bool:
        return self._closing is not None and self._closing.is_completed() and self._closing.is_success()


@dataclass
class SyncResult:
    step: int  # the step every rank now holds
    plan: SyncPlan
    role: str  # this rank's: source, receiver (or incompatible: it raised instead)
    sent: int = 0  # bytes this rank broadcast
    received: int = 0  # bytes this rank took into its state
    transfer_s: float = 0.0  # the broadcasts alone (verify_s in phases: the fingerprint check after)
    attempts: int = 0
    phases: dict[str, float] = field(default_factory=dict)
    # The tier the step came from: "live" (the ranks' own state, moved where a rank lacked it),
    # "snapshot" (peer snapshots), "checkpoint" (the durable tier)
    tier: str = "live"
    # Set where this rank's replica group is out of the generation's mesh (sharded.py): why, and what
    # it watches; the reform keeps it out until a generation places it, or finishes it with the others
    bench: Bench | None = None


class StateTransfer(Protocol):
    """The seam between the worker and the state: what a rank holds, how it gets what it lacks after
    a reform, and everything the worker reads of it. Every member is called on the training thread
    but `snapshots` (the link thread's reports) and `hand_over` (the thread that ends a stuck
    process). An implementation subclasses this for the defaults of what its layout has nothing to
    do in (the hooks are no-ops; no mesh, no slot)."""

    model: torch.nn.Module | None  # the registered one, or the one built on this generation's mesh
    optimizer: Any
    extras: dict[str, Stateful]  # registered beside them (a data position), moved with them
    durable: Durable | None  # the checkpoints under the ranks' own state (src/muster/worker/library/checkpoints.py)
    mesh: DeviceMesh | None = None  # this generation's, where the layout has one
    slot: int = -1  # this rank's place in the layout, kept for life (-1: none, or not placed yet)

    def card(self, step: int, device: torch.device) -> Card:
        """What this rank holds at `step`: its fingerprint and the model's layout."""

    def sync(self, step: int, channel: Channel, device: torch.device,
             progress: Callable[[str], None] | None = None) -> SyncResult:
        """In a newly formed group, at this rank's `step`: agree on the job's step and move what
        ranks lack. Returns what moved (SyncResult.bench set: this rank sits the generation out).
        Raises StateMismatch (this rank cannot hold the job's state), StateLost (no tier holds it),
        LayoutMismatch (the generation does not fit the layout); RuntimeError where the group broke
        (the reform holds for the next one). `progress(phase)` says what a long transfer is at."""

    def fingerprint(self, device: torch.device) -> bytes:
        """16 bytes over what this rank holds: equal on the ranks the layout keeps identical."""

    def card_ahead(self, step: int, device: torch.device) -> None:
        """At a reform's start, before this rank waits for its group: begin what `sync` will first need
        of this rank at `step` (its fingerprint), so that the wait hides it. `sync` takes it once."""

    def discard_step(self) -> None:
        """Gradients of an aborted step must not leak into the redo."""
        if self.model is not None:
            self.model.zero_grad(set_to_none=True)

    def still_replicated(self, when: str) -> None:
        """Raise ShardedStateRefused if state taken as replicated became sharded (`when`: where it was seen)."""

    def stepped(self, step: int) -> None:
        """At every completed step's boundary (peer snapshots are taken there)."""

    def snapshots(self) -> tuple[int, int]:
        """Peer snapshots' (every how many steps, host memory they take here), for `muster status`; (0, 0): none."""
        return 0, 0

    def hand_over(self) -> None:
        """At a stuck exit: leave what only this process holds for the slot's next process."""

    def saved_shard(self, rank: int) -> int | None:
        """The checkpoint shard this rank writes (None: none)."""

    def saved_tree(self) -> dict[str, Any]:
        """What a checkpoint of this rank's shard holds."""

    def restore_saved(self, tree: dict[str, Any]) -> None:
        """A checkpoint's tree into what this rank holds."""


class WholeState:
    """What a ReplicatedState keeps identical, as a replicated job holds it: the model's and the
    optimizer's state dicts and the extras (sharded.LocalShards: each DTensor's local shard)."""

    replicated = True  # (still_replicated refuses state sharded after register())

    @staticmethod
    def tree(s: ReplicatedState) -> dict[str, Any]:
        return {"model": s.model.state_dict() if s.model is not None else {},
                "optimizer": s.optimizer.state_dict() if s.optimizer is not None else None,
                "extras": {name: obj.state_dict() for name, obj in s.extras.items()}}

    @staticmethod
    def load(s: ReplicatedState, tree: dict[str, Any]) -> None:
        """A tree's optimizer state and extras into their objects (the model's tensors are received in place)."""
        if s.optimizer is not None and tree["optimizer"] is not None:
            s.optimizer.load_state_dict(tree["optimizer"])
        for name, obj in s.extras.items():
            obj.load_state_dict(tree["extras"][name])


@dataclass
class ReplicatedState(StateTransfer):
    """The StateTransfer of a data-parallel job: every rank holds the whole state (see the module's docstring)."""

    model: torch.nn.Module | None = None
    optimizer: Stateful | None = None
    extras: dict[str, Stateful] = field(default_factory=dict)
    bucket_bytes: int = BUCKET_BYTES
    # The ranks the state is identical across (a DeviceMesh's replicate group): its ranks are the
    # channel's; None: the whole group.
    group: dist.ProcessGroup | None = None
    # Fault injection for tests: called with (piece index, the staging bytes) after a receiver took a bucket.
    on_received: Callable[[int, torch.Tensor], None] | None = None
    durable: Durable | None = None  # the checkpoints under the ranks' own state (src/muster/worker/library/checkpoints.py)
    view: WholeState | Any = WholeState  # what of the objects' state it keeps identical (sharded.LocalShards)
    _ahead: tuple[int, Future[Card]] | None = field(default=None, repr=False)  # card_ahead's: the step, the card

    @classmethod
    def of(cls, model: torch.nn.Module | None, optimizer: Stateful | None, extras: dict[str, Stateful]) -> ReplicatedState:
        """The state to keep identical on every rank; sharded state is refused (ShardedStateRefused)."""
        shard = sharded(model, optimizer)
        if shard:
            raise ShardedStateRefused(f"{shard}, and no layout was declared: a lost shard would exist nowhere "
                                      f"else. {_LAYOUTS}")
        return cls(model, optimizer, extras)

    def still_replicated(self, when: str) -> None:
        """Refuse (ShardedStateRefused) state that became sharded after register() took it as replicated
        (fully_shard applied to the model afterwards): each rank's "copy" is a shard, so a reform's
        fingerprints and transfers would fail on every try, or worse, send one rank's shard to the others."""
        shard = self.view.replicated and sharded(self.model, self.optimizer)
        if shard:
            raise ShardedStateRefused(f"{shard} {when}, but register() took the state as replicated: it was "
                                      f"sharded after register(). {_LAYOUTS}")

    # ---- what this rank holds ---------------------------------------------------------

    def tree(self) -> dict[str, Any]:
        return self.view.tree(self)

    def _flat(self, device: torch.device) -> tuple[Any, list[torch.Tensor]]:
        """The described skeleton (TensorRefs in place of tensors) and the tensors, in its order."""
        leaves: list[tuple[str, torch.Tensor]] = []
        skeleton = flatten(self.tree(), leaves)
        tensors = [t for _, t in leaves]
        refs = [TensorRef(i, tuple(t.shape), str(t.dtype).removeprefix("torch."), t.element_size(),
                          t.device == device) for i, t in enumerate(tensors)]
        return describe(skeleton, refs), tensors

    def card(self, step: int, device: torch.device) -> Card:
        described, tensors = self._flat(device)
        return _card(step, described, tensors, device)

    def card_ahead(self, step: int, device: torch.device) -> None:
        """The host tensors' hash (600 MB: ~0.1 s) on a thread while the group forms: xxhash lets go of
        the GIL, and nothing changes the state until `sync` (a device's sums are quick: not begun)."""
        if device.type != "cpu":
            return
        described, tensors = self._flat(device)  # (the state_dicts read on the training thread)
        card: Future[Card] = Future()
        self._ahead = (step, card)

        def take() -> None:
            try:
                card.set_result(_card(step, described, tensors, device))
            except BaseException as exc:  # (said where sync takes it)
                card.set_exception(exc)
        # Not a daemon: the interpreter waits for it at exit (a hash: bounded by the state's size). A daemon
        # thread still inside torch when a script exits (a rank fenced out while its group formed) is ended
        # by the interpreter's finalization from torch's noexcept code: std::terminate, SIGABRT.
        threading.Thread(target=take, name="muster-card-ahead").start()

    def saved_shard(self, rank: int) -> int | None:
        """The checkpoint shard this rank writes: the whole state, by rank 0."""
        return 0 if rank == 0 else None

    def saved_tree(self) -> dict[str, Any]:
        return self.tree()

    def restore_saved(self, tree: dict[str, Any]) -> None:
        """A checkpoint's tree into the model, optimizer and extras."""
        if self.model is not None:
            self.model.load_state_dict(tree["model"])
        self.view.load(self, tree)

    def fingerprint(self, device: torch.device) -> bytes:
        """16 bytes over all the state (model, optimizer, extras), to compare replicas."""
        described, tensors = self._flat(device)
        return fingerprint(described, tensors, device)

    # ---- after a reform ---------------------------------------------------------------

    def sync(self, step: int, channel: Channel, device: torch.device,
             progress: Callable[[str], None] | None = None) -> SyncResult:
        self.still_replicated("at a reform")
        started = time.perf_counter()
        described, tensors = self._flat(device)
        # Begun at the reform's start, if it was at this step (taken once: a transfer cut short by a
        # fault may have changed the state before the next try)
        ahead, self._ahead = self._ahead, None
        mine = ahead[1].result() if ahead is not None and ahead[0] == step else _card(step, described, tensors, device)
        fingerprinted = time.perf_counter()
        # With checkpoints, each card carries the newest complete one its rank sees
        seen = self.durable.complete()[:1] if self.durable is not None else ()
        said = [v.decode().split(" ") for v in channel.exchange(
            "state/card", mine.encode() + (f" {seen[0] if seen else -1}" if self.durable is not None else ""))]
        cards = [Card.decode(" ".join(v[:3])) for v in said]
        newest = max((int(v[3]) for v in said if len(v) > 3), default=-1)
        p, tier, split = plan(cards), "live", undecided(cards)
        if self.durable is not None and (split or newest > p.reference.step):
            # The durable tier: newer than any rank's state, or the replicas at the job's step disagree
            # with no majority (neither is taken: every rank goes back to the checkpoint)
            resumed = self.durable.resume(channel, 0, self.restore_saved, -1 if split else p.reference.step, newest)
            if resumed is not None:
                described, tensors = self._flat(device)
                mine = _card(resumed, described, tensors, device)
                p = plan([Card.decode(v) for v in channel.exchange("state/card/resumed", mine.encode())])
                split, tier = "", "checkpoint"
        if split and self.durable is not None:
            raise StateLost(f"the replicas at step {p.reference.step} disagree ({split}) and no checkpoint "
                            "holds a step to go back to: neither is trained on")
        if split:  # no durable tier to settle it: named loudly, and the lowest rank's state is taken, as before
            log.error("replicas_disagree", step=p.reference.step, split=split, taken=p.sources[0],
                      remedy="register(checkpoint=Checkpoints(...)) lets the ranks go back to a verified step")
        result = SyncResult(p.reference.step, p, p.role(channel.rank), tier=tier)
        result.phases = {"fingerprint_s": fingerprinted - started, "agree_s": time.perf_counter() - fingerprinted}
        if not p.moves:
            return result
        if channel.rank == p.sources[0]:
            channel.publish("state/skeleton", encode(described))
        reference = decode(channel.fetch("state/skeleton"))
        if _layout(reference) != p.reference.layout:
            raise StateMismatch(f"the skeleton published for step {p.reference.step} does not describe the model "
                                "layout its sources' cards agreed on: not taken")
        refs = sorted(paths(reference).values(), key=lambda r: r.index)
        mismatch = first_mismatch(reference, described) if result.role == "incompatible" else ""
        targets, fixups = (self._targets(reference, described, tensors, device) if result.role == "receiver"
                           else (tensors if result.role == "source" else None, []))
        cut = pieces(refs, self.bucket_bytes)
        receivers = p.receivers
        while True:
            result.attempts += 1
            taking = channel.rank in receivers
            began = time.perf_counter()
            sent, received = _move(cut, p.sources, receivers, channel.rank, targets if taking or result.role == "source"
                                   else None, device, self.bucket_bytes, _Progress(sum(r.nbytes for r in refs), progress),
                                   self.on_received if taking else None, self.group)
            moved = time.perf_counter()
            result.transfer_s += moved - began
            result.sent, result.received = result.sent + sent, result.received + received
            verdict = "ok"
            if taking:
                for original, received_into in fixups:
                    original.copy_(received_into)
                self.view.load(self, unflatten(reference, targets))
                got = self.card(p.reference.step, device)
                verdict = "ok" if got.fingerprint == p.reference.fingerprint else "bad"
            verdicts = channel.exchange(f"state/verdict/{result.attempts}", verdict)
            result.phases["verify_s"] = result.phases.get("verify_s", 0.0) + time.perf_counter() - moved
            bad = tuple(r for r in receivers if verdicts[r] != b"ok")
            if bad:
                log.warning("state_transfer_corrupted", attempt=result.attempts, ranks=list(bad)[:16],
                            fingerprint=p.reference.fingerprint)
            if not bad or result.attempts >= TRANSFER_ATTEMPTS:
                break
            receivers = bad
        if mismatch:
            raise StateMismatch(f"this rank's model cannot take the job's state: {mismatch}")
        if channel.rank in bad:
            raise StateMismatch(f"the state received from ranks {list(p.sources)[:8]} does not match their "
                                f"fingerprint {p.reference.fingerprint} after {result.attempts} attempts")
        return result

    def _targets(self, reference: Any, described: Any, tensors: list[torch.Tensor],
                 device: torch.device) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
        """Where a receiver takes each of the reference's tensors: its own tensor at the same path
        where it has one of that shape and dtype (in place), else a new one (optimizer state it has
        not made yet). A non-contiguous one of its own is received beside it and copied in after."""
        own = {path: tensors[r.index] for path, r in paths(described).items()}
        targets: list[torch.Tensor] = []
        fixups: list[tuple[torch.Tensor, torch.Tensor]] = []
        by_index = sorted(paths(reference).items(), key=lambda kv: kv[1].index)
        for path, ref in by_index:
            t = own.get(path)
            if t is None or tuple(t.shape) != ref.shape or str(t.dtype).removeprefix("torch.") != ref.dtype:
                t = torch.empty(ref.shape, dtype=DTYPES[ref.dtype], device=device if ref.on_device else "cpu")
            elif not t.is_contiguous():
                fixups.append((t, torch.empty_like(t, memory_format=torch.contiguous_format)))
                t = fixups[-1][1]
            targets.append(t.detach())
        return targets, fixups


def sharded(model: torch.nn.Module | None, optimizer: Any) -> str:
    """What of the state is sharded across ranks ("" if nothing): a rank's shard exists nowhere
    else, so sending one rank's state to the others (this module's only plan) would corrupt it."""
    # Looked up, not imported: a script using them has imported them (and importing FSDP costs others time).
    fsdp, zero, dtensor = (sys.modules.get(m) for m in ("torch.distributed.fsdp", "torch.distributed.optim",
                                                          "torch.distributed.tensor"))
    fsdp_types = (fsdp.FSDPModule, fsdp.FullyShardedDataParallel) if fsdp is not None else ()
    distributed = (lambda t: isinstance(t, dtensor.DTensor)) if dtensor is not None else (lambda t: False)
    for name, module in (model.named_modules() if model is not None and fsdp_types else ()):
        if isinstance(module, fsdp_types):
            return f"the model's {'module ' + repr(name) if name else 'root module'} is sharded by FSDP"
    for name, t in (model.named_parameters() if model is not None else ()):
        if distributed(t):
            return f"the model's parameter {name!r} is a DTensor"
    if zero is not None and isinstance(optimizer, zero.ZeroRedundancyOptimizer):
        return "the optimizer is a ZeroRedundancyOptimizer (each rank holds a shard of its state)"
    for group in getattr(optimizer, "param_groups", ()):
        if any(distributed(t) for t in group["params"]):
            return "the optimizer's parameters are DTensors"
    return ""


def first_mismatch(reference: Any, described: Any) -> str:
    """The first of the reference model's tensors this rank's model lacks or holds otherwise."""
    want = paths(reference.get("model", {}))
    have = paths(described.get("model", {}))
    for path, ref in want.items():
        mine = have.get(path)
        if mine is None:
            return f"the job's model has {path.lstrip('/')} {list(ref.shape)} {ref.dtype}; this one has no such tensor"
        if (mine.shape, mine.dtype) != (ref.shape, ref.dtype):
            return (f"{path.lstrip('/')} is {list(mine.shape)} {mine.dtype} here, "
                    f"{list(ref.shape)} {ref.dtype} in the job's model")
    extra = next(iter(set(have) - set(want)), None)
    return f"this model has {extra.lstrip('/')}, which the job's lacks" if extra else "the models differ"


def _card(step: int, described: Any, tensors: list[torch.Tensor], device: torch.device) -> Card:
    return Card(step, fingerprint(described, tensors, device).hex(), _layout(described))


def _layout(described: Any) -> str:
    """The model's tensors' names, shapes and dtypes, hashed: equal on ranks built from the same code."""
    model = described.get("model", {}) if isinstance(described, dict) else {}
    return xxhash.xxh3_64(repr(sorted((p, r.shape, r.dtype) for p, r in paths(model).items())).encode()).hexdigest()


def fingerprint(described: Any, tensors: list[torch.Tensor], device: torch.device) -> bytes:
    """xxh3-128 over the skeleton and every tensor's bits: host tensors hashed where they lie (no
    copy), device tensors summed on the device (two wrapping int64 sums of their words, one
    weighted by position), so that only 16 bytes a tensor cross to the host."""
    h = xxhash.xxh3_128(encode(described))
    on_device = []
    for t in tensors:
        if t.device.type == "cpu":
            h.update(memoryview(_bytes(t).numpy()))
        else:
            on_device.append(_device_sums(t))
    if on_device:
        h.update(torch.stack(on_device).cpu().numpy().tobytes())
    return h.digest()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _device_sums(t: torch.Tensor) -> torch.Tensor:
    b = _bytes(t)
    words = b.view(torch.int32) if b.numel() % 4 == 0 and b.data_ptr() % 4 == 0 else b
    n = words.numel() // _POSITION_WEIGHTS * _POSITION_WEIGHTS
    weights = torch.arange(1, _POSITION_WEIGHTS + 1, dtype=torch.int64, device=t.device) * 2654435761
    weighted = (words[:n].view(-1, _POSITION_WEIGHTS).sum(0, dtype=torch.int64) * weights).sum()
    return torch.stack([words.sum(dtype=torch.int64), weighted])


class _Progress:
    """A transfer's progress in the rank's log (and its reported phase) every PROGRESS_EVERY_S,
    and its bound: TRANSFER_MIN_S plus TRANSFER_SLACK times its size at the rate measured so far."""

    def __init__(self, total: int, report: Callable[[str], None] | None):
        self.total, self.report = total, report
        self.started = self.said = time.monotonic()
        self.done = 0
        if report is not None:  # (reported at once: the leader lets a group whose ranks move state form for longer)
            report(f"state transfer 0/{total >> 20} MiB")

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.monotonic()
        elapsed = now - self.started
        rate = self.done / elapsed if elapsed > 0 else 0.0
        if rate and elapsed > TRANSFER_MIN_S + TRANSFER_SLACK * self.total / rate:
            raise RuntimeError(f"state transfer stalled: {self.done >> 20} of {self.total >> 20} MiB in "
                               f"{elapsed:.0f}s, past its bound")
        if now - self.said >= PROGRESS_EVERY_S:
            self.said = now
            eta = (self.total - self.done) / rate if rate else None
            log.info("state_transfer", done_mib=self.done >> 20, total_mib=self.total >> 20,
                     rate_mib_s=round(rate / (1 << 20), 1), eta_s=round(eta, 1) if eta is not None else None)
            if self.report is not None:
                self.report(f"state transfer {self.done >> 20}/{self.total >> 20} MiB"
                            + (f", {eta:.0f}s left" if eta is not None else ""))


def _move(cut: list[Piece], sources: tuple[int, ...], receivers: tuple[int, ...], rank: int,
          tensors: list[torch.Tensor] | None, device: torch.device, bucket_bytes: int, progress: _Progress,
          on_received: Callable[[int, torch.Tensor], None] | None, group: dist.ProcessGroup | None) -> tuple[int, int]:
    """Send every piece from its source to the receivers, up to MAX_IN_FLIGHT at once. A source sends
    from `tensors` (its own); a receiver takes into `tensors` (its targets), in place where it can; a
    piece that is not in place goes through one of two staging buffers. Returns (bytes sent, received).

    Ranks are `group`'s (None: the whole group's). On gloo, point to point: receiver j takes piece k
    from sources[(k + j) mod n], and nobody else takes part: the bytes cross once, split over the
    sources. Otherwise (NCCL, whose point-to-point calls would set up communicators of their own)
    piece k is broadcast from sources[k mod n] and the other ranks take it into staging and drop it."""
    taking = rank in receivers
    point_to_point = dist.get_backend(group) == "gloo"
    free: list[torch.Tensor | None] = [None, None]  # the staging buffers not in use (made when first needed)
    in_flight: deque = deque()
    sent = received = 0

    def finish() -> None:
        k, works, piece, buf, staged, took, unpack = in_flight.popleft()
        for work in works:
            work.wait()
        if took and on_received is not None:
            on_received(k, buf)
        if unpack:
            for index, a, b, off in piece.parts:
                _bytes(tensors[index])[a:b].copy_(buf[off:off + b - a])
        if staged is not None:
            free.append(staged)
        progress.advance(piece.nbytes)

    for k, piece in enumerate(cut):
        destinations: tuple[int, ...] = ()
        if not point_to_point:
            root = sources[k % len(sources)]
        elif taking:
            root = sources[(k + receivers.index(rank)) % len(sources)]
        else:
            root = rank
            destinations = tuple(r for j, r in enumerate(receivers) if sources[(k + j) % len(sources)] == rank)
            if not destinations:
                continue  # (not this source's piece for any receiver, or a rank that takes no part)
        while len(in_flight) >= MAX_IN_FLIGHT:
            finish()
        staged = None
        if piece.direct and tensors is not None and (rank == root or taking) and _in_place(
                tensors[piece.parts[0][0]], device):
            index, a, b, _ = piece.parts[0]
            buf = _bytes(tensors[index])[a:b]
        else:
            while not free:
                finish()
            staged = free.pop()
            if staged is None:
                staged = torch.empty(bucket_bytes, dtype=torch.uint8, device=device)
            buf = staged[:piece.nbytes]
            if rank == root:
                for index, a, b, off in piece.parts:
                    buf[off:off + b - a].copy_(_bytes(tensors[index])[a:b])
        if not point_to_point:
            works = [dist.broadcast(buf, group=group, group_src=root, async_op=True)]
        elif taking:
            works = [dist.irecv(buf, group=group, group_src=root)]
        else:
            works = [dist.isend(buf, group=group, group_dst=r) for r in destinations]
        if rank == root:
            sent += piece.nbytes * max(1, len(destinations))
        elif taking:
            received += piece.nbytes
        took = taking and rank != root
        in_flight.append((k, works, piece, buf, staged, took, took and staged is not None))
    while in_flight:
        finish()
    return sent, received


def _in_place(t: torch.Tensor, device: torch.device) -> bool:
    return t.device == device and t.is_contiguous()
