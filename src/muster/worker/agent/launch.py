"""What `muster run` starts on each slot: the user's command, or, for `torchrun …`, the script
torchrun would run, with torchrun's own options translated. The agent supervises every rank
itself instead of torchrun's local agent, which stops all local workers when one exits."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

from muster.net import is_loopback
from muster.worker.sockets import interface_of

# torchrun options the coordinator owns now: superseded, with a note.
OWNED = {"--nnodes", "--node-rank", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-conf",
         "--master-addr", "--master-port", "--max-restarts", "--standalone", "--rdzv-timeout",
         "--monitor-interval", "--start-method", "--role", "--log-dir", "--redirects", "--tee", "--local-addr",
         "--run-path", "--local-ranks-filter", "--logs-specs", "--event-log-handler", "--numa-binding",
         "--signals-to-handle", "--virtual-local-rank", "--node_rank", "--master_addr", "--master_port",
         "--max_restarts", "--rdzv_backend", "--rdzv_endpoint", "--rdzv_conf", "--monitor_interval",
         "--start_method", "--log_dir", "--local_addr", "--run_path"}
FLAGS = {"--standalone", "--run-path", "--run_path", "--no-python", "--no_python", "-m", "--module",
         "--virtual-local-rank"}


class LaunchError(ValueError):
    """The command cannot be run as asked; the message says why."""


@dataclass
class Launch:
    argv: list[str]  # what runs on each slot
    slots: int | None = None  # from --nproc-per-node
    nodes: tuple[int, int] | None = None  # from --nnodes
    max_restarts: int | None = None  # from --max-restarts: the agent's budget per slot unless muster run sets one
    job: str | None = None  # from --rdzv-id: the job's id unless muster run's --job names it
    notes: list[str] = field(default_factory=list)  # options the coordinator now owns


def is_torchrun(command: list[str]) -> bool:
    return bool(command) and (os.path.basename(command[0]) == "torchrun"
                              or command[1:3] == ["-m", "torch.distributed.run"])


def checkpoint_every(text: str) -> int | str:
    """Checkpoints' `every` as `muster run --checkpoint-every` and MUSTER_CHECKPOINT_EVERY give it:
    "auto", or a number of steps >= 1 (LaunchError otherwise). Here, not beside Checkpoints: the
    agent never imports torch."""
    if text.strip() == "auto":
        return "auto"
    if not text.strip().isdigit() or int(text) < 1:
        raise LaunchError(f"checkpoint every {text[:40]!r}: a number of steps >= 1, or auto")
    return int(text)


def parse_nodes(value: str) -> tuple[int, int]:
    lo, _, hi = value.partition(":")
    try:
        nodes = (int(lo), int(hi or lo))
    except ValueError:
        raise LaunchError(f"node count {value!r} is not MIN:MAX or N") from None
    if not 1 <= nodes[0] <= nodes[1]:
        raise LaunchError(f"node count {value!r} needs 1 <= MIN <= MAX")
    return nodes


def _nproc(value: str) -> int:
    if value in ("gpu", "auto"):
        import torch

        return torch.cuda.device_count() or (os.cpu_count() or 1 if value == "auto" else 0) or 1
    if value == "cpu":
        return os.cpu_count() or 1
    try:
        n = int(value)
    except ValueError:
        raise LaunchError(f"--nproc-per-node {value!r} is not a number, gpu, cpu or auto") from None
    if n < 1:
        raise LaunchError("--nproc-per-node must be at least 1")
    return n


def plan(command: list[str]) -> Launch:
    if not command:
        raise LaunchError("give the command to run after --, e.g. -- torchrun --nproc-per-node 4 train.py")
    if not is_torchrun(command):
        return Launch(list(command))
    args = command[1:] if os.path.basename(command[0]) == "torchrun" else command[3:]
    launch = Launch([])
    module = no_python = False
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("-"):
            break
        name, eq, inline = arg.partition("=")
        takes_value = name not in FLAGS
        value = inline if eq else (args[i + 1] if takes_value and i + 1 < len(args) else "")
        i += 1 if eq or not takes_value else 2
        if name in ("--nproc-per-node", "--nproc_per_node"):
            launch.slots = _nproc(value)
        elif name == "--nnodes":
            launch.nodes = parse_nodes(value)
        elif name in ("--max-restarts", "--max_restarts"):
            try:
                launch.max_restarts = int(value)
            except ValueError:
                raise LaunchError(f"torchrun --max-restarts {value!r} is not a number") from None
            if launch.max_restarts < 0:
                raise LaunchError("torchrun --max-restarts must be at least 0")
        elif name in ("--rdzv-id", "--rdzv_id"):
            launch.job = value
        elif name in ("-m", "--module"):
            module = True
        elif name in ("--no-python", "--no_python"):
            no_python = True
        elif name in OWNED:
            launch.notes.append(f"torchrun {name} is ignored: muster's coordinator sets it")
        else:
            raise LaunchError(f"torchrun option {name} is not understood by muster run")
    if i >= len(args):
        raise LaunchError("torchrun: no training script given")
    script, script_args = args[i], args[i + 1:]
    if no_python:
        launch.argv = [script, *script_args]
    elif module:
        launch.argv = [sys.executable, "-u", "-m", script, *script_args]
    else:
        launch.argv = [sys.executable, "-u", script, *script_args]
    return launch


def network_env(host: str, env: Mapping[str, str], multi_node: bool) -> dict[str, str]:
    """What a plain script's gloo or NCCL needs to reach the other hosts: the interface holding the
    node's advertised address. Gloo binds to the address the hostname resolves to (127.0.0.1 on many
    machines), so across hosts its peers dial loopback; NCCL skips loopback and docker interfaces but
    may take one the other hosts cannot reach. A variable the user set is kept. An address on no
    interface of this host (NAT) cannot be named: a job that may span hosts is refused, saying what
    to set."""
    try:
        address = socket.gethostbyname(host)
    except OSError:
        address = ""
    name = interface_of(address) if address else None
    wanted = {"GLOO_SOCKET_IFNAME"} | ({"NCCL_SOCKET_IFNAME"} if not is_loopback(address or host) else set())
    unset = sorted(wanted - set(env))
    if name is None:
        if unset and multi_node:
            raise LaunchError(f"this node's address {host} is on no interface of this host, so its ranks' gloo/NCCL "
                              f"cannot be told which to use: set {' and '.join(unset)} in muster run's "
                              "environment to the interface the other hosts reach, or pass --host with an address of this host")
        return {}
    return {k: name for k in unset}
