"""Liveness bookkeeping: what each node and rank last reported, and who has failed.

Three signals: a process exit (reported by the node, acted on at once elsewhere), silence
(no frame for heartbeat_timeout) and a stall (frames arrive but the step does not advance
for the progress timeout, calibrated from observed step times, suspended in declared long
phases). A generation is also watched as a whole: ranks that hold after a failed collective
with nobody found failed, or a map that does not form within the form timeout, are decided
again. Mutable for the hot path, but no clock reads and no I/O: `now` is an argument.

A tally costs O(what changed), not O(ranks): silence is found in a timing wheel (nodes by the
slot of their last frame: a frame moves its node to the current slot, so a slot older than the
heartbeat timeout holds only silent nodes); a node's ranks are judged when their earliest
deadline can have passed (a heap; a frame only updates fields, the deadline is found again when
judged); exits, holds and digests are kept in small indexes as frames report them.
"""

from __future__ import annotations

import heapq
import math
import zlib
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from muster.coordinator.core.kinds import FailureKind
from muster.coordinator.core.policy import Timing
from muster.coordinator.core.state import JobState, NodeKind

MIN_CALIBRATION_SAMPLES = 8
JUDGED_PER_TALLY = 256  # nodes whose ranks one tally judges at most (a few ms)
POPPED_PER_TALLY = 1024  # heap entries one tally takes at most, superseded ones included
SCANNED_PER_TALLY = 1024  # nodes of the map one tally looks at when a generation may not have formed


@dataclass(slots=True)  # one per rank of the job: no per-object dict
class RankLive:
    pid: int = 0
    step: int = 0
    step_time_s: float = 0.0
    state: str = "starting"  # starting | running | long_phase | forming | holding | exited | unmonitored | restarting
    phase: str = ""
    heard_ms_ago: int = 0
    progress_at: float = 0.0  # when the step last advanced (a published generation counts too: `Liveness.published`)
    phase_since: float | None = None
    digest_step: int = 0
    digest: bytes = b""
    generation: int = 0  # of the group it is in, or forming


@dataclass(slots=True)
class NodeLive:
    last_frame_at: float
    generation: int = 0
    ranks: dict[int, RankLive] = field(default_factory=dict)
    top_step: int = 0  # the highest step of its ranks in its last frame
    heard_slot: int = -1  # the slot of `Liveness._heard` that holds it (by its last frame)
    early: float = 0.0  # in [0, 0.5): how much of the progress timeout's floor its judgements come early


@dataclass(frozen=True)
class Failure:
    kind: FailureKind
    node_id: str  # "" for the group kinds
    local_rank: int | None
    reason: str
    since: float | None = None  # when its first signal came: the last frame, report or progress


UNMONITORED = frozenset({"unmonitored", "restarting"})  # scripts without the library: no steps to judge
NO_PROGRESS = UNMONITORED | {"exited", "finished"}  # reports that say nothing of a library rank's progress
REPORTED = frozenset({"exited", "restarting"})  # acted on as reported, not at a deadline
WAITING = frozenset({"long_phase", "forming", "holding"})  # phases timed from when they began


