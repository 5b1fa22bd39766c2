"""What a rank of the library is told: its job and node, how to reach the coordinators (or its
agent, under `muster run`), the job's size and policy if it creates the job, and its timeouts; from
the environment (`WorkerConfig.from_env`, the variables in docs/reference/environment.md)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from muster.security import ClientSecurity
from muster.worker.errors import WorkerError
from muster.worker.rank_link import HANDOVER_FILE_ENV, SLOT_SECRET_ENV


@dataclass(frozen=True)
class WorkerConfig:
    coordinators: tuple[str, ...]
    job: str
    node_id: str
    backend: str = "gloo"
    host: str = "127.0.0.1"  # the address other ranks reach this process's store at
    local_rank: int = 0  # the slot: the device index (NCCL), and this rank's place under an agent
    agent_socket: str = ""  # set by `muster run`: talk to the node agent instead of the coordinator
    agent_secret: str = field(default="", repr=False)  # set by `muster run`: this process's pass to its slot
    handover_file: str = ""  # set by `muster run`: a stuck exit leaves peer snapshots there for the next process
    min_nodes: int = 0  # job size, used when this rank creates the job (0: the coordinator's default)
    max_nodes: int = 0
    world_size_multiple: int = 0
    stragglers: tuple[str, float, int] = ("", 0.0, 0)  # the job's straggler policy, if this rank creates it
    digest_every: int = 0  # steps between parameter digests sent to the coordinator (0: never)
    abort_wait_s: float = 5.0  # after an error of the script's own, how long to wait for an abort anyway
    form_timeout_s: float = 300.0
    # After a failure outside this rank (a collective failed, a reform failed): how long to hold for
    # a new generation before giving up. Generous: a coordinator or etcd outage must not kill ranks.
    hold_timeout_s: float = 300.0
    max_redos: int = 5  # the same step failing in this many fresh groups in a row is the script's error
    security: ClientSecurity = field(default_factory=ClientSecurity)  # token and TLS for the coordinators
    # gloo's network interface (GLOO_SOCKET_IFNAME); empty: the interface holding `host`, where it is
    # local (gloo's own choice, the hostname's address, may be one the peers cannot reach)
    gloo_interface: str = ""
    # The durable tier where the script registers none (`muster run --checkpoint-dir/--checkpoint-every`):
    # register() then checkpoints to this directory (src/muster/worker/library/checkpoints.py)
    checkpoint_dir: str = ""
    checkpoint_every: str = "auto"

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> WorkerConfig:
        """MUSTER_COORDINATOR (HOST:PORT[,...]) and MUSTER_JOB are required; the variables are in docs/reference/environment.md."""
        env = dict(os.environ if env is None else env)
        required = ("MUSTER_JOB",) if env.get("MUSTER_AGENT_SOCKET") else ("MUSTER_COORDINATOR", "MUSTER_JOB")
        missing = [k for k in required if not env.get(k)]
        if missing:
            raise WorkerError(f"set {' and '.join(missing)} (or run under `muster run`)")
        cuda = torch.cuda.is_available()
        return cls(
            coordinators=tuple(a.strip() for a in env.get("MUSTER_COORDINATOR", "").split(",") if a.strip()),
            job=env["MUSTER_JOB"],
            node_id=env.get("MUSTER_NODE_ID") or f"{os.uname().nodename}-{os.getpid()}",
            backend=env.get("MUSTER_BACKEND") or ("nccl" if cuda else "gloo"),
            host=env.get("MUSTER_HOST", "127.0.0.1"),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            min_nodes=int(env.get("MUSTER_MIN_NODES", "0")),
            max_nodes=int(env.get("MUSTER_MAX_NODES", "0")),
            world_size_multiple=int(env.get("MUSTER_WORLD_SIZE_MULTIPLE", "0")),
            stragglers=(env.get("MUSTER_STRAGGLER_ACTION", ""), float(env.get("MUSTER_STRAGGLER_FACTOR", "0")),
                        int(env.get("MUSTER_STRAGGLER_MIN_STEPS", "0"))),
            digest_every=int(env.get("MUSTER_DIGEST_EVERY", "0")),
            agent_socket=env.get("MUSTER_AGENT_SOCKET", ""),
            agent_secret=env.get(SLOT_SECRET_ENV, ""),
            handover_file=env.get(HANDOVER_FILE_ENV, ""),
            hold_timeout_s=float(env.get("MUSTER_HOLD_TIMEOUT", "300")),
            security=ClientSecurity.from_env(env),
            gloo_interface=env.get("GLOO_SOCKET_IFNAME", ""),
            checkpoint_dir=env.get("MUSTER_CHECKPOINT_DIR", ""),
            checkpoint_every=env.get("MUSTER_CHECKPOINT_EVERY", "") or "auto",
        )
