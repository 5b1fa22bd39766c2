"""What `muster run` tells a node agent: the job and node, what runs on each slot, and the agent's
budgets and timeouts (read from flags at the edge, cli.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from muster.security import ClientSecurity
from muster.worker.rank.zygote import PRELOAD


@dataclass(frozen=True)
class AgentConfig:
    coordinators: tuple[str, ...]
    job: str
    node_id: str
    slots: int
    argv: tuple[str, ...]  # what runs on each slot
    host: str = "127.0.0.1"  # the address other nodes reach this node at
    nodes: tuple[int, int] | None = None  # (min, max) nodes when this agent creates the job
    world_size_multiple: int = 0
    stragglers: tuple[str, float, int] = ("", 0.0, 0)  # the job's (action, factor, min steps) if it creates it
    on_state_lost: str = ""  # the job's (JobSpec.on_state_lost) if it creates it: "" (fail) or restart
    max_restarts: int = 3  # per slot, whatever the cause (a crash, a new map); beyond it the slot is given up
    restart_backoff_s: float = 1.0  # before restarting a crashed rank; doubled on each crash of the slot
    log_dir: Path | None = None  # the ranks' output and the agent's log under LOG_DIR/<job>/<run>/ (src/muster/rank_logs.py)
    drain_timeout_s: float = 120.0
    exit_timeout_s: float = 30.0  # a rank whose script completed but whose process lives on this long is ended
    hold_timeout_s: float = 300.0  # no coordinator heard for this long: give up (the ranks with the agent)
    join_timeout_s: float = 300.0  # no coordinator accepted the Join within this long: exit 1
    form_timeout_s: float = 600.0  # no place in a generation within this long (a hot spare waits on): exit 1
    wait_report_s: float = 10.0  # while waiting for a place, say what for this often
    job_id: str = ""  # the job as the user named it (torchrun's --rdzv-id); `job` is the coordinator's name
    warm_start: bool = True  # fork Python ranks from a zygote that imported `preload` once (see zygote)
    preload: tuple[str, ...] = PRELOAD
    host_zygote: str = ""  # a host's zygote's socket (`muster zygote`) the node's zygote is forked from
    step_probe: bool = True  # Python ranks without the library report their steps and compute (see step_probe)
    env: dict[str, str] = field(default_factory=dict)
    security: ClientSecurity = field(default_factory=ClientSecurity)  # token, TLS
