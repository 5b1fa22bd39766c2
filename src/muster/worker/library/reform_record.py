"""What a reform did, as the rank tells it: logged (`group_formed`, and `recovered` where the state
came back from somewhere) and reported to its leader in every frame (`pb.ReformPhases`: the phases
the leader draws a recovery's timeline from, the tier the state came from, the steps lost, and the
generation the state began from nothing in)."""

from __future__ import annotations

import structlog

from muster.v1 import muster_pb2 as pb
from muster.worker.library.comm import GroupSpec
from muster.worker.library.reform import Formed
from muster.worker.library.state import SyncResult

log = structlog.get_logger(__name__)


def recorded(formed: Formed, lost: int, before: pb.ReformPhases, backend: str) -> pb.ReformPhases:
    """Log a reform that formed (`lost`: the steps this rank went back) and its recovery, if it was
    one; the phases it reports from now on (`before`: those of its last reform)."""
    spec, sync = formed.spec, formed.sync
    group_formed(spec, sync, formed.phases, steps_behind=lost, backend=backend)
    tier = restored_from(sync, lost)
    if sync.tier != "live" or lost or sync.role == "receiver" and sync.step > 0:
        # A recovery: which tier restored which step, the steps this rank lost, the time it took
        log.info("recovered", generation=spec.generation, tier=tier, step=sync.step, steps_lost=lost,
                 seconds=round(formed.phases["seconds"], 3))
    return reform_phases(spec.generation, formed.phases, sync.received, tier, sync.step, lost,
                         begun_at(spec.generation, tier, sync, before.begun_at))


def group_formed(spec: GroupSpec, sync: SyncResult, phases: dict[str, float], **logged) -> None:
    """A reform's record, logged as group_formed: what it took, phase by phase, and what the state's
    sync moved."""
    moved = {"state": sync.role if sync.plan.moves else "agreed", "sources": list(sync.plan.sources)[:8],
             "bytes_sent": sync.sent, "bytes_received": sync.received}
    log.info("group_formed", generation=spec.generation, rank=spec.rank, world_size=spec.world_size,
             step=sync.step, store=spec.store_address, **logged, **moved,
             **{k: round(v, 4) for k, v in phases.items()})


def reform_phases(generation: int, phases: dict[str, float], received: int, tier: str = "", step: int = 0,
                  lost: int = 0, begun: int = 0) -> pb.ReformPhases:
    """A reform's phases as the rank reports them (its leader draws the recovery's timeline from them),
    with the tier its state came from, the step restored, the steps this rank lost, and the
    generation its state began from nothing in (`begun_at`)."""
    return pb.ReformPhases(generation=generation, abort_s=phases["abort_s"] + phases["destroy_s"],
                           form_s=phases["form_s"], sync_s=phases["sync_s"], transfer_s=phases["transfer_s"],
                           bytes_received=received, tier=tier, step=step, steps_lost=lost, begun_at=begun)


def begun_at(generation: int, tier: str, sync: SyncResult, before: int) -> int:
    """The generation in which the state this rank trains on began from nothing, said in every reform
    while the state is its own: a word of one reform could be lost (the rank re-formed again before
    its agent's next frame), and only the leader knows whether the job had trained by then. Begun
    here: nothing restored and it trains (a benched replica group restored nothing because it trains
    nothing yet, whatever step its own state is at); taken from another rank or a tier: not its own
    word (0); else (its own state went on) what it said before."""
    if not tier and sync.bench is None:
        return generation
    return 0 if sync.role == "receiver" or tier not in ("", "replica") else before


def restored_from(sync: SyncResult, lost: int) -> str:
    """The tier a reform's state came from (ReformPhases.tier): the sync's, where it went below the
    ranks' own state; "replica" where the ranks' own state went on (kept, or moved from a rank holding
    it); "" at a first formation (step 0, nothing lost: nothing was restored)."""
    if sync.tier != "live":
        return sync.tier
    return "replica" if sync.step or lost else ""
