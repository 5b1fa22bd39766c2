"""A reform as a plan the training thread runs when its group must change: leave the old group
(aborting it first where it broke, so that peers blocked on this rank fail at once), wait for an
assignment that gives this rank a place, form that generation's group, and sync the state to the
step its ranks agree on. It speaks to the process group (src/muster/worker/library/comm.py) in two verbs,
`leave` and `form` (which hands back the channel the state syncs over), reads the link's mailbox
(src/muster/worker/link.py) and tells it the generation formed, and says what the rank does meanwhile
(forming, holding) in the rank's Progress. It never calls back into the worker: a wait the link's
failure or a drain ends returns None, for the worker to raise why, and the worker adopts the group
formed. A rank whose group broke with no new generation in sight holds, process and state kept,
for at most the hold timeout; so does one whose reform failed, unless it failed with the same
error of its own on consecutive tries (ReformFailed: holding would only loop).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Literal

import structlog
import torch

from muster.v1 import muster_pb2 as pb
from muster.worker.library.comm import Comm, GroupSpec, Superseded
from muster.worker.errors import CoordinatorLost, HoldExpired, ReformFailed, RunEnded
from muster.worker.library.state import StateTransfer, SyncResult
from muster.worker.library.unwinding import Unwinding
from muster.worker.link import Link, immediate

if TYPE_CHECKING:
    from muster.worker.library.state import Bench

log = structlog.get_logger(__name__)

WAIT_REPORT_S = 10.0  # a rank waiting for a place in a newer generation says so this often
REFORM_REPEATS = 3  # the same error of a rank's own on this many reforms in a row ends it (ReformFailed)


class Progress:
    """What the rank says it does, for the link thread's reports: (step, µs per step, state, phase,
    generation), swapped whole so that a report never mixes two. The worker says the steps; the
    reform says the rest while it runs (forming, holding, the sync's phases)."""

    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now: tuple[int, int, str, str, int] = (0, 0, "starting", "", 0)

    def say(self, state: str, phase: str, generation: int) -> None:
        """At the step said last."""
        self.now = (*self.now[:2], state, phase, generation)


@dataclass(frozen=True)
class Formed:
    """A reform's outcome, for the worker to adopt: its group, the state's sync in it, and where
    the time went (seconds, phase by phase)."""
    spec: GroupSpec
    sync: SyncResult
    phases: dict[str, float]


class Reform:
    def __init__(self, comm: Comm, link: Link, unwinding: Unwinding, progress: Progress, *, slot: int,
                 local_rank: int, device: torch.device, hold_timeout_s: float, failed: Callable[[], bool],
                 let_go: Callable[[], None]):
        """`failed()`: the worker has an error that ends its training (a group being formed
        is abandoned, a wait ends). `let_go()`: the worker drops what it holds of a group it leaves
        (its DDP wrappers)."""
        self.comm, self.link, self.unwinding, self.progress = comm, link, unwinding, progress
        self.slot, self.local_rank, self.device, self.hold_timeout_s = slot, local_rank, device, hold_timeout_s
        self.failed, self.let_go = failed, let_go
        self.forming = False  # the training thread is inside Comm.form (read on the link thread)

    def run(self, state: StateTransfer, after: int, step: int, *, discard: bool = False, hold: str = "",
            abort: bool = False) -> Formed | None:
        """Leave generation `after`'s group (at `step`) and form the next one this rank has a place in.
        `discard`: the step in flight was lost. `hold`: why the group broke with no new generation
        in sight; the wait for one is then bounded by the hold timeout, and a failure while forming
        holds the same way. `abort`: the old group is aborted before it is destroyed (as where it broke).
        None: the wait ended for the link's failure or a drain (see wait_for_place)."""
        started = time.perf_counter()
        self.unwinding.began(after)
        if discard:
            state.discard_step()
        self.let_go()
        if hold:
            latest = self.link.latest
            if latest is None or latest.generation <= after:
                log.info("rank_holding", generation=after, step=step, cause=hold, hold_timeout_s=self.hold_timeout_s)
        self.comm.leave(after + 1 if hold or abort else 0)  # peers blocked on this rank fail now, not at the timeout
        state.card_ahead(step, self.device)  # (its fingerprint while it waits for its group)
        deadline = time.monotonic() + self.hold_timeout_s
        repeats = RepeatedFailure(self.comm.backend.is_transport_failure)
        while True:
            # Waiting for the others is not a stall; holding says that this generation broke.
            self.progress.say("holding" if hold else "forming", "", after)
            a = self.wait_for_place(after, hold, deadline, step)
            if a is None:
                return None
            abandoned = partial(self.abandoned, a.generation, immediate(a))
            spec = group_spec(a, self.slot, self.local_rank)
            self.progress.say("forming", "", spec.generation)
            self.forming = True
            before_form_s = time.perf_counter() - started  # the old group's teardown, the wait for a place
            form_began = time.perf_counter()
            try:
                channel = self.comm.form(spec, abandoned=abandoned)
                synced = time.perf_counter()
                sync = state.sync(step, channel, self.device,
                                  progress=lambda phase, g=spec.generation: self.progress.say("forming", phase, g))
                sync_s = time.perf_counter() - synced
                break
            except Superseded:
                pass
            # A fault during the reform itself: hold for the next. (ValueError: an abort that came
            # as this group formed left NCCL's torch without a group for the state exchange.)
            except (RuntimeError, ValueError) as exc:
                log.warning("reform_failed", generation=spec.generation, error=str(exc)[:200],
                            hold_left_s=round(max(0.0, deadline - time.monotonic()), 1))  # then HoldExpired
                after, hold = spec.generation, hold or f"forming generation {spec.generation} failed: {str(exc)[:200]}"
                repeats.failed(exc, spec.generation)
            finally:
                self.forming = False
            self.unwinding.began(spec.generation)  # (an abort may be watching for it to leave this one)
            self.comm.leave()
        self.link.running(spec.generation)  # the link's frames carry it from now on
        phases = {**self.comm.phases, **sync.phases, "transfer_s": sync.transfer_s, "sync_s": sync_s,
                  "before_form_s": before_form_s, "form_s": synced - form_began, "seconds": time.perf_counter() - started}
        return Formed(spec, sync, phases)

    def abandoned(self, generation: int, at_once: bool) -> bool:
        """Abandon the group of `generation` being formed: the link failed, or a newer one supersedes it."""
        return self.failed() or superseded(self.link.latest, generation, at_once)

    def wait_for_place(self, after: int, hold: str, deadline: float, step: int,
                       bench: Bench | None = None) -> pb.Assignment | None:
        """Block until an assignment newer than generation `after` gives this rank a place (spares
        and waiting jobs wait). Holding (`hold` says why), no longer than `deadline`; otherwise
        bounded by the link: a coordinator not heard from for the hold timeout ends the wait.
        It says what it waits for every WAIT_REPORT_S. None: the worker failed, or its node
        drains past `step`. A benched rank (`bench`) ends with the others (raising RunEnded)."""
        began = report_at = time.monotonic()
        while True:
            self.link.changed.clear()
            if self.failed() or drain_due(self.link.drain_after, step):
                return None
            target = to_form(self.link.latest, self.link.base, self.slot, after)
            if target is not None:
                return target
            if bench is not None and bench.others_finished():
                raise self.finish_benched(bench)
            if time.monotonic() >= report_at + WAIT_REPORT_S:
                cause = hold or (bench.why if bench is not None else "")
                report_at = report_waiting(self.link, self.hold_timeout_s, after, cause, began, deadline)
            give_up_waiting(self.link, self.hold_timeout_s, after, hold, deadline)
            self.link.changed.wait(0.1)


    def finish_benched(self, bench: Bench) -> RunEnded:
        """The ranks that train finished while this one sat out (`bench`): it finishes too (its stale
        shards are the others' earlier ones), leaving the job as finished so that the run succeeds."""
        reason = f"the others finished while this rank was benched: {bench.why}"
        log.info("benched_rank_finished", why=bench.why)
        try:
            self.link.leave(10, finished=True, reason=reason)
        except Exception as exc:  # (not left: the coordinator finds the node gone instead, and the run fails)
            log.warning("leave_failed", error=str(exc))
        return RunEnded(pb.JobEnd(outcome="succeeded", reason=reason, run=self.link.session.joined_run))


class RepeatedFailure:
    """A reform's failures in a row: the same error of this rank's own (not a peer's or the network's,
    which the next generation may not meet) on REFORM_REPEATS consecutive tries is no fault that
    holding outlives. Without this, a model sharded after register() failed every reform, each failure
    a new generation: 852 in 300 s, until the hold expired."""

    def __init__(self, transport: Callable[[BaseException], bool]):
        self.transport = transport
        self.error, self.count, self.generations = "", 0, []

    def failed(self, exc: BaseException, generation: int) -> None:
        """Count `exc`, raised forming `generation`; raise ReformFailed once it repeats."""
        if self.transport(exc):
            self.error, self.count, self.generations = "", 0, []
            return
        error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:200]
        if error != self.error:
            self.error, self.count, self.generations = error, 0, []
        self.count += 1
        self.generations.append(generation)
        if self.count >= REFORM_REPEATS:
            log.error("reform_failed_repeatedly", error=error, tries=self.count, generations=self.generations)
            raise ReformFailed(f"forming a new group failed {self.count} times in a row with the same error: "
                               f"{error}") from exc


