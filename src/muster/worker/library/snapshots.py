"""Sharded training without replicas (FSDP2 over the whole job, ZeRO-1) that survives a lost rank
through peer in-memory snapshots.

A job declares `Snapshots(shards=N, every=K)` at register with a `build(mesh) -> (model, optimizer)`
the library calls on each generation's 1-D mesh of N ranks (dimension "shard"). Every rank keeps a
mesh slot for life, as with replica groups (sharded.py); the mesh's group numbers its ranks
by slot, so a shard (an FSDP2 parameter's, a ZeroRedundancyOptimizer's partition) stays with its
slot whatever ranks the coordinator gives.

Every K steps each rank copies its shard (parameters' local shards, optimizer state, extras, at that
step) into host memory and sends it to its buddy, the slot `stride` further on (the first distance
that puts every buddy on another node; snapshot_ring.py moves the bytes off the training
thread). After a reform the ranks tell each other what they hold:

1. no slot lost and every rank at the same step: the live state is kept, nothing moves;
2. otherwise every rank rolls back, in place, to the newest step every slot's shard is held at (a
   survivor's own copy, or the buddy's copy of a lost slot's): at most K steps are redone, and the
   loop sees `worker.step` go back (the extras with it, so replayed steps see the same batches);
   a fresh process in a lost slot receives its shard from the buddy;
3. a slot lost together with its buddy has no copy left: every rank raises ShardLost.

A process that exits stuck (its training thread held in a dead group's collective) leaves its
snapshots, its own and its buddy-held ones, for the slot's next process (under `muster run`), which
claims the slot and rolls back from them: a buddy lost in the same fault then loses nothing.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog
import torch
import torch.distributed as dist

from muster.worker.errors import LayoutMismatch, ShardLost
from muster.worker.library.sharded import ShardedState, restore
from muster.worker.library.snapshot_ring import TIMEOUT, Ring
from muster.worker.library.state import Channel, SyncResult
from muster.worker.library.transfer import Card, SyncPlan

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

log = structlog.get_logger(__name__)

EVERY = 10  # steps between snapshots by default: at most 10 redone; the training thread pays < 0.5% of a step
MESH_DIM = "shard"
NO_LIVE_STATE = -1  # a Holding's step where the process has snapshots but no live state (taken over)


@dataclass(frozen=True)
class Snapshots:
    """N ranks each holding one shard of the state, with a peer snapshot every `every` steps."""

    shards: int
    every: int = EVERY

    def __post_init__(self) -> None:
        if self.shards < 2:
            raise ValueError(f"Snapshots(shards={self.shards}): a snapshot is kept by another rank, so at least 2")
        if self.every < 1:
            raise ValueError(f"Snapshots(every={self.every}): a snapshot every 1 step or more")

    @property
    def world_size(self) -> int:
        return self.shards

    def mesh(self, rank_of_slot: Sequence[int], device_type: str) -> DeviceMesh:
        """The 1-D mesh with slot s at [s], on a group whose rank s is slot s: every rank calls it."""
        from torch.distributed.device_mesh import DeviceMesh

        group = dist.new_group(list(rank_of_slot), sort_ranks=False)
        return DeviceMesh.from_group(group, device_type, mesh_dim_names=(MESH_DIM,))


def keep_slots(claims: Sequence[int], n: int, taken_over: Sequence[bool] = ()) -> list[int]:
    """The rank in each slot from each rank's claim (-1: a fresh process): claims are kept, fresh
    ranks take the free slots in rank order. A claim from snapshots taken over (`taken_over[rank]`)
    yields to a live one: its slot may have been refilled since. The same on every rank."""
    if len(claims) != n:
        raise LayoutMismatch(f"the generation has {len(claims)} ranks; Snapshots(shards={n}) needs exactly {n} "
                             "(the shard count stays fixed: set the job's world_size_multiple and max size to it)")
    rank_of_slot = [-1] * n
    live_first = sorted(range(n), key=lambda rank: rank < len(taken_over) and taken_over[rank])
    for rank in live_first:
        slot = claims[rank]
        if 0 <= slot < n and rank_of_slot[slot] < 0:
            rank_of_slot[slot] = rank
    fresh = iter(rank for rank, slot in enumerate(claims) if rank not in rank_of_slot)
    return [rank if rank >= 0 else next(fresh) for rank in rank_of_slot]


def buddy_stride(nodes: Sequence[str]) -> int:
    """The distance from a slot to its buddy: the least that puts every slot's buddy on another node
    (slots of one node are contiguous: their count), else 1 (a single node)."""
    n = len(nodes)
    return next((d for d in range(1, n) if all(nodes[s] != nodes[(s + d) % n] for s in range(n))), 1)


@dataclass(frozen=True)
class Holding:
    """What a surviving process holds at a reform (a fresh one holds nothing: None)."""

    step: int  # its live state's (NO_LIVE_STATE: none)
    own: tuple[int, ...]  # steps of its own snapshots
    held: tuple[int, ...]  # steps of its predecessor's snapshots, complete
    stride: int

    def encode(self) -> str:
        return json.dumps([self.step, self.own, self.held, self.stride])

    @classmethod
    def decode(cls, text: str | None) -> Holding | None:
        if text is None:
            return None
        step, own, held, stride = json.loads(text)
        return cls(step, tuple(own), tuple(held), stride)


@dataclass(frozen=True)
class Recovery:
    step: int | None  # the snapshot every slot rolls back to; None: every rank keeps its live state
    stride: int
    fresh: tuple[int, ...] = ()  # slots filled by fresh processes
    # Slots that take their snapshot from the buddy: the fresh ones, and any survivor whose own copy
    # of the step is gone (its newer snapshot took the buffer while the others' were in flight).
    receivers: tuple[int, ...] = ()

    def buddy(self, slot: int, n: int) -> int:
        return (slot + self.stride) % n


def recover(holdings: Sequence[Holding | None], nodes: Sequence[str]) -> Recovery:
    """What every rank does after a reform, from each slot's Holding (by slot): the same on every
    rank. `nodes`: each slot's node, which places buddies at a first formation."""
    n = len(holdings)
    known = [h for h in holdings if h is not None]
    if not known:  # a first formation: every rank starts from `build`
        return Recovery(None, buddy_stride(nodes))
    stride = known[0].stride
    fresh = tuple(s for s, h in enumerate(holdings) if h is None)
    if not fresh and len({h.step for h in known}) == 1 and known[0].step != NO_LIVE_STATE:
        return Recovery(None, stride)
    for s in fresh:
        b = (s + stride) % n
        if holdings[b] is None:
            raise ShardLost(f"slot {s} and its buddy slot {b}, which held its snapshot, were both lost: no rank "
                            f"holds slot {s}'s shard, and training on without it would train a partial state. "
                            "Restart from your checkpoint")
    steps = None
    for s in range(n):
        own = holdings[s].own if holdings[s] is not None else ()
        buddy = holdings[(s + stride) % n]
        have = set(own) | set(buddy.held if buddy is not None else ())
        steps = have if steps is None else steps & have
    if not steps:
        raise ShardLost(f"no snapshot step is held for every slot (slots lost: {list(fresh)}): a loss within "
                        "the first snapshot's exchange. Restart from your checkpoint")
    step = max(steps)
    return Recovery(step, stride, fresh, tuple(s for s, h in enumerate(holdings) if h is None or step not in h.own))


