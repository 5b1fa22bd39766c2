"""The backends behind one small interface (`Backend`): gloo, NCCL, and the NCCL-shaped twin that
drives NCCL's decisions over gloo on CPU; how each shows a broken group in the errors torch raises,
aborts a generation's group, and picks a rank's device."""

from __future__ import annotations

import time
from typing import Protocol, runtime_checkable

import structlog
import torch
import torch.distributed as dist

from muster.worker.sockets import shutdown_peer_sockets
from muster.worker.library.stuck import OnStuck, exit_stuck
from muster.worker.library.teardown import Teardown

log = structlog.get_logger(__name__)

# How a broken group shows itself, in the texts torch raises (pinned by tests/unit/test_comm_backends.py).
# Gloo: a plain RuntimeError from its transport when a peer closed or reset a connection, or when
# an abort shut this process's sockets down.
GLOO_TRANSPORT = ("gloo/transport", "Connection reset", "Connection closed", "Broken pipe", "Socket Timeout",
                  "timed out", "Timed out")
# NCCL: a DistBackendError for every NCCL failure, the script's own too. NCCL's result names tell
# them apart: a peer that died or an aborted communicator is the group's; a bad argument or a CUDA
# error is not (the process cannot go on in-process after the latter: it ends and is restarted).
NCCL_ABORTED = ("NCCL communicator was aborted", "NCCL communicator encountered error set by ProcessGroupNCCL")
NCCL_TRANSPORT = (*NCCL_ABORTED, "ncclRemoteError", "remote process exited or there was a network error",
                  "ncclSystemError", "unhandled system error", "Watchdog caught collective operation timeout",
                  "NCCL timeout in:",
                  # after _abort_process_group torch keeps no default group: a collective the abort beat
                  "Default process group has not been initialized")
NCCL_NOT_TRANSPORT = ("ncclInvalidArgument", "ncclInvalidUsage", "invalid argument", "invalid usage",
                      "ncclUnhandledCudaError", "unhandled cuda error")
# The watchdog's settings for a rank that aborts its groups itself (the _abort_process_group
# docstring: error handling off). Set where the environment leaves them unset, before the first
# group: with torch's defaults a peer's death takes every survivor down (TearDown/SkipCleanUp) or
# makes each dump the flight recorder and C++ stacks; with these a reform prints group_aborted.
NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
            "TORCH_NCCL_ENABLE_MONITORING": "0", "TORCH_NCCL_LOG_CPP_STACK_ON_UNCLEAN_SHUTDOWN": "0",
            "TORCH_FR_BUFFER_SIZE": "0"}  # the flight recorder (TORCH_NCCL_TRACE_BUFFER_SIZE before torch 2.10)
NCCL_TEARS_DOWN = {"1", "3"}  # TearDown, SkipCleanUp: the watchdog ends the process on a peer's death
# Since torch 2.8 a watchdog that sees a collective fail (a peer's death, before Muster's abort)
# sleeps 4x this (default 15 s: a minute) "for the flight recorder", dump or not, and releasing
# the aborted group joins that thread: the rank missed the next group's barrier and was evicted
# as stalled (H200, 2026-11-26). Forced, whatever the environment says.
NCCL_DUMP_WAIT = "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"
NCCL_PROXY_POLL_S = 0.5  # ncclCommAbort joins proxy threads that look at its flag this often (NCCL's src/proxy.cc)


def take_groups() -> list[dist.ProcessGroup]:
    """Every group out of torch's registry, which is left as _abort_process_group() leaves it
    (torch 2.13's code, less the abort itself): no default group, names and counter reset, so the
    next generation's group forms while these are aborted elsewhere. Newest first, torch's order."""
    c10d = dist.distributed_c10d
    world = c10d._world
    groups = sorted(world.pg_names, key=lambda g: world.pg_names[g], reverse=True)
    c10d._update_default_pg(None)
    for registry in (world.pg_map, world.pg_names, world.pg_group_ranks, world.pg_backend_config,
                     world.pg_to_tag, world.tags_to_pg, world.pg_coalesce_state):
        registry.clear()
    c10d._unregister_all_process_groups()
    world.group_count = 0
    return groups