def at_boundary(drain_after: int | None, latest: pb.Assignment | None, base: pb.Assignment | None,
                switch_after: int, generation: int, step: int, slot: int) -> Literal["reform", "again", "nothing"]:
    """What a rank in `generation` does with its mailbox at the boundary after `step`: "reform" now,
    look "again" at the next boundary (a drain or a planned switch ahead), or "nothing".
    `switch_after`: the earliest planned switch heard away from `generation` (Link.switch_after)."""
    if drain_due(drain_after, step):
        return "again"  # Drained is raised as the next step begins
    if latest is None or latest.generation <= generation:
        return "again" if drain_after is not None else "nothing"  # (the drain step is ahead)
    if immediate(latest) or 0 < switch_after <= step or (
            base is not None and base.generation > generation and placed(base, slot)):
        return "reform"  # (an abort came with a planned switch after it: form the abort's group)
    return "again"  # a planned switch ahead


def drain_due(drain_after: int | None, step: int) -> bool:
    """The node drains, and this rank has completed the drain's step: it trains no further."""
    return drain_after is not None and step >= drain_after


def placed(a: pb.Assignment | None, slot: int) -> bool:
    """`a` gives local rank `slot` a place in its group."""
    return a is not None and a.role == pb.ROLE_ACTIVE and slot in a.local_ranks


