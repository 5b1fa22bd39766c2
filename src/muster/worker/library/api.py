"""The in-process library a training script uses to survive the loss of ranks without restarting.

    worker = Worker(WorkerConfig.from_env()).register(model=model, optimizer=opt, data=loader_state)
    worker.start()
    while worker.step < steps:
        with worker.step_scope() as step:  # a step lost to a membership change is discarded...
            loss = worker.ddp(model)(batch(worker.step)).sum()
            loss.backward(); opt.step(); opt.zero_grad()
        if step.completed:                 # ...and redone by the next iteration
            log_progress(worker.step, loss)
    worker.close()

The training thread only records progress (a tuple assignment) and checks one flag per step;
a background thread with its own asyncio loop talks to the coordinator. A new generation with
"abort" makes that thread abort the old group at once (so a collective blocked on a dead or
hung peer fails), and the training thread reforms at the step boundary; a planned one is
switched to after `switch_at_step`. Errors of the background thread surface at the next boundary.

A collective that fails with no abort in sight (no leader reachable, or the leader has not
noticed yet) does not reach the script either: the rank discards the step, leaves its group so
that its peers fail fast too, and holds — process and state kept, reporting `holding` — until a
new generation gives it a place, or gives up after `hold_timeout_s` with HoldExpired.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import structlog
import torch
import torch.distributed as dist

from muster.terminal import CONTROL
from muster.v1 import muster_pb2 as pb
from muster.worker.rank import group_end, step_probe
from muster.worker.rank.runner import record_error
from muster.worker.compute_clock import ComputeClock
from muster.worker.library.backends import backend_named
from muster.worker.library.config import WorkerConfig
from muster.worker.library.extras_rule import ExtrasRule
from muster.worker.library.link_thread import LinkThread
from muster.worker.library.comm import Comm, StepCut
from muster.worker.sockets import interface_of
from muster.worker.library.stuck import exit_stuck
from muster.worker.library.checkpoints import Checkpoints, Durable
from muster.worker.errors import Drained, RunEnded, ShardedStateRefused, StateLost, WorkerError
from muster.worker.link import Transport
from muster.worker.node_session import NodeIdentity, NodeSession, job_spec
from muster.worker.rank_link import RankLink
from muster.worker.library.registration import registered
from muster.worker.library.reform import Formed, Progress, Reform, at_boundary, drain_due
from muster.worker.library.reform_record import recorded
from muster.worker.library.sharded import Build, Replicas
from muster.worker.library.snapshots import Snapshots
from muster.worker.library.state import ReplicatedState, StateTransfer
from muster.worker.library.step_guards import StepGuards
from muster.worker.library.unwinding import Unwinding

log = structlog.get_logger(__name__)

_STATES = {"starting": pb.RANK_STATE_STARTING, "running": pb.RANK_STATE_RUNNING,
           "long_phase": pb.RANK_STATE_LONG_PHASE, "forming": pb.RANK_STATE_FORMING, "holding": pb.RANK_STATE_HOLDING}


class _StepScope:
    """`with worker.step_scope() as step:` around one training step; `step.completed` tells
    afterwards whether it counted (False: discarded by a membership change, to be redone).
    Reusable; allocation-free on success."""

    __slots__ = ("worker", "started", "completed", "compute")

    def __init__(self, worker: Worker):
        self.worker = worker
        self.started = 0.0
        self.completed = False
        self.compute = ComputeClock()  # compute vs waiting, for the leader's straggler watch

    def __enter__(self) -> _StepScope:
        self.worker.step_begins()
        self.started = time.perf_counter()
        self.completed = False
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            self.completed = True
            self.compute.step_done(self.started)
            self.worker.step_done(int((time.perf_counter() - self.started) * 1e6))
            return False
        if not issubclass(exc_type, Exception) or issubclass(exc_type, WorkerError):
            return False
        return self.worker.step_failed(exc)  # True: swallowed, the loop redoes the step


class Worker:
    def __init__(self, config: WorkerConfig):
        self.config = config
        self.state: StateTransfer = ReplicatedState()
        self.step = 0  # completed steps
        self.rank, self.world_size = -1, 0
        self.generation = 0  # of the group this rank is in
        self.comm: Comm | None = None
        self._closing = False
        # Under an agent this rank is one of its node's slots; alone, it is a one-slot node.
        self._slot = config.local_rank if config.agent_socket else 0
        self._reformed = pb.ReformPhases()  # the last reform's, in every report: the leader's recovery timeline
        self._plan: Reform | None = None  # how this rank reforms (once started)
        self._progress = Progress()  # what this rank says it does (the link thread reports it)
        self._unwinding = Unwinding(excused=lambda: self._closing or self._progress.now[2] == "long_phase",
                                    on_stuck=self._exit_stuck)
        self._redos = 0  # attempts of the current step discarded in a row
        # The state became sharded after register() took it as replicated? Looked at by the first step
        # after each reform (the reform's own sync looks too): a refusal by name, not failed reforms.
        self._unchecked = False
        self._digest: tuple[int, bytes] = (0, b"")
        self._ddp: dict[int, tuple[int, torch.nn.Module]] = {}
        self._durable: Durable | None = None  # the checkpoints (register(checkpoint=...))
        self._scope = _StepScope(self)
        self.backend = backend_named(config.backend, self._exit_stuck)  # (an unknown MUSTER_BACKEND fails here)
        self.device = self.backend.device(config.local_rank)  # where the state's tensors are exchanged
        self._extras = ExtrasRule(self.device)
        self._guards = StepGuards(lambda: self.generation, lambda: self.step, lambda: self.comm,
                                  lambda: self._closing, self.device)
        # The background thread, and the mailbox it alone writes (the assignments, a drain).
        self._thread = LinkThread(self._slot, self._guards, self._unwinding, self._exit_stuck,
                                  forming=lambda: self._plan is not None and self._plan.forming)
        self.link = self._thread.link

    # ---- setup -----------------------------------------------------------------------

    def register(self, *, model: torch.nn.Module | None = None, optimizer=None, build: Build | None = None,
                 layout: Replicas | Snapshots | None = None, checkpoint: Checkpoints | None = None,
                 **extras) -> Worker:
        """The state kept identical on every rank: the model's parameters and buffers, the
        optimizer, and any extras with state_dict()/load_state_dict() (e.g. a data position).

        Sharded state declares its `layout` instead of a model, and a `build(mesh) -> (model,
        optimizer)` the library calls on each generation's mesh: Replicas(R, S) for FSDP2 over an
        HSDP mesh (dimensions "replicate" and "shard"), Snapshots(N) for sharding without replicas
        (FSDP2 over a 1-D mesh of the whole job, or ZeRO-1: a ZeroRedundancyOptimizer on
        mesh.get_group()); see docs/guide/sharded.md.

        `checkpoint=Checkpoints(dir, every=N or "auto")`: the library also writes the state to `dir`
        (off the training thread but for a host copy) and resumes from it where no rank holds a
        step: every copy of a shard lost, every rank lost, the job started again. Without one, the
        config's checkpoint_dir (MUSTER_CHECKPOINT_DIR: `muster run --checkpoint-dir`) sets it."""
        self.state, self.config = registered(self.config, model=model, optimizer=optimizer, build=build,
                                             layout=layout, extras=extras, guard=self._guards.install,
                                             subgroups=lambda: self.comm.subgroups(), checkpoint=checkpoint)
        self._durable = self.state.durable
        return self

    @property
    def model(self) -> torch.nn.Module | None:
        """The registered model, or the one built on this generation's mesh (sharded state: take it
        afresh every step, a reform builds another)."""
        return self.state.model

    @property
    def optimizer(self):
        return self.state.optimizer

    @property
    def mesh(self):
        """This generation's DeviceMesh ("replicate", "shard") where a layout was registered, else
        None. It holds the replica groups training now: index data by `mesh_slot`, not its coordinate."""
        return self.state.mesh

    @property
    def mesh_slot(self) -> int:
        """This rank's place in the layout, kept for life: replica r, shard s at r * S + s (-1: none)."""
        return self.state.slot

    def start(self) -> Worker:
        """Join the job, wait for this rank's place in a generation, form the group, get the state."""
        c = self.config
        step_probe.detach()  # the runner's, for scripts without the library: this rank reports its own steps
        group_end.detach()  # the runner's too: the library destroys its groups at every reform
        self.comm = Comm(self.backend, host=c.host, timeout_s=c.form_timeout_s, host_store=not c.agent_socket,
                         gloo_interface=c.gloo_interface or interface_of(c.host), on_stuck=self._exit_stuck)
        self._plan = Reform(self.comm, self.link, self._unwinding, self._progress, slot=self._slot,
                            local_rank=c.local_rank, device=self.device, hold_timeout_s=c.hold_timeout_s,
                            failed=lambda: self._thread.error is not None, let_go=self._ddp.clear)
        self.link.open(lambda on_directive: connect(c, self._slot, self.comm.store_port, self._reports, on_directive))
        self._reform()
        return self

    def close(self, *, leave: bool = True) -> None:
        """Wait for the other ranks to finish their last step, leave the job and stop the
        background thread. (Without the barrier, the first rank to go would close its sockets
        while the others still receive the tail of the last collective.)"""
        self._closing = True
        if self._durable is not None and not self._durable.flush():
            log.warning("checkpoint_unfinished", why="still being written at close")
        if self.comm is not None and self.comm.formed and self._thread.error is None and self.link.drain_after is None:
            try:
                dist.barrier()
            except (RuntimeError, dist.DistError) as exc:
                log.warning("final_barrier_failed", error=str(exc)[:200])
        if leave and self._thread.error is None and self.link.session is not None:
            try:
                self.link.leave(10, finished=True, reason="training finished")
            except Exception as exc:  # leaving is a courtesy: the stream closing says the same
                log.warning("leave_failed", error=str(exc))
        self.link.close()
        self._ddp.clear()
        if self.comm is not None:
            self.comm.destroy()

    # ---- the training thread's API ---------------------------------------------------

    def step_scope(self) -> _StepScope:
        return self._scope

    @contextmanager
    def long_phase(self, name: str) -> Iterator[None]:
        """Declare a long phase (checkpoint save, evaluation): no stall is detected meanwhile. `name`
        is one line of text: the coordinator refuses a control character in a phase (it is shown
        in operators' terminals), and with it this node's frames."""
        if CONTROL.search(name):
            raise ValueError(f"long_phase name {name!r} holds a control character: give one line of text")
        self._progress.say("long_phase", name, self._progress.now[4])
        try:
            yield
        finally:
            self._progress.say("running", "", self._progress.now[4])

    def ddp(self, module: torch.nn.Module | None = None, **kwargs) -> torch.nn.Module:
        """A DistributedDataParallel wrapper over the current group (a 1-D mesh's, whose ranks are
        the slots, with Snapshots), rebuilt after every reform (the old wrapper is dropped, so nothing
        keeps the old group alive)."""
        from torch.nn.parallel import DistributedDataParallel

        module = module if module is not None else self.state.model
        if self.mesh is not None and self.mesh.ndim == 1:
            kwargs.setdefault("process_group", self.mesh.get_group())
        cached = self._ddp.get(id(module))
        if cached is None or cached[0] != self.generation:
            kwargs.setdefault("init_sync", False)  # the state sync already made replicas identical
            if self.device.type == "cuda":
                kwargs.setdefault("device_ids", [self.device.index])
            wrapper = DistributedDataParallel(module, **kwargs)
            wrapper.register_forward_pre_hook(self._guards.cut_short)  # before DDP's collectives (StepGuards)
            cached = self._ddp[id(module)] = (self.generation, wrapper)
            self._scope.compute.watch(module)
        return cached[1]

    # ---- step boundary (the step scope's) ----------------------------------------------

    def step_begins(self) -> None:
        """As a step begins: Drained past the drain's step (raised here: the script saw the last step complete);
        ShardedStateRefused at the first step after a reform if the state was sharded after register()."""
        if self.link.changed.is_set():
            self._check_drain()
        self._extras.check(self.state.extras, self.step)
        if self._unchecked:
            self._unchecked = False
            try:
                self.state.still_replicated("at its first step")
            except ShardedStateRefused as exc:
                raise at_step(exc, self.step + 1)

    def step_done(self, us: int, *, at_boundary: bool = True) -> None:
        """The step in flight completed in `us` µs: count and report it, then take a membership
        change due at this boundary. `at_boundary=False`: not yet, the caller's step still runs
        collectives after it counts (a trainer's logging or checkpoint): it calls boundary() once
        they are done, where every rank, a joiner too, is before the next step's first collective."""
        self.step += 1
        self._progress.now = (self.step, us, "running", "", self.generation)
        self._unwinding.stepped(us)
        self._redos = 0
        self.state.stepped(self.step)
        if self._durable is not None:
            self._durable.stepped(self.step, us, self.state.saved_shard(self.rank), self.state.saved_tree)
        if self.config.digest_every and self.step % self.config.digest_every == 0:
            self._digest = (self.step, self.state.fingerprint(self.device))
        if at_boundary and self.link.changed.is_set():
            self._boundary()
        if at_boundary:  # (else the caller's step still moves its extras, a scheduler, until boundary())
            self._extras.noted(self.state.extras)

    def boundary(self) -> None:
        """Take a membership change due at this step boundary (after step_done(..., at_boundary=False)).
        The caller's step ends here, its extras whole (a trainer's counters move after the optimizer
        step): what a reform here takes is current, so the extras rule of step scopes is not looked at."""
        if self.link.changed.is_set():
            self._boundary()
        self._extras.excused()

    def check_group(self) -> None:
        """StepCut where the group this rank trains in was aborted: a collective outside the model's
        forward and backward (a trainer's own broadcast between steps) must not start on it, where a
        peer that is gone could hold it until the process is ended as stuck."""
        self._guards.cut_short()

    def step_failed(self, exc: Exception) -> bool:
        """The step in flight raised `exc`. True: lost to a failure outside this rank (or an abort within
        abort_wait_s), it is discarded and this rank has reformed: redo it. False: the script's own error."""
        outside = isinstance(exc, StepCut) or self.backend.is_transport_failure(exc)
        if not outside and not self._thread.abort_coming(self.config.abort_wait_s):
            at_step(exc, self.step + 1)
            return False  # not ours: the script's own error
        self._redos += 1
        if self._redos > self.config.max_redos:
            log.error("step_failed_repeatedly", step=self.step + 1, attempts=self._redos, error=str(exc)[:200])
            at_step(exc, self.step + 1)
            return False  # the same step failed in every fresh group: the script's error after all
        log.info("step_discarded", step=self.step + 1, generation=self.generation, error=str(exc)[:200])
        self._reform(discard=True, hold=f"a collective of generation {self.generation} failed: {str(exc)[:200]}")
        return True

    def _boundary(self) -> None:
        self.link.changed.clear()
        self._thread.raise_error()
        link = self.link
        due = at_boundary(link.drain_after, link.latest, link.base, link.switch_after(self.generation), self.generation,
                          self.step, self._slot)
        if due == "reform":
            self._reform()
            self._extras.noted(self.state.extras)  # (as the reform left them: a peer's, where it received)
        elif due == "again":
            self.link.changed.set()

    def _check_drain(self) -> None:
        if drain_due(self.link.drain_after, self.step):
            raise Drained(f"the node leaves the job after step {self.link.drain_after}")

    def _reform(self, *, discard: bool = False, hold: str = "") -> None:
        """Leave the current group and join the next one this rank trains in (the plan: Reform).
        A rank benched in the generation formed (its replica group is out of the mesh:
        src/muster/worker/library/sharded.py) sits it out, state kept and reporting a long phase (not a
        stall), until a newer generation places it."""
        said = self._progress.now[2:4]  # said again once formed
        if self._durable is not None and (discard or hold):
            self._durable.failures += 1  # (the "auto" cadence's failure rate)
        try:
            formed = self._plan.run(self.state, self.generation, self.step, discard=discard, hold=hold)
        except WorkerError as exc:  # (a refusal or a repeated failure: the step it stopped is told with it)
            if isinstance(exc, StateLost):
                log.error("state_lost", step=self.step, error=str(exc)[:300])
                # said to the agent even if the script catches it: its leader ends the run failed with it
                record_error(at_step(exc, self.step + 1))
            raise at_step(exc, self.step + 1)
        while True:
            self._adopt(formed, said)
            bench = formed.sync.bench
            if bench is None:
                return
            self._progress.say("long_phase", f"benched: {bench.why}"[:200], self.generation)
            try:
                placed = self._plan.wait_for_place(self.generation, "", math.inf, self.step, bench)
            except RunEnded as ended:  # the others finished while this rank sat out: so does it
                self._thread.raise_error(ended)
            # (aborted first: the bench's barrier would hold the group's destroy)
            formed = None if placed is None else self._plan.run(self.state, self.generation, self.step, abort=True)

    def _adopt(self, formed: Formed | None, said: tuple[str, str]) -> None:
        """Train in the group a reform formed, from the step the state was synced to, saying `said`
        (what the rank said before it). None: the plan stopped for the link's error or a drain, raised here."""
        if formed is None:
            self._thread.raise_error()
            self._check_drain()  # (one of the two raises: the plan saw it)
        spec, sync = formed.spec, formed.sync
        lost = self.step - sync.step if sync.step < self.step else 0
        self.step, self.rank, self.world_size, self.generation = sync.step, spec.rank, spec.world_size, spec.generation
        self._progress.now = (sync.step, self._progress.now[1], *said, spec.generation)
        latest = self.link.latest
        if latest is not None and latest.generation > spec.generation:
            self.link.changed.set()  # a planned switch heard while forming (the waits cleared its signal)
        self._reformed = recorded(formed, lost, self._reformed, self.backend.name)
        self._unchecked = True

    # ---- for the link thread and the watches ------------------------------------------

    def _exit_stuck(self, cause: str, waited_s: float) -> None:
        """Any thread: the process is stuck where nothing reaches it (src/muster/worker/library/stuck.py):
        what only its state holds goes to the slot's next process, then it exits."""
        exit_stuck(cause, waited_s, self.state.hand_over)

    def _reports(self) -> list[pb.RankReport]:
        step, step_time_us, state, phase, generation = self._progress.now
        digest_step, digest = self._digest
        every, held = self.state.snapshots()
        return [pb.RankReport(local_rank=self._slot, pid=os.getpid(), step=step, step_time_us=step_time_us,
                              state=_STATES[state], phase=phase, digest_step=digest_step, digest=digest,
                              generation=generation, compute_us=self._scope.compute.compute_us(),
                              snapshot_every=every, snapshot_bytes=held, reform=self._reformed)]


def at_step(exc: BaseException, step: int) -> BaseException:
    """`exc`, marked as raised in `step`: should it end the process, the runner writes the step beside
    it for the agent's exit report (a fault that repeats is the same error at the same step)."""
    try:
        exc.muster_step = step
    except AttributeError:  # (an exception type with __slots__)
        pass
    return exc


def connect(c: WorkerConfig, slot: int, store_port: int, reports: Callable[[], list[pb.RankReport]],
            on_directive: Callable[[pb.Directive], None]) -> Transport:
    """The rank's link: to its agent under `muster run`, else to the coordinator as a one-slot node."""
    if c.agent_socket:
        return RankLink(c.agent_socket, slot, c.agent_secret, report=lambda: reports()[0], on_directive=on_directive)
    identity = NodeIdentity(c.job, c.node_id, 1, c.host, store_port,
                            job_spec(c.min_nodes, c.max_nodes, c.world_size_multiple, c.stragglers),
                            is_process=True, agent_pid=os.getpid())
    return NodeSession(c.coordinators, identity, reports=reports, on_directive=on_directive, security=c.security)
