"""What `Worker.register` makes of what a training script gives it: the state transfer (one state
kept identical on every rank, replica groups of shards, or shards with peer snapshots), and the
job sizes a rank that creates the job asks for, so that no generation forms that the layout cannot
train in."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any

import torch

from muster.worker.agent.launch import LaunchError, checkpoint_every
from muster.worker.library.config import WorkerConfig
from muster.worker.library.checkpoints import Checkpoints, Durable
from muster.worker.errors import WorkerError
from muster.worker.library.sharded import Build, Replicas, ShardedState
from muster.worker.library.snapshots import Snapshots, SnapshotState
from muster.worker.library.state import ReplicatedState, StateTransfer


Guard = Callable[[torch.nn.Module, Any], None]  # installs the step guards on a model and its optimizer


def registered(config: WorkerConfig, *, model: torch.nn.Module | None, optimizer: Any, build: Build | None,
               layout: Replicas | Snapshots | None, extras: dict[str, Any], guard: Guard,
               subgroups: Callable[[], AbstractContextManager],
               checkpoint: Checkpoints | None = None) -> tuple[StateTransfer, WorkerConfig]:
    """The state transfer for these arguments of `register`, and the config the rank joins with.
    Raises TypeError for arguments that do not go together."""
    if checkpoint is not None and not isinstance(checkpoint, Checkpoints):
        raise TypeError(f"checkpoint= takes Checkpoints(dir, every=...), not {type(checkpoint).__name__}")
    if checkpoint is None and config.checkpoint_dir:  # the agent's (muster run --checkpoint-dir)
        try:
            checkpoint = Checkpoints(config.checkpoint_dir, every=checkpoint_every(config.checkpoint_every))
        except LaunchError as exc:
            raise WorkerError(f"MUSTER_CHECKPOINT_EVERY: {exc}") from None
    for name, obj in extras.items():
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise TypeError(f"extra {name!r} needs state_dict() and load_state_dict()")
    if layout is None and build is None:
        guard(model, optimizer)
        state = ReplicatedState.of(model, optimizer, dict(extras))
        state.durable = Durable(checkpoint, 1) if checkpoint is not None else None
        return state, config
    if layout is None or build is None or model is not None or optimizer is not None:
        raise TypeError("sharded state is registered as build= and layout= together, without model= or "
                        "optimizer= (the library builds them on each generation's mesh)")
    if config.digest_every:
        raise TypeError("digest_every compares every rank's digest, and a sharded job's ranks hold different shards")
    if isinstance(layout, Snapshots):
        # The shard count stays fixed: a job this rank creates has exactly that many ranks (more wait as spares).
        n = layout.shards
        sizes = {"min_nodes": n, "max_nodes": n, "world_size_multiple": n}
        state = SnapshotState(build, layout, dict(extras), node=config.node_id, subgroups=subgroups, on_built=guard,
                              handover=config.handover_file)
    else:  # replica groups: a generation of one group or more (the others wait benched)
        sizes = {"min_nodes": layout.shards, "max_nodes": layout.world_size}
        state = ShardedState(build, layout, dict(extras), subgroups=subgroups, on_built=guard)
    state.durable = Durable(checkpoint, layout.shards) if checkpoint is not None else None
    if not config.agent_socket:  # this rank may create the job (under `muster run` the agent's sizes hold)
        config = replace(config, **{k: getattr(config, k) or v for k, v in sizes.items()})
    return state, config
