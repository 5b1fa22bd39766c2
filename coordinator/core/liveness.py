"""Liveness bookkeeping: what each node and rank last reported, and who has failed.

Three signals: a process exit (reported by the node, acted on at once elsewhere), silence
(no frame for heartbeat_timeout) and a stall (frames arrive but the step does not advance
for the progress timeout, calibrated from observed step times, suspended in declared long
phases). A generation is also watched as a whole: ranks that hold after a failed collective
with nobody found failed, or a map that does not form within the form timeout, are decided
again. Mutable for the hot path, but no clock reads and no I/O: `now` is an argument.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass, field

from muster.coordinator.core.kinds import FailureKind
from muster.coordinator.core.policy import Timing
from muster.coordinator.core.state import JobState, NodeKind

MIN_CALIBRATION_SAMPLES = 8


@dataclass
class RankLive:
    pid: int = 0
    step: int = 0
    step_time_s: float = 0.0
    state: str = "starting"  # starting | running | long_phase | forming | holding | exited | unmonitored | restarting
    phase: str = ""
    heard_ms_ago: int = 0
    progress_at: float = 0.0  # when the step last advanced (or the generation changed)
    phase_since: float | None = None
    digest_step: int = 0
    digest: bytes = b""
    generation: int = 0  # of the group it is in, or forming


@dataclass
class NodeLive:
    last_frame_at: float
    generation: int = 0
    ranks: dict[int, RankLive] = field(default_factory=dict)


@dataclass(frozen=True)
class Failure:
    kind: FailureKind
    node_id: str  # "" for the group kinds
    local_rank: int | None
    reason: str
    since: float | None = None  # when its first signal came: the last frame, report or progress


UNMONITORED = frozenset({"unmonitored", "restarting"})  # scripts without the library: no steps to judge
NO_PROGRESS = UNMONITORED | {"exited"}  # reports that say nothing of a library rank's progress


@dataclass(frozen=True)
class RankReport:
    local_rank: int
    pid: int
    step: int
    step_time_s: float
    state: str
    heard_ms_ago: int = 0
    phase: str = ""
    digest_step: int = 0
    digest: bytes = b""
    generation: int = 0  # of the group the rank is in or forming (0: none yet)


@dataclass(frozen=True)
class Divergence:
    step: int
    ranks: tuple[int, ...]  # ranks whose parameters differ from the majority (all, without one)
    nodes: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class Recovery:
    """A new generation's recovery under way: decided at `decided_at`, the job then at `step`."""

    generation: int
    decided_at: float
    step: int