def inner(optimizer: Any) -> Any:
    """The optimizer whose state is this rank's: a ZeroRedundancyOptimizer's local one."""
    zero = type(optimizer).__name__ == "ZeroRedundancyOptimizer"  # (not imported: it costs others time)
    return optimizer.optim if zero else optimizer


@dataclass
class SnapshotState(ShardedState):
    """The StateTransfer of a sharded job with peer snapshots (see the module's docstring): a
    ShardedState (the built model and optimizer, its local shards) whose layout is Snapshots."""

    node: str = ""  # this process's node, where buddies are placed
    stride: int = 0  # slot -> buddy distance, fixed at the first formation; 0 until then
    ring: Ring = field(default_factory=Ring)
    handover: str = ""  # the agent's file where a stuck exit leaves the snapshots for the slot's next process
    unwrap: Callable[[Any], Any] = inner  # (a ZeroRedundancyOptimizer's local one holds this rank's state)

    def snapshots(self) -> tuple[int, int]:
        """(every how many steps, the host memory they take here): what `muster status` shows."""
        return self.layout.every, self.ring.memory_bytes()

    def saved_shard(self, rank: int) -> int | None:
        """The checkpoint shard this rank writes: its slot's."""
        return self.slot if self.mesh is not None else None

    def stepped(self, step: int) -> None:
        """At every completed step's boundary, on the training thread."""
        self.ring.ask()
        if step % self.layout.every == 0:
            self.ring.take(step, self._shards().tree())

    def sync(self, step: int, channel: Channel, device: torch.device,
             progress: Callable[[str], None] | None = None) -> SyncResult:
        started = time.perf_counter()
        self.ring.stop()
        if self.slot < 0 and self.handover:
            self._take_over()
        live = step if self.model is not None else NO_LIVE_STATE
        mine = Holding(live, tuple(self.ring.own), tuple(self.ring.held), self.stride) if self.slot >= 0 else None
        cards = [json.loads(v) for v in channel.exchange("snapshots/holding", json.dumps(
            [self.slot, self.node, mine and mine.encode()]))]
        held = [Holding.decode(h) for _, _, h in cards]
        rank_of_slot = keep_slots([slot for slot, _, _ in cards], self.layout.shards,
                                  [h is not None and h.step == NO_LIVE_STATE for h in held])
        # A holding counts for the slot its rank claimed (a claim not kept holds another slot's shard)
        holdings = [held[r] if cards[r][0] == s else None for s, r in enumerate(rank_of_slot)]
        nodes = [cards[r][1] for r in rank_of_slot]
        try:
            recovery, lost = recover(holdings, nodes), False
        except ShardLost:  # no copy of a shard left in memory: the durable tier, or the run ends
            if self.durable is None:
                raise
            recovery, lost = Recovery(None, self.stride or buddy_stride(nodes)), True
        kept = self._shards().tree() if self.model is not None and recovery.step is None and not lost else None
        self.model = self.optimizer = self.mesh = None
        claimed, self.slot, self.stride = self.slot, rank_of_slot.index(channel.rank), recovery.stride
        if claimed != self.slot:
            self.ring.keep_until(-1)  # none of them is this slot's
        with self.subgroups():
            self.mesh = self.layout.mesh(rank_of_slot, device.type)
            ring_group = dist.new_group(rank_of_slot, sort_ranks=False, backend="gloo", timeout=TIMEOUT)
        meshed = time.perf_counter()
        self.model, self.optimizer = self.build(self.mesh)
        self.on_built(self.model, self.optimizer)
        self._check_zero()
        built = time.perf_counter()
        received = sent = 0
        resumed = None
        if recovery.step is not None:
            received, sent = self._recover(recovery, ring_group)
        elif kept is not None:
            restore(self.model, inner(self.optimizer), kept)
        elif self.durable is not None:  # a first formation (the job started again, every rank lost) or a lost shard
            resumed = self.durable.resume(channel, self.slot, self.restore_saved, -1 if lost else 0)
            if lost and resumed is None:
                raise ShardLost(f"a slot and its buddy were lost together and no checkpoint is in {self.durable.spec.dir}")
            if resumed is not None:
                self.ring.keep_until(-1)  # snapshots of the state given up
        restored = time.perf_counter()
        now = resumed if resumed is not None else step if recovery.step is None else recovery.step
        n = self.layout.shards
        self.ring.connect(ring_group, recovery.buddy(self.slot, n), (self.slot - recovery.stride) % n)
        if now in self.ring.own:
            self.ring.send(now)  # the buddy holds this state too, whatever it held before
        else:
            self.ring.take(now, self._shards().tree())
        role = "receiver" if self.slot in recovery.receivers else "source" if sent else "kept"
        receivers = tuple(rank_of_slot[s] for s in recovery.receivers)
        sources = tuple(rank_of_slot[recovery.buddy(s, n)] for s in recovery.receivers)
        result = SyncResult(now, SyncPlan(Card(now, "snapshot", ""), sources, receivers, ()), role,
                            sent=sent, received=received,
                            tier="checkpoint" if resumed is not None else "snapshot" if recovery.step is not None else "live")
        result.phases = {"agree_s": meshed - started, "build_s": built - meshed, "restore_s": restored - built}
        log.info("snapshot_recovery" if recovery.step is not None else "mesh_placed", slot=self.slot, step=now,
                 rolled_back=max(0, step - now) if recovery.step is not None and self.slot not in recovery.fresh else 0,
                 fresh=list(recovery.fresh), stride=recovery.stride, role=role,
                 snapshot_mib=round(self.ring.memory_bytes() / (1 << 20), 2))
        return result

    def hand_over(self) -> None:
        """At a stuck exit, on another thread than the stuck training one: the snapshots, for the
        slot's next process (under `muster run`, which names the file)."""
        if self.slot < 0 or not self.handover:
            return
        began = time.perf_counter()
        nbytes = self.ring.leave(self.handover, self.slot, self.stride)
        log.info("snapshots_left_behind", slot=self.slot, own=sorted(self.ring.own), held=sorted(self.ring.held),
                 mib=round(nbytes / (1 << 20), 3), seconds=round(time.perf_counter() - began, 3))

    def _take_over(self) -> None:
        """A fresh process in a slot whose last process exited stuck: that one's snapshots are this one's."""
        try:
            taken = self.ring.take_over(self.handover)
        except (OSError, ValueError, KeyError) as exc:  # then it starts fresh, as without them
            self.ring.keep_until(-1)
            log.warning("snapshots_not_taken_over", path=self.handover, error=str(exc)[:200])
            return
        if taken is not None:
            self.slot, self.stride = taken
            log.info("snapshots_taken_over", slot=self.slot, own=sorted(self.ring.own), held=sorted(self.ring.held))

    def _recover(self, recovery: Recovery, group: dist.ProcessGroup) -> tuple[int, int]:
        """Every rank's state back to snapshot `recovery.step`, a receiver's from its buddy (sends
        posted first: a rank may both send and receive). Returns (bytes received, bytes sent)."""
        n, step = self.layout.shards, recovery.step
        sends = [self.ring.give(group, s, step) for s in recovery.receivers if recovery.buddy(s, n) == self.slot]
        received = 0
        if self.slot in recovery.receivers:
            received = self.ring.take_back(group, recovery.buddy(self.slot, n)).nbytes
        for works, _ in sends:
            for work in works:
                work.wait()
        self.ring.keep_until(step)
        tree = self.ring.own[step].tree()
        restore(self.model, inner(self.optimizer), tree)
        for name, obj in self.extras.items():
            obj.load_state_dict(tree["extras"][name])
        return received, sum(nbytes for _, nbytes in sends)

    def _check_zero(self) -> None:
        """A ZeroRedundancyOptimizer partitions by its group's ranks: they must be the mesh's (slots)."""
        group = getattr(self.optimizer, "process_group", None)
        if inner(self.optimizer) is not self.optimizer and group is not self.mesh.get_group():
            raise LayoutMismatch("the ZeroRedundancyOptimizer must be built on the mesh's group "
                                 "(process_group=mesh.get_group()): its partitions then follow the mesh slots, "
                                 "which a replacement keeps, not the ranks, which it does not")
