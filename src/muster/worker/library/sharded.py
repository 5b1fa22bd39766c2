"""Sharded training state (FSDP2 on an HSDP mesh) that survives a lost rank: each shard is held by
every replica group, so a lost one is taken from another replica, and while a group lacks a rank
the other groups train without it.

A job declares its layout at register: `Replicas(R, S)`, R replica groups (R >= 2) of S shards, a
mesh with dimensions ("replicate", "shard"), and a `build(mesh) -> (model, optimizer)` the library
calls on every generation's mesh. FSDP2 keeps the process groups it was built on for life, so after
a reform the model is built again on the new mesh rather than its groups swapped.

Every rank keeps a mesh slot (replica r, shard s; slot = r * S + s) for life: the coordinator
numbers ranks by node age, so a replacement gets whatever rank is last, not the lost one's. After
each reform the ranks tell each other their slots and steps on the generation's store, survivors
keep their slots, fresh processes take the free ones (the groups missing fewest first), and the
mesh is laid out over the replica groups that can train (`place`): the complete ones, provided
that between them they hold every shard at the job's step (the highest a survivor holds). The
ranks of the other groups are benched: in the generation, out of the mesh, their shards kept, until
a generation completes their group (Worker waits for it). Then, on the training groups:

1. a survivor copies its own local shards (parameters, optimizer state) into the newly built model
   and optimizer: its shards never cross the network;
2. the ranks holding the same shard index (the mesh's replicate group) keep their local shards
   identical as ReplicatedState does for a whole model, at the highest step among them: where they
   agree nothing moves; a replacement, or a benched survivor whose group is complete again (it
   missed the steps trained without it), receives its shard in place, striped over the healthy
   replicas.

FSDP2 averages gradients over the mesh it was built on, so while a group is out the loss is
averaged over the R - 1 groups' batches: a smaller global batch, correctly scaled.

A shard whose latest step is lost in every replica at once (e.g. the ranks holding it in every
replica lost together) cannot be recovered: the job ends saying so rather than train on a stale or
freshly initialised shard.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog
import torch
import torch.distributed as dist

from muster.worker.errors import LayoutMismatch, StateLost, StateMismatch
from muster.worker.library.state import (Bench, Channel, ReplicatedState, Stateful, StateTransfer, SyncResult,
                                         WholeState)
from muster.worker.library.transfer import BUCKET_BYTES, Card, SyncPlan

if TYPE_CHECKING:  # (imported where used: they cost every rank's start half a second, sharded or not)
    from torch.distributed.device_mesh import DeviceMesh

    from muster.worker.library.checkpoints import Durable

log = structlog.get_logger(__name__)

MESH_DIMS = ("replicate", "shard")
BENCHED = "benched"  # SyncResult.role of a rank whose replica group is out of the generation's mesh
Build = Callable[["DeviceMesh"], tuple[torch.nn.Module, Any]]


@dataclass(frozen=True)
class Replicas:
    """R replica groups of S ranks each; every group holds the whole state, sharded S ways."""

    replicas: int
    shards: int

    def __post_init__(self) -> None:
        if self.replicas < 2:
            raise ValueError(f"Replicas({self.replicas}, {self.shards}): a lost shard is recovered from another "
                             "replica, so at least 2 are needed (sharding without replicas: layout=Snapshots(shards), "
                             "peer snapshots)")
        if self.shards < 1:
            raise ValueError(f"Replicas({self.replicas}, {self.shards}): at least 1 shard")

    @property
    def world_size(self) -> int:
        return self.replicas * self.shards

    def mesh(self, groups: Sequence[Sequence[int]], device_type: str) -> DeviceMesh:
        """The (replicate, shard) mesh with the ranks of each training group (its S slots in
        order) in a row: every rank of the generation must call it, in or out of it."""
        from torch.distributed.device_mesh import DeviceMesh

        return DeviceMesh(device_type, torch.tensor([list(g) for g in groups], dtype=torch.int),
                          mesh_dim_names=MESH_DIMS)


@dataclass(frozen=True)
class Placement:
    """A generation laid out on the mesh (the same on every rank)."""

    rank_of_slot: tuple[int, ...]  # -1: an empty slot
    training: tuple[int, ...]  # the replica groups in the mesh, ascending; the others are benched
    step: int  # the job's step: the highest a survivor holds (0 at a first formation)
    unheld: tuple[int, ...] = ()  # shards at the step no rank here holds, while ranks outside may

    def groups(self, layout: Replicas) -> list[tuple[int, ...]]:
        """The ranks of each training group, by shard index."""
        s = layout.shards
        return [self.rank_of_slot[r * s:(r + 1) * s] for r in self.training]

    def why_benched(self, replica: int, layout: Replicas) -> str:
        """Why `replica`'s ranks are out of this generation's mesh."""
        if self.unheld:
            return (f"replica group {replica} waits: no rank of this generation holds shard(s) {list(self.unheld[:8])} "
                    f"at step {self.step}, and ranks the job's size rules left out may: for a generation with them")
        s = layout.shards
        empty = [slot for slot in range(replica * s, (replica + 1) * s) if self.rank_of_slot[slot] < 0]
        if empty:
            return (f"replica group {replica} lacks slot(s) {empty}: out of the data-parallel dimension until a "
                    "replacement or a spare fills them")
        if self.step == 0 and not self.training:
            return f"replica group {replica} waits for the whole mesh of {layout}: a first formation trains on it only"
        return (f"replica group {replica} waits: the complete groups lack a shard at step {self.step}, "
                "held only in incomplete ones")


def place(claims: Sequence[tuple[int, int]], layout: Replicas, left_out: int = 0) -> Placement:
    """The generation on the mesh, from each rank's claim (its slot, -1 for a fresh process; and
    its step): a claim is kept, fresh ranks fill the free slots, those of the groups missing fewest
    first, in rank order. The same on every rank. A shard at the job's step that no rank here holds
    is lost only if no usable slot of the job is outside the generation (`left_out`); otherwise
    every rank waits for a generation with its holder (the coordinator places slots, not shards)."""
    if len(claims) > layout.world_size:
        raise LayoutMismatch(f"the generation has {len(claims)} ranks; the layout {layout} has {layout.world_size} "
                             f"slots (set the job's max size to {layout.world_size}: more ranks wait as spares)")
    s = layout.shards
    rank_of_slot = [-1] * layout.world_size
    fresh = []
    for rank, (slot, _) in enumerate(claims):
        if 0 <= slot < layout.world_size and rank_of_slot[slot] < 0:
            rank_of_slot[slot] = rank
        else:
            fresh.append(rank)  # (a duplicate claim cannot come from the coordinator's maps: taken as fresh)
    held = {slot: claims[rank][1] for slot, rank in enumerate(rank_of_slot) if rank >= 0}  # survivor's slot -> step
    step = max(held.values(), default=0)
    lost = sorted(set(range(s)) - {slot % s for slot, at in held.items() if at == step})
    if held and lost and not left_out:
        raise StateMismatch(f"shard(s) {lost[:8]} of {layout} at step {step} were lost in every replica at once: no "
                            "rank holds them. Restart from your checkpoint")
    empty = [sum(r < 0 for r in rank_of_slot[g * s:(g + 1) * s]) for g in range(layout.replicas)]
    free = sorted((slot for slot, rank in enumerate(rank_of_slot) if rank < 0),
                  key=lambda slot: (empty[slot // s], slot))
    for rank, slot in zip(fresh, free):
        rank_of_slot[slot] = rank
    complete = tuple(g for g in range(layout.replicas) if all(r >= 0 for r in rank_of_slot[g * s:(g + 1) * s]))
    if not held:  # a first formation: every shard from `build`, trained on the whole mesh only
        training = complete if len(complete) == layout.replicas else ()
    else:  # between them the complete groups must hold every shard at the job's step
        among = {slot % s for slot, at in held.items() if at == step and slot // s in complete}
        training = complete if len(among) == s else ()
    return Placement(tuple(rank_of_slot), training, step, tuple(lost) if held else ())


@dataclass
class ShardedState(StateTransfer):
    """The StateTransfer of a sharded job with replica groups (see the module's docstring)."""

    build: Build
    layout: Replicas
    extras: dict[str, Stateful] = field(default_factory=dict)
    # Groups made inside are aborted with the generation's group (Comm.subgroups).
    subgroups: Callable[[], AbstractContextManager] = nullcontext
    on_built: Callable[[torch.nn.Module, Any], None] = lambda model, optimizer: None  # (the step guards)
    bucket_bytes: int = BUCKET_BYTES
    model: torch.nn.Module | None = None
    optimizer: Any = None
    mesh: DeviceMesh | None = None
    slot: int = -1  # r * S + s, kept for life; -1 until placed
    durable: Durable | None = None  # the checkpoints under the replicas (src/muster/worker/library/checkpoints.py)
    # The optimizer whose state is this rank's shard's (Snapshots: a ZeroRedundancyOptimizer's local one)
    unwrap: Callable[[Any], Any] = lambda optimizer: optimizer
    _kept: dict[str, Any] | None = None  # a benched survivor's shards (LocalShards' tree), until its group trains

    def __post_init__(self) -> None:
        # FSDP2's first call imports torch._dynamo (1.0 s of a 1.3 s first step here): paid at
        # register, before this rank joins, not by a spare while the job waits for its slot.
        import torch._dynamo  # noqa: F401

    def _shards(self, group: dist.ProcessGroup | None = None) -> ReplicatedState:
        """This rank's local shards as a ReplicatedState across `group` (the replicate group)."""
        return ReplicatedState(self.model, self.unwrap(self.optimizer), self.extras, bucket_bytes=self.bucket_bytes,
                               group=group, view=LocalShards)

    def card(self, step: int, device: torch.device) -> Card:
        return self._shards().card(step, device)

    def fingerprint(self, device: torch.device) -> bytes:
        """Of this rank's shards: equal across replicas, different across shard indices."""
        return self._shards().fingerprint(device)

    def saved_shard(self, rank: int) -> int | None:
        """The checkpoint shard this rank writes: its shard index, by the first training replica's rank
        (a benched rank has no mesh)."""
        if self.mesh is None or self.mesh.get_local_rank(MESH_DIMS[0]) != 0:
            return None
        return self.slot % self.layout.shards

    def saved_tree(self) -> dict[str, Any]:
        return self._shards().tree()

    def restore_saved(self, tree: dict[str, Any]) -> None:
        """A checkpoint's shard into the model and optimizer built on this generation's mesh, and the extras."""
        restore(self.model, self._shards().optimizer, tree)
        for name, obj in self.extras.items():
            obj.load_state_dict(tree["extras"][name])

    def sync(self, step: int, channel: Channel, device: torch.device,
             progress: Callable[[str], None] | None = None) -> SyncResult:
        started = time.perf_counter()
        holds = self.model is not None or self._kept is not None  # (a rank benched since it started holds nothing)
        claims = [claim(v) for v in channel.exchange("mesh/slot", f"{self.slot if holds else -1}:{step}")]
        try:
            placement, lost = place(claims, self.layout, channel.left_out), False
        except StateMismatch as exc:  # a shard lost in every replica: the durable tier, or the run ends
            if self.durable is None:
                raise StateLost(str(exc)) from exc
            placement, lost = place([(-1, 0)] * len(claims), self.layout), True  # laid out as a first formation
        # Tensors only: the old model and optimizer hold the old generation's groups, dropped here.
        if self.model is not None and not lost:
            self._kept = self._shards().tree()
        if lost:
            self._kept = None
        self.model = self.optimizer = self.mesh = None
        self.slot = placement.rank_of_slot.index(channel.rank)
        replica, shard = divmod(self.slot, self.layout.shards)
        mesh = None
        if placement.training:
            with self.subgroups():
                mesh = self.layout.mesh(placement.groups(self.layout), device.type)
        meshed = time.perf_counter()
        if replica not in placement.training:
            bench = Bench(placement.why_benched(replica, self.layout), others_train=bool(placement.training))
            log.info("replica_benched", slot=self.slot, step=step, job_step=placement.step, training=placement.training,
                     why=bench.why)
            return SyncResult(step, SyncPlan(Card(step, "", ""), (), (), ()), BENCHED,
                              phases={"mesh_s": meshed - started}, bench=bench)
        self.mesh = mesh
        self.model, self.optimizer = self.build(self.mesh)
        self.on_built(self.model, self.optimizer)
        built = time.perf_counter()
        if self._kept is not None:
            restore(self.model, self.optimizer, self._kept)
            self._kept = None
        resumed = None
        if self.durable is not None and all(slot < 0 for slot, _ in claims) or lost:
            # a first formation (the job started again, every rank lost) or a lost shard: every rank of the
            # generation trains here (a first formation's mesh is whole), so all take part
            resumed = self.durable.resume(channel, shard, self.restore_saved, -1 if lost else 0)
            if lost and resumed is None:
                raise StateLost(f"a shard of {self.layout} was lost in every replica at once and no checkpoint "
                                f"is in {self.durable.spec.dir}")
        restored = time.perf_counter()
        replicate = self.mesh.get_group(MESH_DIMS[0])
        job_step = placement.step if resumed is None else resumed
        result = self._shards(replicate).sync(job_step if resumed is not None else step, ReplicaChannel(
            channel, shard, dist.get_rank(replicate), len(placement.training)), device, progress)
        if result.step != job_step:  # (cannot happen: place() saw every shard at the step in a training group)
            raise StateMismatch(f"shard {shard} is at step {result.step} after the reform, the job at {job_step}")
        result.tier = "checkpoint" if resumed is not None else result.tier
        result.phases = {"mesh_s": meshed - started, "build_s": built - meshed, "restore_s": restored - built,
                         **result.phases}
        log.info("mesh_placed", slot=self.slot, replica=replica, shard=shard, training=placement.training,
                 fresh=sum(c[0] < 0 for c in claims), role=result.role, steps_missed=placement.step - step)
        return result


def claim(value: bytes) -> tuple[int, int]:
    """A rank's "slot:step" (slot -1: a fresh process)."""
    slot, step = value.decode().split(":")
    return int(slot), int(step)


class LocalShards:
    """A rank's state as plain tensors (each DTensor's local shard, a view of its storage): what a
    ReplicatedState over it keeps identical across the replicate group, received in place."""

    replicated = False  # sharded by its layout: nothing for still_replicated to refuse

    @staticmethod
    def tree(s: ReplicatedState) -> dict[str, Any]:
        return local(WholeState.tree(s))

    @staticmethod
    def load(s: ReplicatedState, tree: dict[str, Any]) -> None:
        """As WholeState loads it, the optimizer's state onto this generation's parameters."""
        if s.optimizer is not None and tree["optimizer"] is not None:
            tree = {**tree, "optimizer": on_params(s.optimizer, tree["optimizer"])}
        WholeState.load(s, tree)


class ReplicaChannel:
    """The generation's store as the ranks holding one shard index see it: ranks are their replicate
    group's, keys their own."""

    def __init__(self, channel: Channel, shard: int, rank: int, world_size: int):
        self.channel, self.prefix, self.rank, self.world_size = channel, f"shard{shard}/", rank, world_size
        self.left_out = channel.left_out

    def exchange(self, key: str, value: str | bytes) -> list[bytes]:
        self.publish(f"{key}/{self.rank}", value.encode() if isinstance(value, str) else value)
        return [self.fetch(f"{key}/{r}") for r in range(self.world_size)]

    def publish(self, key: str, value: bytes) -> None:
        self.channel.publish(self.prefix + key, value)

    def fetch(self, key: str) -> bytes:
        return self.channel.fetch(self.prefix + key)


def local(tree: Any) -> Any:
    """`tree` with every DTensor replaced by its local shard (no copy)."""
    from torch.distributed.tensor import DTensor

    def walk(t: Any) -> Any:
        if isinstance(t, dict):
            return {k: walk(v) for k, v in t.items()}
        if isinstance(t, (list, tuple)):
            return type(t)(walk(v) for v in t)
        return t.to_local() if isinstance(t, DTensor) else t
    return walk(tree)


def on_params(optimizer: Any, state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state_dict of local tensors, each one shaped like its parameter's local shard
    made a DTensor on that parameter's mesh (no copy), so that load_state_dict takes it."""
    from torch.distributed.tensor import DTensor

    params = [p for group in optimizer.param_groups for p in group["params"]]

    def like(value: Any, p: torch.Tensor) -> Any:
        if (isinstance(p, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor)
                and value.dim() and value.shape == p.to_local().shape):
            return DTensor.from_local(value, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                                      run_check=False)
        return value
    return {**state, "state": {i: {k: like(v, params[i]) for k, v in s.items()} for i, s in state["state"].items()}}


def restore(model: torch.nn.Module, optimizer: Any, kept: dict[str, Any]) -> None:
    """A survivor's own shards (`kept`: LocalShards' tree of its old objects) into the objects built
    on the new mesh: the same slot, so the same shapes; parameters copied, optimizer state re-wrapped."""
    with torch.no_grad():
        for name, t in local(model.state_dict()).items():
            t.copy_(kept["model"][name])
    if optimizer is not None and kept["optimizer"] is not None:
        optimizer.load_state_dict(on_params(optimizer, kept["optimizer"]))