class Liveness:
    def __init__(self, timing: Timing, now: float):
        self.timing = timing
        self.nodes: dict[str, NodeLive] = {}
        self.step_times: deque[float] = deque(maxlen=256)
        self.grace_until = now
        self.failed_pids: dict[tuple[str, int], int] = {}
        self.digests_checked_step = 0
        self.diverged_ranks: tuple[int, ...] = ()  # the last ranks flagged: not flagged again while unchanged
        self.published: tuple[int, float] = (0, now)  # the current map's generation, and since when it is due

    def start_grace(self, node_ids, now: float) -> None:
        """A new leader: every known node gets grace_s to reconnect before silence counts."""
        self.grace_until = now + self.timing.grace_s
        for node_id in node_ids:
            self.nodes.setdefault(node_id, NodeLive(now)).last_frame_at = now

    def in_grace(self, now: float) -> bool:
        return now < self.grace_until

    def track(self, node_id: str, now: float) -> None:
        self.nodes.setdefault(node_id, NodeLive(now))

    def forget(self, node_id: str) -> None:
        self.nodes.pop(node_id, None)
        for key in [k for k in self.failed_pids if k[0] == node_id]:
            del self.failed_pids[key]

    def observe(self, node_id: str, generation: int, reports: list[RankReport], now: float) -> list[int]:
        """Record a frame. Returns the local ranks that came back (a new process in a failed slot)."""
        node = self.nodes.get(node_id)
        if node is None:
            node = self.nodes[node_id] = NodeLive(now)
        node.last_frame_at = now
        node.generation = generation
        recovered = []
        for r in reports:
            live = node.ranks.get(r.local_rank)
            if live is None:
                live = node.ranks[r.local_rank] = RankLive(progress_at=now)
            if r.step != live.step or r.pid != live.pid:
                if r.step > live.step and r.pid == live.pid and r.step_time_s > 0:
                    self.step_times.append(r.step_time_s)
                live.progress_at = now
            if r.state != live.state:
                # Entering or leaving a phase is progress: a rank back from a long reform is not stalled.
                live.progress_at = now
                live.phase_since = now if r.state in ("long_phase", "forming", "holding") else None
            live.pid, live.step, live.step_time_s, live.generation = r.pid, r.step, r.step_time_s, r.generation
            live.state, live.phase, live.heard_ms_ago = r.state, r.phase, r.heard_ms_ago
            if r.digest_step:
                live.digest_step, live.digest = r.digest_step, r.digest
            failed_pid = self.failed_pids.get((node_id, r.local_rank))
            if failed_pid is not None and r.pid and r.pid != failed_pid and r.state != "exited":
                del self.failed_pids[(node_id, r.local_rank)]
                recovered.append(r.local_rank)
        return recovered

    def mark_failed(self, node_id: str, local_rank: int, pid: int) -> None:
        """The slot's process failed; a different pid in that slot later means it came back."""
        self.failed_pids[(node_id, local_rank)] = pid or -1

    def generation_published(self, generation: int, now: float) -> None:
        """A new map (or a new leader's first view of the current one): reforming is not a stall,
        and the form timeout counts from now."""
        self.published = (generation, now)
        for node in self.nodes.values():
            for live in node.ranks.values():
                live.progress_at = now

    def recovered(self, state: JobState, recovery: Recovery, now: float) -> tuple[bool, float | None]:
        """Whether `recovery` is over, and how long it took: until every node of its map reported
        the generation and a step past the one at the decision (None: another map superseded it,
        or there is nothing to run)."""
        rm = state.rank_map
        if rm is None or rm.generation != recovery.generation:
            return True, None
        for p in rm.placements:
            node = self.nodes.get(p.node_id)
            if node is None or node.generation < recovery.generation or not any(
                    r.step > recovery.step for s, r in node.ranks.items() if s in p.slots):
                return False, None
        return True, now - recovery.decided_at

    def progress_timeout(self) -> float:
        t = self.timing
        if t.progress_timeout_s is not None:
            return t.progress_timeout_s
        if len(self.step_times) < MIN_CALIBRATION_SAMPLES:
            return max(t.progress_floor_s, t.startup_progress_timeout_s)
        ordered = sorted(self.step_times)
        p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
        return max(t.progress_floor_s, t.progress_factor * p99)

    def median_step_time(self) -> float | None:
        if not self.step_times:
            return None
        ordered = sorted(self.step_times)
        return ordered[len(ordered) // 2]

    def max_step(self, state: JobState) -> int:
        rm = state.rank_map
        if rm is None:
            return 0
        steps = [
            r.step
            for p in rm.placements
            if (node := self.nodes.get(p.node_id)) is not None
            for slot, r in node.ranks.items()
            if slot in p.slots
        ]
        return max(steps, default=0)

    def runs_library(self, state: JobState) -> bool:
        """Some rank of the map reports library progress (scripts without it are unmonitored)."""
        rm = state.rank_map
        for p in rm.placements if rm else ():
            node = self.nodes.get(p.node_id)
            if node is not None and any(r.state not in NO_PROGRESS for r in node.ranks.values()):
                return True
        return False

    def reforming(self, state: JobState) -> bool:
        """The current map is an abort generation that some library rank of it has not formed yet
        (it still forms or holds, or runs an older group): the leader holds back planned changes
        until it has (a node that reconnects gets only the current map, never the abort before a
        planned one: it would form the new group while the others form the abort's)."""
        rm = state.rank_map
        if rm is None or not rm.abort_previous:
            return False
        for p in rm.placements:
            node = self.nodes.get(p.node_id)
            for slot in p.slots:
                r = node.ranks.get(slot) if node else None
                if r is None or r.state in NO_PROGRESS:
                    continue
                if r.state in ("forming", "holding") or r.generation < rm.generation:
                    return True
        return False

    def awaiting(self, node_id: str, slots) -> None:
        """Slots with no process yet (a node starting its ranks): any process there is their recovery."""
        for slot in slots:
            self.mark_failed(node_id, slot, -1)

    def exited_in_map(self, state: JobState) -> list[Failure]:
        """Slots of the map whose rank a node reports as exited, or as restarting in place in the
        current generation: an exit report that went to a previous leader is not lost. Acted on
        even during the grace, like any exit; the pid of an exited rank is remembered so that a new
        process in the slot counts as its recovery. A restarting slot keeps its place: the job
        re-forms once with its replacement."""
        rm = state.rank_map
        found = []
        for p in rm.placements if rm else ():
            node = self.nodes.get(p.node_id)
            for slot in p.slots:
                r = node.ranks.get(slot) if node else None
                if r is None:
                    continue
                if r.state == "exited":
                    self.mark_failed(p.node_id, slot, r.pid)
                    found.append(Failure(FailureKind.RANK_EXITED, p.node_id, slot, f"reported exited (pid {r.pid})"))
                elif r.state == "restarting" and r.generation == rm.generation:
                    found.append(Failure(FailureKind.RANK_RESTARTED, p.node_id, slot,
                                         f"local rank {slot} (pid {r.pid}) is restarting in place"))
        return found

    def failures(self, state: JobState, now: float) -> list[Failure]:
        """Exited ranks of the map; silence and stalls among the members, except during the grace."""
        exited = self.exited_in_map(state)
        if self.in_grace(now):
            return exited
        t = self.timing
        found: list[Failure] = exited
        stall_after = self.progress_timeout()
        rm = state.rank_map
        for member in state.members:
            node = self.nodes.get(member.node_id)
            if node is None:
                continue
            silent_s = now - node.last_frame_at
            if silent_s > t.heartbeat_timeout_s:
                found.append(Failure(FailureKind.NODE_SILENT, member.node_id, None, f"no frame for {silent_s:.2f}s",
                                     node.last_frame_at))
                continue
            placement = rm.placement(member.node_id) if rm else None
            if placement is None:
                continue
            for slot in placement.slots:
                live = node.ranks.get(slot)
                if live is None or live.state in NO_PROGRESS:
                    continue  # exited: found above; unmonitored: no library, its exit is the signal
                if member.kind is NodeKind.AGENT and live.heard_ms_ago > t.heartbeat_timeout_s * 1000:
                    found.append(
                        Failure(FailureKind.RANK_SILENT, member.node_id, slot,
                                f"agent has not heard from it for {live.heard_ms_ago}ms",
                                node.last_frame_at - live.heard_ms_ago / 1000)
                    )
                elif live.state == "long_phase":
                    if live.phase_since is not None and now - live.phase_since > t.long_phase_timeout_s:
                        found.append(
                            Failure(
                                FailureKind.RANK_STALLED,
                                member.node_id,
                                slot,
                                f"long phase {live.phase!r} exceeded {t.long_phase_timeout_s:.0f}s",
                                live.phase_since,
                            )
                        )
                elif live.state in ("forming", "holding"):
                    continue  # waiting for the others: judged with the whole generation (group_failures)
                elif live.state == "starting" and now - live.progress_at > max(stall_after, t.startup_progress_timeout_s):
                    found.append(
                        Failure(FailureKind.RANK_STALLED, member.node_id, slot,
                                f"no step completed for {now - live.progress_at:.2f}s since it started", live.progress_at)
                    )
                elif live.state == "running" and now - live.progress_at > stall_after:
                    found.append(
                        Failure(
                            FailureKind.RANK_STALLED,
                            member.node_id,
                            slot,
                            f"step {live.step} has not advanced for {now - live.progress_at:.2f}s "
                            f"(progress timeout {stall_after:.2f}s)",
                            live.progress_at,
                        )
                    )
        if not found and rm is not None:
            found = self.group_failures(rm, now)
        return found

    def group_failures(self, rm, now: float) -> list[Failure]:
        """The current generation as a whole. Ranks holding in it for the heartbeat timeout (a
        collective failed; had a node died, silence would have found it by now) break the group.
        Past the form timeout, ranks of the map that never reached it are to blame (the waiting
        are not); when every rank arrived and it still did not form, it is decided again."""
        t = self.timing
        holding, waiting, missing = [], [], []
        starting = False
        for p in rm.placements:
            node = self.nodes.get(p.node_id)
            for slot in p.slots:
                r = node.ranks.get(slot) if node else None
                if r is None or r.state in NO_PROGRESS:
                    continue  # no report yet (silence covers it), no library, or found above
                if r.state == "starting" and r.generation == 0:
                    starting = True  # in no group yet: the start-up timeout judges it, and the others wait
                    continue
                if r.generation >= rm.generation and r.state in ("running", "long_phase", "starting"):
                    continue  # formed (starting: no step completed yet in this process)
                if r.generation == rm.generation and r.state in ("forming", "holding"):
                    waiting.append((p, slot))
                    if r.state == "holding" and r.phase_since is not None and now - r.phase_since > t.heartbeat_timeout_s:
                        holding.append(p.rank_of(slot))
                elif r.state in ("running", "long_phase") and not rm.abort_previous:
                    continue  # a planned switch ahead: it switches at its step (a stall is found above)
                else:
                    missing.append((p, slot, r))
        if holding:
            return [Failure(FailureKind.GROUP_BROKEN, "", None, f"ranks {_few(holding)} of generation {rm.generation} "
                            f"hold after a failed collective and nobody was found failed")]
        generation, since = self.published
        if starting or generation != rm.generation or now - since <= t.form_timeout_s or not (missing or waiting):
            return []
        if missing:
            return [Failure(FailureKind.RANK_NOT_FORMED, p.node_id, slot,
                            f"did not reach generation {rm.generation} within {t.form_timeout_s:g}s "
                            f"(it reports {r.state} in generation {r.generation})", since)
                    for p, slot, r in missing]
        return [Failure(FailureKind.GROUP_NOT_FORMED, "", None, f"every rank of generation {rm.generation} arrived "
                        f"but the group did not form within {t.form_timeout_s:g}s ({len(waiting)} waiting)", since)]

    def divergence(self, state: JobState) -> Divergence | None:
        """Once every rank of the map has sent a parameter digest of the same step, compare them.
        Each step is judged once; the same odd ranks are flagged once until the set changes."""
        rm = state.rank_map
        if rm is None or rm.world_size < 2:
            return None
        seen: list[tuple[int, str, int, bytes]] = []
        for p in rm.placements:
            node = self.nodes.get(p.node_id)
            for slot in p.slots:
                r = node.ranks.get(slot) if node else None
                if r is None or not r.digest_step:
                    return None
                seen.append((p.rank_of(slot), p.node_id, r.digest_step, r.digest))
        steps = {step for _, _, step, _ in seen}
        step = steps.pop()
        if steps or step <= self.digests_checked_step:
            return None
        self.digests_checked_step = step
        counts = Counter(digest for _, _, _, digest in seen).most_common()
        majority = counts[0][0] if len(counts) == 1 or counts[0][1] > counts[1][1] else None
        odd = [(rank, node) for rank, node, _, digest in seen if digest != majority]
        ranks = tuple(rank for rank, _ in odd)
        if ranks == self.diverged_ranks:
            return None
        self.diverged_ranks = ranks
        if not ranks:
            return None
        nodes = tuple(dict.fromkeys(node for _, node in odd))
        if majority is None:
            reason = f"step {step}: no majority among {len(seen)} ranks ({len(counts)} distinct digests)"
        else:
            reason = f"step {step}: ranks {list(ranks)} differ from the majority ({counts[0][1]} of {len(seen)})"
        return Divergence(step, ranks, nodes, reason)


def _few(ranks: list[int], limit: int = 8) -> str:
    shown = ", ".join(map(str, ranks[:limit]))
    return f"[{shown}{', ...' if len(ranks) > limit else ''}]"