def _says(exc: BaseException, texts: tuple[str, ...]) -> bool:
    return any(t in str(exc) for t in texts)


@runtime_checkable
class Backend(Protocol):
    """What differs between gloo and NCCL (and the NCCL-shaped twin on CPU), for `Comm`."""

    name: str  # Muster's name for it (MUSTER_BACKEND)
    torch_backend: str  # what init_process_group is given
    bounded_connect: bool  # Comm bounds the group's connect itself (NCCL's bootstrap has its own)

    def prepare(self, env: dict[str, str]) -> None:
        """Settle the environment the backend reads, before the first group."""

    def device(self, local_rank: int) -> torch.device:
        """Where this rank's tensors live."""

    def init_options(self, device: torch.device) -> dict:
        """init_process_group's backend-specific arguments."""

    def abort(self, sockets: dict[int, str], keep_ports: set[int], generation: int) -> int:
        """Make the current group's collectives fail at once (the next group may form at once);
        the connections shut down."""

    def release(self) -> None:
        """The training thread let go of the aborted groups."""

    def is_transport_failure(self, exc: BaseException) -> bool:
        """Did the group break (a peer died, an abort), rather than the script's own call?"""


class Gloo:
    """CPU tensors. Gloo's abort does not end a collective blocked on a hung peer (measured): an
    abort shuts down the sockets the group opened instead, which makes it fail at once."""

    name = torch_backend = "gloo"
    bounded_connect = True  # see GLOO_CONNECT_MIN_S

    def __init__(self, on_stuck: OnStuck = exit_stuck) -> None:
        """(Nothing of gloo's runs in the background to be stuck: its abort shuts sockets at once.)"""

    def prepare(self, env: dict[str, str]) -> None:
        pass

    def release(self) -> None:
        pass  # (its groups stay in torch's registry after an abort: destroy_process_group ends them)

    def device(self, local_rank: int) -> torch.device:
        return torch.device("cpu")

    def init_options(self, device: torch.device) -> dict:
        return {}

    def abort(self, sockets: dict[int, str], keep_ports: set[int], generation: int) -> int:
        return shutdown_peer_sockets(sockets, keep_ports)

    def is_transport_failure(self, exc: BaseException) -> bool:
        return isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and _says(exc, GLOO_TRANSPORT))