class RankReport(NamedTuple):  # a tuple: made for every rank of every frame, 5x cheaper than a dataclass
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
        # Indexes kept by `observe`, so that a tally looks only at what changed:
        self._slot_s = timing.heartbeat_timeout_s / 8
        self._heard: dict[int, set[str]] = {}  # wheel slot (of the last frame) -> nodes
        self._due: list[tuple[float, str]] = []  # (when a node's ranks may next fail, node): a heap, stale entries skipped
        self._armed: dict[str, float] = {}  # node -> its one live entry in _due
        self._reported: set[tuple[str, int]] = set()  # slots reporting exited or restarting
        self._holding: set[tuple[str, int]] = set()  # slots reporting holding
        self._digests: Counter[int] = Counter()  # digest step -> slots whose latest digest is of it
        self._digests_new = False  # a digest arrived since `divergence` last looked
        self._formed: tuple[int, float] = (0, 0.0)  # a generation found formed, and when to look again
        self._scan: tuple = (0, 0, False, [], [])  # a look at the whole map under way: (generation, next
        #                                            placement, any starting, waiting, missing so far)
        self._recovery: tuple[int, int] = (0, 0)  # (generation, placements found recovered so far)

    def start_grace(self, node_ids, now: float) -> None:
        """A new leader: every known node gets grace_s to reconnect before silence counts."""
        self.grace_until = now + self.timing.grace_s
        floor = self.timing.progress_timeout_s or self.timing.progress_floor_s
        for node_id in node_ids:
            node = self._node(node_id, now)
            self._heard_now(node_id, node, now)
            self._arm(node_id, self.grace_until + node.early * floor)  # spread: not every node in one tally

    def in_grace(self, now: float) -> bool:
        return now < self.grace_until

    def track(self, node_id: str, now: float) -> None:
        if node_id not in self.nodes:
            self._heard_now(node_id, self._node(node_id, now), now)
            self._arm(node_id, now)

    def forget(self, node_id: str) -> None:
        node = self.nodes.pop(node_id, None)
        self._armed.pop(node_id, None)
        if node is not None:
            self._unwheel(node_id, node)
        for slot, live in node.ranks.items() if node else ():
            self._reported.discard((node_id, slot))
            self._holding.discard((node_id, slot))
            self._count_digest(live.digest_step, -1)
        for key in [k for k in self.failed_pids if k[0] == node_id]:
            del self.failed_pids[key]

    def _node(self, node_id: str, now: float) -> NodeLive:
        node = self.nodes.get(node_id)
        if node is None:
            node = self.nodes[node_id] = NodeLive(now, early=zlib.crc32(node_id.encode()) / 2**33)
        return node

    def _heard_now(self, node_id: str, node: NodeLive, now: float, vouched: bool = False) -> None:
        """A frame of the node now; `vouched` (relayed): its relay judges its silence, not the wheel."""
        node.last_frame_at = now
        if vouched:
            self._unwheel(node_id, node)
            return
        slot = int(now / self._slot_s)
        if slot != node.heard_slot:
            self._unwheel(node_id, node)
            self._heard.setdefault(slot, set()).add(node_id)
            node.heard_slot = slot

    def _unwheel(self, node_id: str, node: NodeLive) -> None:
        if node.heard_slot in self._heard:
            self._heard[node.heard_slot].discard(node_id)
        node.heard_slot = -1

    def unvouched(self, node_id: str, now: float) -> None:
        """The relay that vouched for `node_id` is gone, or the node's stream there ended (lost by
        its carrier, not by the node): its silence is judged here, counting from now, so that it has
        the heartbeat timeout to reconnect elsewhere."""
        node = self.nodes.get(node_id)
        if node is not None:
            self._heard_now(node_id, node, now)

    def silent_since(self, node_id: str, since: float) -> None:
        """Its relay heard nothing from `node_id` since `since`: judged here as if its last frame
        came then (found silent at the next tally past the heartbeat timeout)."""
        node = self.nodes.get(node_id)
        if node is not None:
            self._heard_now(node_id, node, min(since, node.last_frame_at))

    def _arm(self, node_id: str, at: float) -> None:
        """Judge the ranks of `node_id` at `at`, unless they are due sooner already."""
        if at < self._armed.get(node_id, math.inf):
            self._armed[node_id] = at
            heapq.heappush(self._due, (at, node_id))

    def _count_digest(self, step: int, by: int) -> None:
        if step:
            self._digests[step] += by
            if self._digests[step] <= 0:
                del self._digests[step]

    def observe(self, node_id: str, generation: int, reports: list[RankReport], now: float, *,
                vouched: bool = False) -> list[int]:
        """Record a frame. Returns the local ranks that came back (a new process in a failed slot).
        `vouched`: it came through a relay, which judges the node's silence and forwards frames
        that only advance steps now and then: the node leaves the wheel until `unvouched` or
        `silent_since`."""
        node = self.nodes.get(node_id)
        if node is None:
            node = self._node(node_id, now)
            self._arm(node_id, now)
        self._heard_now(node_id, node, now, vouched)
        node.generation = generation
        recovered = []
        lost_ms = self.timing.heartbeat_timeout_s * 1000
        top_step = 0
        for r in reports:
            top_step = max(top_step, r.step)
            live = node.ranks.get(r.local_rank)
            if live is None:
                live = node.ranks[r.local_rank] = RankLive(progress_at=now)
                self._arm(node_id, now)
            if r.step != live.step or r.pid != live.pid:
                if r.step > live.step and r.pid == live.pid and r.step_time_s > 0:
                    self.step_times.append(r.step_time_s)
                live.progress_at = now
            if r.state != live.state:
                # Entering or leaving a phase is progress: a rank back from a long reform is not stalled.
                live.progress_at = now
                live.phase_since = now if r.state in WAITING else None
                key = (node_id, r.local_rank)
                if r.state in REPORTED:
                    self._reported.add(key)
                else:
                    self._reported.discard(key)
                if r.state == "holding":
                    self._holding.add(key)
                else:
                    self._holding.discard(key)
                self._arm(node_id, now)  # a new state: its deadlines are found at the next tally
            live.pid, live.step, live.step_time_s, live.generation = r.pid, r.step, r.step_time_s, r.generation
            live.state, live.phase, live.heard_ms_ago = r.state, r.phase, r.heard_ms_ago
            if r.heard_ms_ago > lost_ms:
                self._arm(node_id, now)  # its agent lost it: judged at the next tally
            if r.digest_step and (r.digest_step, r.digest) != (live.digest_step, live.digest):
                self._count_digest(live.digest_step, -1)
                self._count_digest(r.digest_step, 1)
                live.digest_step, live.digest = r.digest_step, r.digest
                self._digests_new = True
            failed_pid = self.failed_pids.get((node_id, r.local_rank)) if self.failed_pids else None
            if failed_pid is not None and r.pid and r.pid != failed_pid and r.state != "exited":
                del self.failed_pids[(node_id, r.local_rank)]
                recovered.append(r.local_rank)
        if reports:
            node.top_step = top_step
        return recovered

    def advance(self, node_id: str, generation: int, local_ranks: Sequence[int],
                steps: Sequence[tuple[int, int, int]], now: float, *, vouched: bool = False) -> bool:
        """Record a frame that only advances steps (`NodeFrame.steps_only`): `steps` holds
        (step, step_time_us, heard_ms_ago) for each rank of `local_ranks`, whose other fields are as
        last observed. The hot path: three numbers a rank. False, recording nothing, when these are
        not the node's ranks (the frame is then read in full)."""
        node = self.nodes.get(node_id)
        if node is None or node.generation != generation:
            return False
        ranks = node.ranks
        lives = [ranks.get(lr) for lr in local_ranks]
        if None in lives:
            return False
        self._heard_now(node_id, node, now, vouched)
        lost_ms = self.timing.heartbeat_timeout_s * 1000
        top_step = 0
        for live, (step, step_time_us, heard_ms_ago) in zip(lives, steps):
            top_step = max(top_step, step)
            if step != live.step:
                if step > live.step and step_time_us:
                    self.step_times.append(step_time_us / 1e6)
                live.progress_at = now
                live.step, live.step_time_s = step, step_time_us / 1e6
            live.heard_ms_ago = heard_ms_ago
            if heard_ms_ago > lost_ms:
                self._arm(node_id, now)  # its agent lost it: judged at the next tally
        if steps:
            node.top_step = top_step
        return True

    def mark_failed(self, node_id: str, local_rank: int, pid: int) -> None:
        """The slot's process failed; a different pid in that slot later means it came back."""
        self.failed_pids[(node_id, local_rank)] = pid or -1

    def generation_published(self, generation: int, now: float) -> None:
        """A new map (or a new leader's first view of the current one): reforming is not a stall
        (every rank's progress counts from now), and the form timeout counts from now."""
        self.published = (generation, now)

    def recovered(self, state: JobState, recovery: Recovery, now: float) -> tuple[bool, float | None]:
        """Whether `recovery` is over, and how long it took: until every node of its map reported
        the generation and a step past the one at the decision (None: another map superseded it,
        or there is nothing to run). Nodes found recovered stay so: each tally goes on from the
        first that was not."""
        rm = state.rank_map
        if rm is None or rm.generation != recovery.generation:
            return True, None
        generation, start = self._recovery
        i = start if generation == recovery.generation else 0
        for p in rm.placements[i:]:
            node = self.nodes.get(p.node_id)
            if node is None or node.generation < recovery.generation or not any(
                    r.step > recovery.step for s, r in node.ranks.items() if s in p.slots):
                self._recovery = (recovery.generation, i)
                return False, None
            i += 1
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
        """The highest step a node of the map reported last (O(nodes), at a decision only)."""
        rm = state.rank_map
        if rm is None:
            return 0
        nodes = self.nodes
        return max((node.top_step for p in rm.placements if (node := nodes.get(p.node_id)) is not None), default=0)

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
        re-forms once with its replacement. O(slots reporting so), in the order of the map."""
        rm = state.rank_map
        if rm is None or not self._reported:
            return []
        found = []
        for node_id, slot in self._reported:
            p = rm.placement(node_id)
            if p is None or slot not in p.slots:
                continue
            r = self.nodes[node_id].ranks[slot]
            if r.state == "exited":
                self.mark_failed(node_id, slot, r.pid)
                found.append((p.node_rank, slot, Failure(FailureKind.RANK_EXITED, node_id, slot,
                                                         f"reported exited (pid {r.pid})")))
            elif r.generation == rm.generation:
                found.append((p.node_rank, slot, Failure(FailureKind.RANK_RESTARTED, node_id, slot,
                                                         f"local rank {slot} (pid {r.pid}) is restarting in place")))
        return [f for _, _, f in sorted(found, key=lambda x: x[:2])]

    def failures(self, state: JobState, now: float) -> list[Failure]:
        """Exited ranks of the map; silence and stalls among the members, except during the grace.
        A failure is found at every tally until a decision removes it."""
        exited = self.exited_in_map(state)
        if self.in_grace(now):
            return exited
        found = self._silent(state, now) + self._stalled(state, now)
        failures = exited + [f for _, _, f in sorted(found, key=lambda x: x[:2])]
        if not failures and state.rank_map is not None:
            failures = self.group_failures(state.rank_map, now)
        return failures

    def _silent(self, state: JobState, now: float) -> list[tuple[int, int, Failure]]:
        """Members with no frame for the heartbeat timeout: the wheel's slots at or past it."""
        edge = now - self.timing.heartbeat_timeout_s
        found = []
        for slot in [k for k in self._heard if k * self._slot_s <= edge]:
            nodes = self._heard[slot]
            if not nodes:
                del self._heard[slot]
                continue
            for node_id in nodes:
                node, member = self.nodes[node_id], state.member(node_id)
                if member is not None and node.last_frame_at < edge:
                    found.append((member.seq, 0, Failure(FailureKind.NODE_SILENT, node_id, None,
                                                         f"no frame for {now - node.last_frame_at:.2f}s",
                                                         node.last_frame_at)))
        return found

    def _stalled(self, state: JobState, now: float) -> list[tuple[int, int, Failure]]:
        """The ranks of nodes due: at most JUDGED_PER_TALLY nodes (and POPPED_PER_TALLY entries) a
        tally; deadlines that bunch, such as every node's first after a takeover, spread over the
        next tallies."""
        found, judged, popped = [], [], 0
        stall_after = self.progress_timeout()
        while self._due and self._due[0][0] <= now and len(judged) < JUDGED_PER_TALLY and popped < POPPED_PER_TALLY:
            at, node_id = heapq.heappop(self._due)
            popped += 1
            if self._armed.get(node_id) != at:
                continue  # superseded by a sooner entry
            del self._armed[node_id]
            node, member = self.nodes.get(node_id), state.member(node_id)
            if node is None or member is None:
                continue  # armed again when it joins or reports
            failed, next_at = self._judge(member, node, state.rank_map, stall_after, now)
            found.extend((member.seq, f.local_rank, f) for f in failed)
            judged.append((node_id, now if failed else next_at))
        for node_id, at in judged:
            self._arm(node_id, at)
        return found

    def _judge(self, member, node: NodeLive, rm, stall_after: float, now: float) -> tuple[list[Failure], float]:
        """One node's failing ranks now, and when to judge them next (inf: not before a report
        changes their state). Deadlines are set at the progress timeout's floor (calibration may
        shorten the timeout meanwhile, never below it), less the node's own `early` share: nodes
        that progressed together are judged spread out, not in one tally."""
        t = self.timing
        placement = rm.placement(member.node_id) if rm else None
        if placement is None:
            return [], now + t.heartbeat_timeout_s  # a spare: looked at again in case a map places it
        shortest = t.progress_timeout_s if t.progress_timeout_s is not None else t.progress_floor_s
        published = self.published[1]
        silent_ms = t.heartbeat_timeout_s * 1000 if member.kind is NodeKind.AGENT else math.inf
        ranks = node.ranks
        found, next_at = [], math.inf
        for slot in placement.slots:
            live = ranks.get(slot)
            if live is None:
                continue
            state = live.state
            if state in NO_PROGRESS or state == "forming" or state == "holding":
                continue  # exited: found above; unmonitored: its exit is the signal; forming: group_failures
            progress_at = live.progress_at if live.progress_at > published else published
            if live.heard_ms_ago > silent_ms:
                found.append(Failure(FailureKind.RANK_SILENT, member.node_id, slot,
                                     f"agent has not heard from it for {live.heard_ms_ago}ms",
                                     node.last_frame_at - live.heard_ms_ago / 1000))
            elif state == "running":
                if now - progress_at > stall_after:
                    found.append(Failure(FailureKind.RANK_STALLED, member.node_id, slot,
                                         f"step {live.step} has not advanced for {now - progress_at:.2f}s "
                                         f"(progress timeout {stall_after:.2f}s)", progress_at))
                elif progress_at + shortest < next_at:
                    next_at = progress_at + shortest
            elif state == "starting":
                if now - progress_at > max(stall_after, t.startup_progress_timeout_s):
                    found.append(Failure(FailureKind.RANK_STALLED, member.node_id, slot,
                                         f"no step completed for {now - progress_at:.2f}s since it started",
                                         progress_at))
                next_at = min(next_at, progress_at + max(shortest, t.startup_progress_timeout_s))
            elif state == "long_phase" and live.phase_since is not None:
                if now - live.phase_since > t.long_phase_timeout_s:
                    found.append(Failure(FailureKind.RANK_STALLED, member.node_id, slot,
                                         f"long phase {live.phase!r} exceeded {t.long_phase_timeout_s:.0f}s",
                                         live.phase_since))
                next_at = min(next_at, live.phase_since + t.long_phase_timeout_s)
        return found, max(next_at - node.early * shortest, now + 1e-6)

    def group_failures(self, rm, now: float) -> list[Failure]:
        """The current generation as a whole. Ranks holding in it for the heartbeat timeout (a
        collective failed; had a node died, silence would have found it by now) break the group.
        Past the form timeout, ranks of the map that never reached it are to blame (the waiting
        are not); when every rank arrived and it still did not form, it is decided again. Holding
        ranks come from an index; the whole map is looked at only past the form timeout, until it
        is found formed (then again once per form timeout), SCANNED_PER_TALLY nodes a tally."""
        t = self.timing
        holding = []
        for node_id, slot in self._holding:
            p = rm.placement(node_id)
            if p is None or slot not in p.slots:
                continue
            r = self.nodes[node_id].ranks[slot]
            if r.generation == rm.generation and r.phase_since is not None and now - r.phase_since > t.heartbeat_timeout_s:
                holding.append(p.rank_of(slot))
        if holding:
            return [Failure(FailureKind.GROUP_BROKEN, "", None, f"ranks {_few(sorted(holding))} of generation "
                            f"{rm.generation} hold after a failed collective and nobody was found failed")]
        generation, since = self.published
        if generation != rm.generation or now - since <= t.form_timeout_s:
            return []
        formed, look_again_at = self._formed
        if formed == rm.generation and now < look_again_at:
            return []
        generation, start, starting, waiting, missing = self._scan
        if generation != rm.generation or start >= len(rm.placements):
            start, starting, waiting, missing = 0, False, [], []
        end = start + SCANNED_PER_TALLY
        for p in rm.placements[start:end]:
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
                elif r.state in ("running", "long_phase") and not rm.abort_previous:
                    continue  # a planned switch ahead: it switches at its step (a stall is found above)
                else:
                    missing.append((p, slot, r))
        self._scan = (rm.generation, end, starting, waiting, missing)
        if end < len(rm.placements) or starting:
            return []  # the rest at the next tallies
        if not (missing or waiting):
            self._formed = (rm.generation, now + t.form_timeout_s)
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
        Each step is judged once; the same odd ranks are flagged once until the set changes. The
        map is looked at only when a new digest made some step's count reach the world size."""
        rm = state.rank_map
        if rm is None or rm.world_size < 2 or not self._digests_new:
            return None
        self._digests_new = False
        if not any(step > self.digests_checked_step and count >= rm.world_size
                   for step, count in self._digests.items()):
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