def give_up_waiting(link: Link, hold_timeout_s: float, after: int, hold: str, deadline: float) -> None:
    """Raise if a rank waiting for a place after generation `after` has waited long enough: holding
    (`hold` says why) past `deadline`, or otherwise with the coordinator silent for the hold timeout."""
    if hold and time.monotonic() > deadline:
        log.error("hold_expired", generation=after, held_s=hold_timeout_s, cause=hold)
        raise HoldExpired(f"held {hold_timeout_s:g}s for a new generation after {hold}; none came "
                          f"(the coordinator was last heard {link.silent_s():.0f}s ago): giving up")
    silent_s = 0.0 if hold else link.silent_s()
    if silent_s > hold_timeout_s:
        log.error("coordinator_lost", generation=after, silent_s=round(silent_s, 1), hold_timeout_s=hold_timeout_s)
        raise CoordinatorLost(f"no word from the coordinator for {silent_s:.0f}s while waiting for a place "
                              f"in generation > {after} (hold timeout {hold_timeout_s:g}s)")


def report_waiting(link: Link, hold_timeout_s: float, after: int, hold: str, began: float, deadline: float) -> float:
    """A rank waiting for a place in a generation after `after` says what it waits for and when it
    gives up (see give_up_waiting); returns now."""
    now = time.monotonic()
    latest = link.latest
    silent_s = link.silent_s()
    if hold:
        gives_up = {"gives_up_in_s": round(deadline - now, 1)}
    else:  # while heard, the coordinator bounds the wait: it fails a run left waiting past its waiting timeout
        gives_up = {"gives_up_in_s": round(max(0.0, hold_timeout_s - silent_s), 1),
                    "gives_up_if": "the coordinator stays silent (it ends a run waiting past its waiting timeout)"}
    log.info("rank_waiting", after_generation=after, waited_s=round(now - began, 1),
             latest_generation=latest.generation if latest is not None else None,
             cause=hold or "no place for this rank yet", coordinator_silent_s=round(silent_s, 1), **gives_up)
    return now


def group_spec(a: pb.Assignment, slot: int, local_rank: int) -> GroupSpec:
    """Local rank `slot`'s group in `a`, which places it."""
    return GroupSpec(a.generation, a.rank_offset + list(a.local_ranks).index(slot), a.world_size, local_rank,
                     a.store_address, a.store_prefix, a.store_key, a.left_out)


def superseded(latest: pb.Assignment | None, generation: int, at_once: bool) -> bool:
    """Abandon the group of `generation` being formed (`at_once`: for an abort, not a planned
    switch)? For a newer one formed at once, yes; a group formed at once is not abandoned for a
    planned switch away from it (its ranks must train to the switch in it); one formed for a
    planned switch is, for any newer one (the others skip to the newest at its step)."""
    return latest is not None and latest.generation > generation and (immediate(latest) or not at_once)


def to_form(latest: pb.Assignment | None, base: pb.Assignment | None, slot: int,
            after: int) -> pb.Assignment | None:
    """The generation to form, newer than `after`: the latest, unless that is a planned switch away
    from a group (`base`) this rank has a place in but has not formed yet (an abort just before it):
    then that group first; its ranks train in it up to the switch. A rank that is new in the
    planned one forms it at once and waits there for the others."""
    if not placed(latest, slot) or latest.generation <= after:
        return None
    if immediate(latest) or base is None or base.generation <= after or not placed(base, slot):
        return latest
    return base