class Nccl:
    """One GPU per rank, taken round-robin from the visible ones (ranks may share a GPU, each
    process with its own NCCL_HOSTID). Eager init (`device_id`): the communicator is made while
    forming, so a reform pays for it before the first step rather than inside it. An abort takes
    every group out of torch's registry at once (`Comm.destroy` then has nothing left to destroy,
    and the next generation's group may form) and leaves NCCL's own abort (`ncclCommAbort`, half a
    second) to a background teardown (src/muster/worker/library/teardown.py): its first microseconds set the abort
    flag that releases the training thread, the rest is nobody's wait."""

    name = torch_backend = "nccl"
    bounded_connect = False  # NCCL's bootstrap has its own timeouts; its init pays for CUDA too

    def __init__(self, on_stuck: OnStuck = exit_stuck) -> None:
        """`on_stuck(cause, waited_s)`: the process's end where the background teardown is stuck."""
        self.teardown = Teardown(self._abort_groups, on_stuck)

    def prepare(self, env: dict[str, str]) -> None:
        """NCCL_ENV where unset. A watchdog set to tear the process down (torchrun's default, which
        `muster run` passes on to unmodified scripts) would end every survivor of a peer's death
        before Muster's abort, and one that sleeps after a failure holds the reform
        (NCCL_DUMP_WAIT): for a library rank both are turned off, and a change logged."""
        if env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING") in NCCL_TEARS_DOWN:
            log.info("nccl_error_handling_off", was=env["TORCH_NCCL_ASYNC_ERROR_HANDLING"],
                     why="Muster aborts and reforms the group; the watchdog would end the process")
            env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"
        if env.get(NCCL_DUMP_WAIT, "0") != "0":
            log.info("nccl_dump_wait_off", was=env[NCCL_DUMP_WAIT],
                     why="the watchdog sleeps 4x this after a failed collective; releasing the group waits for it")
        env[NCCL_DUMP_WAIT] = "0"
        for name, value in NCCL_ENV.items():
            env.setdefault(name, value)

    def device(self, local_rank: int) -> torch.device:
        return torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))

    def init_options(self, device: torch.device) -> dict:
        return {"device_id": device}

    def abort(self, sockets: dict[int, str], keep_ports: set[int], generation: int) -> int:
        groups = take_groups()
        if groups:
            self.teardown.submit(generation, groups)
        return 0

    def release(self) -> None:
        """The training thread has let go of the aborted groups: the teardown may shut them down."""
        self.teardown.release()

    def _abort_groups(self, groups: list[dist.ProcessGroup]) -> None:
        """On the teardown thread. As torch's _abort_process_group(): newest first, within one NCCL
        group call, so that the aborts of several communicators do not wait on each other
        (pytorch#119797)."""
        try:
            nccl = groups[0]._get_backend(torch.device("cuda"))
        except RuntimeError:
            nccl = None
        if not isinstance(nccl, getattr(dist, "ProcessGroupNCCL", ())):  # (the twin's are gloo's)
            nccl = None
        if nccl is not None:
            nccl._group_start()
        try:
            for group in groups:
                group.abort()
        finally:
            if nccl is not None:
                nccl._group_end()

    def is_transport_failure(self, exc: BaseException) -> bool:
        if _says(exc, NCCL_NOT_TRANSPORT) and not _says(exc, NCCL_ABORTED):  # (an abort quotes its cause)
            return False
        return isinstance(exc, dist.DistError) or (isinstance(exc, (RuntimeError, ValueError))
                                                   and _says(exc, NCCL_TRANSPORT))


class NcclTwin(Nccl):
    """NCCL's decisions over gloo, so that CI drives on CPU the paths an NCCL rank takes: the
    abort that clears torch's registry (so no destroy follows, and a collective the abort beat
    finds no group) and leaves the groups to the background teardown, whose abort takes as long
    as NCCL's (`abort_join_s`), NCCL's error classification and the watchdog settings. What it
    cannot be is NCCL itself: no CUDA, no eager init, and sockets shut as gloo's abort needs."""

    name = "nccl-twin"
    torch_backend = "gloo"
    bounded_connect = True
    abort_join_s = NCCL_PROXY_POLL_S  # ncclCommAbort's join of its proxy threads

    def device(self, local_rank: int) -> torch.device:
        return torch.device("cpu")

    def init_options(self, device: torch.device) -> dict:
        return {}

    def abort(self, sockets: dict[int, str], keep_ports: set[int], generation: int) -> int:
        super().abort(sockets, keep_ports, generation)
        return shutdown_peer_sockets(sockets, keep_ports)

    def _abort_groups(self, groups: list[dist.ProcessGroup]) -> None:
        """NCCL's shape: the flag at once (the sockets, shut by abort()), the join later."""
        super()._abort_groups(groups)
        time.sleep(self.abort_join_s)

    def is_transport_failure(self, exc: BaseException) -> bool:
        return super().is_transport_failure(exc) or (isinstance(exc, RuntimeError) and _says(exc, GLOO_TRANSPORT))


BACKENDS: dict[str, type[Backend]] = {b.name: b for b in (Gloo, Nccl, NcclTwin)}


def backend_named(name: str, on_stuck: OnStuck = exit_stuck) -> Backend:
    """The backend called `name`; `on_stuck(cause, waited_s)`: the process's end where its
    background work is stuck (the Worker's: its state's hand-over, then the exit)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}: one of {', '.join(BACKENDS)}")
    return BACKENDS[name](on_stuck)
