"""Sharded training state (FSDP2 on an HSDP mesh) that survives a lost rank: each shard is held by
every replica group, so a lost one is taken from another replica.

A job declares its layout at register: `Replicas(R, S)`, R replica groups (R >= 2) of S shards, a
mesh of R x S ranks with dimensions ("replicate", "shard"), and a `build(mesh) -> (model, optimizer)`
the library calls on every generation's mesh. FSDP2 keeps the process groups it was built on for
life, so after a reform the model is built again on the new mesh rather than its groups swapped.

Every rank keeps a mesh slot (replica r, shard s; slot = r * S + s) for life: the coordinator
numbers ranks by node age, so a replacement gets whatever rank is last, not the lost one's. After
each reform the ranks tell each other their slots on the generation's store, survivors keep theirs,
fresh processes take the free ones in rank order, and the mesh is laid out by slot. Then:

1. a survivor copies its own local shards (parameters, optimizer state) into the newly built model
   and optimizer: its shards never cross the network;
2. the ranks holding the same shard index (the mesh's replicate group) keep their local shards
   identical as ReplicatedState does for a whole model: where they agree nothing moves; a
   replacement receives its shard in place, striped over the healthy replicas;
3. every rank must then be at the same step, or the job ends (StateMismatch).

A shard lost in every replica at once (e.g. R nodes lost together, each holding it) cannot be
recovered: the job ends saying so rather than train on a freshly initialised shard.
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

from muster.worker.library.errors import LayoutMismatch, StateMismatch
from muster.worker.library.state import Channel, ReplicatedState, Stateful, SyncResult
from muster.worker.library.transfer import BUCKET_BYTES, Card, unflatten

if TYPE_CHECKING:  # (imported where used: they cost every rank's start half a second, sharded or not)
    from torch.distributed.device_mesh import DeviceMesh

log = structlog.get_logger(__name__)

MESH_DIMS = ("replicate", "shard")
Build = Callable[["DeviceMesh"], tuple[torch.nn.Module, Any]]


@dataclass(frozen=True)
class Replicas:
    """R replica groups of S ranks each; every group holds the whole state, sharded S ways."""

    replicas: int
    shards: int

    def __post_init__(self) -> None:
        if self.replicas < 2:
            raise ValueError(f"Replicas({self.replicas}, {self.shards}): a lost shard is recovered from another "
                             "replica, so at least 2 are needed (sharding without replicas needs peer snapshots, "
                             "not built yet)")
        if self.shards < 1:
            raise ValueError(f"Replicas({self.replicas}, {self.shards}): at least 1 shard")

    @property
    def world_size(self) -> int:
        return self.replicas * self.shards

    def mesh(self, rank_of_slot: Sequence[int], device_type: str) -> DeviceMesh:
        """The (replicate, shard) mesh with slot r * S + s at [r, s]: every rank must call it."""
        from torch.distributed.device_mesh import DeviceMesh

        ranks = torch.tensor(list(rank_of_slot), dtype=torch.int).view(self.replicas, self.shards)
        return DeviceMesh(device_type, ranks, mesh_dim_names=MESH_DIMS)


def place(claims: Sequence[int], layout: Replicas) -> list[int]:
    """The rank in each mesh slot, from each rank's claim (its slot, -1 for a fresh process): a
    claim is kept, fresh ranks fill the free slots in rank order. The same on every rank."""
    if len(claims) != layout.world_size:
        raise LayoutMismatch(f"the generation has {len(claims)} ranks; the layout {layout} needs exactly "
                             f"{layout.world_size} (set the job's world_size_multiple and max size to it)")
    rank_of_slot = [-1] * layout.world_size
    fresh = []
    for rank, slot in enumerate(claims):
        if 0 <= slot < layout.world_size and rank_of_slot[slot] < 0:
            rank_of_slot[slot] = rank
        else:
            fresh.append(rank)  # (a duplicate claim cannot come from the coordinator's maps: taken as fresh)
    held = {slot % layout.shards for slot, rank in enumerate(rank_of_slot) if rank >= 0}
    lost = sorted(set(range(layout.shards)) - held)
    if held and lost:
        raise StateMismatch(f"shard(s) {lost[:8]} of {layout} were lost in every replica at once: no rank holds "
                            "them. Restart from your checkpoint")
    free = (slot for slot, rank in enumerate(rank_of_slot) if rank < 0)
    for rank, slot in zip(fresh, free):
        rank_of_slot[slot] = rank
    return rank_of_slot


@dataclass
class ShardedState:
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

    def __post_init__(self) -> None:
        # FSDP2's first call imports torch._dynamo (1.0 s of a 1.3 s first step here): paid at
        # register, before this rank joins, not by a spare while the job waits for its slot.
        import torch._dynamo  # noqa: F401

    def _shards(self, group: dist.ProcessGroup | None = None) -> LocalShards:
        return LocalShards(self.model, self.optimizer, self.extras, bucket_bytes=self.bucket_bytes, group=group)

    def card(self, step: int, device: torch.device) -> Card:
        return self._shards().card(step, device)

    def fingerprint(self, device: torch.device) -> bytes:
        """Of this rank's shards: equal across replicas, different across shard indices."""
        return self._shards().fingerprint(device)

    def discard_step(self) -> None:
        if self.model is not None:
            self.model.zero_grad(set_to_none=True)

    def sync(self, step: int, channel: Channel, device: torch.device,
             progress: Callable[[str], None] | None = None) -> SyncResult:
        started = time.perf_counter()
        claims = [int(v) for v in channel.exchange("mesh/slot", str(self.slot))]
        rank_of_slot = place(claims, self.layout)
        # Tensors only: the old model and optimizer hold the old generation's groups, dropped here.
        kept = self._shards()._tree() if self.model is not None else None
        self.model = self.optimizer = self.mesh = None
        self.slot = rank_of_slot.index(channel.rank)
        with self.subgroups():
            self.mesh = self.layout.mesh(rank_of_slot, device.type)
        meshed = time.perf_counter()
        self.model, self.optimizer = self.build(self.mesh)
        self.on_built(self.model, self.optimizer)
        built = time.perf_counter()
        if kept is not None:
            restore(self.model, self.optimizer, kept)
        restored = time.perf_counter()
        replicate = self.mesh.get_group(MESH_DIMS[0])
        replica, shard = divmod(self.slot, self.layout.shards)
        result = self._shards(replicate).sync(step, ReplicaChannel(channel, shard, dist.get_rank(replicate),
                                                                   self.layout.replicas), device, progress)
        steps = [int(v) for v in channel.exchange("mesh/step", str(result.step))]
        if len(set(steps)) > 1:
            raise StateMismatch(f"after the reform the shards are at different steps ({sorted(set(steps))}): a step "
                                "completed on some replica groups only, and no rank holds the others' shards of it")
        result.phases = {"mesh_s": meshed - started, "build_s": built - meshed, "restore_s": restored - built,
                         **result.phases}
        log.info("mesh_placed", slot=self.slot, replica=replica, shard=shard, kept=kept is not None,
                 fresh=claims.count(-1), role=result.role)
        return result


class LocalShards(ReplicatedState):
    """A rank's state as plain tensors (each DTensor's local shard, a view of its storage), kept
    identical across the replicate group: what ReplicatedState moves, received in place."""

    def _tree(self) -> dict[str, Any]:
        return local(super()._tree())

    def _load(self, reference: Any, targets: list[torch.Tensor]) -> None:
        tree = unflatten(reference, targets)
        if self.optimizer is not None and tree["optimizer"] is not None:
            self.optimizer.load_state_dict(on_params(self.optimizer, tree["optimizer"]))
        for name, obj in self.extras.items():
            obj.load_state_dict(tree["extras"][name])


class ReplicaChannel:
    """The generation's store as the ranks holding one shard index see it: ranks are their replicate
    group's, keys their own."""

    def __init__(self, channel: Channel, shard: int, rank: int, world_size: int):
        self.channel, self.prefix, self.rank, self.world_size = channel, f"shard{shard}/", rank, world_size

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
