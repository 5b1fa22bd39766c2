"""The environment of a rank the agent starts: what torchrun gives its workers, taken from the
current map only (never inherited from the agent's own environment), and the agent's own files and
socket. Pure: the supervisor starts the process."""

from __future__ import annotations

import os

from muster.v1 import muster_pb2 as pb
from muster.worker.agent.agent_config import AgentConfig
from muster.worker.agent.slot import Slot
from muster.worker.rank.runner import COMPLETED_FILE_ENV, IMPORTS_FILE_ENV
from muster.worker.rank.step_probe import STEP_FILE_ENV
from muster.worker.rank_link import HANDOVER_FILE_ENV, SLOT_SECRET_ENV

# What torchrun sets for its workers: taken from the current map, never from the agent's own
# environment (an agent started inside another job's environment must not leak its RANK).
RANK_ENV = frozenset({
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE",
    "MUSTER_GENERATION", "MUSTER_AGENT_SOCKET", "MUSTER_NODE_ID", COMPLETED_FILE_ENV, IMPORTS_FILE_ENV, SLOT_SECRET_ENV,
    STEP_FILE_ENV, HANDOVER_FILE_ENV,
    # Secrets of the agent's own: its ranks talk to it over its socket, never to the coordinators
    # or etcd (and trackers that record a process's environment would keep them).
    "MUSTER_TOKEN", "MUSTER_ETCD_PASSWORD",
})
# Set for every process the agent starts unless the environment or --env sets it. (Not
# THP_MEM_ALLOC_ENABLE=1, torch's huge pages for large CPU tensors: a killed rank's memory is freed
# ~4x sooner, so its death is heard sooner, but its allocations faulted 3-7x slower on the
# development VM: docs/reference/environment.md.)
RANK_DEFAULTS = {"OMP_NUM_THREADS": "1"}


def base_env(config: AgentConfig) -> dict[str, str]:
    """The environment every process the agent starts shares: its own without what torchrun
    sets per rank, plus --env."""
    env = {k: v for k, v in os.environ.items() if k not in RANK_ENV}
    env.update(config.env)
    for name, value in RANK_DEFAULTS.items():
        env.setdefault(name, value)
    return env


def rank_env(config: AgentConfig, a: pb.Assignment, slot: Slot, master: tuple[str, str] | None, *, library: bool,
             socket_path: str, files: str) -> dict[str, str]:
    """torchrun's environment for the slot's process, from the map `a` only: a rank without a place
    (one started before its node enters the map) gets no RANK or MASTER_* at all. `library`: the
    node's ranks use the worker library (they use no agent store); `socket_path`: the agent's, where
    library ranks stream; `files`: the agent's private directory."""
    c = config
    env = base_env(c)
    env.update({
        "LOCAL_RANK": str(slot.index), "MUSTER_AGENT_SOCKET": socket_path, SLOT_SECRET_ENV: slot.secret,
        "MUSTER_JOB": c.job, "MUSTER_NODE_ID": c.node_id, "MUSTER_HOST": c.host,
        "MUSTER_GENERATION": str(a.generation), "MUSTER_HOLD_TIMEOUT": str(c.hold_timeout_s),
        "TORCHELASTIC_RUN_ID": c.job_id or c.job,
        "TORCHELASTIC_RESTART_COUNT": str(slot.restarts), "TORCHELASTIC_MAX_RESTARTS": str(c.max_restarts),
        # a script's ranks use the store their agent serves (master_port); a library rank none
        "TORCHELASTIC_USE_AGENT_STORE": str(not library), "ROLE_NAME": "default",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        "LOCAL_WORLD_SIZE": str(a.local_world_size), "WORLD_SIZE": str(a.world_size),
        "GROUP_WORLD_SIZE": str(a.num_nodes), "ROLE_WORLD_SIZE": str(a.world_size),
        HANDOVER_FILE_ENV: os.path.join(files, f"handover-slot{slot.index}"),  # kept across its starts
    })
    if slot.error_file:
        env["TORCHELASTIC_ERROR_FILE"] = slot.error_file
    if slot.completed_file:
        env[COMPLETED_FILE_ENV] = slot.completed_file
    if slot.imports_file:
        env[IMPORTS_FILE_ENV] = slot.imports_file
    if slot.steps is not None:
        env[STEP_FILE_ENV] = slot.steps.path
    if a.role == pb.ROLE_ACTIVE and slot.index in a.local_ranks:
        rank = str(a.rank_offset + list(a.local_ranks).index(slot.index))
        env.update(RANK=rank, ROLE_RANK=rank, GROUP_RANK=str(a.node_rank))
        if master is not None:
            env.update(MASTER_ADDR=master[0], MASTER_PORT=master[1])
    return env
