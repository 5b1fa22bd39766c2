"""The exit bookkeeping: slots whose rank a node reports exited or restarting in place, the
pids of failed processes, so that a new process in such a slot counts as its recovery, each
slot's last failure, so that one repeated by the next process is known (`repeated`), and the
failures at the job's start, so that one every rank met is known without a restart (`all_at_start`),
and when each node's ranks failed of their own fault, so that a node whose ranks alone keep failing
is known (`node_fault`). The last failures and the own faults are kept with the members too (the
job's state), so that a new leader goes on from them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from muster.coordinator.core.kinds import FailureKind
from muster.coordinator.core.live_records import REPORTED, Failure, NodeLive, RankReport, placed
from muster.coordinator.core.state import RankMap


# A node is held out once its ranks failed of their own fault this many times within the window while
# no other node's did: its hardware (a bad GPU, its memory), not the job's code, is the likely cause.
HOLD_OUT_FAILURES, HOLD_OUT_WINDOW_S = 3, 600.0


def error_digest(error: str) -> str:
    """A rank's error as its slot's last failure is kept (in the job's state, so short): "" for none."""
    return hashlib.sha256(error.encode()).hexdigest()[:16] if error else ""


class ExitBook:
    def __init__(self) -> None:
        self.failed_pids: dict[tuple[str, int], int] = {}  # (node, slot) -> the pid that failed there (-1: none yet)
        self.reported: set[tuple[str, int]] = set()  # slots reporting exited or restarting
        self.last_errors: dict[tuple[str, int], tuple[str, int, int]] = {}  # (node, slot) -> (digest, step, pid)
        self.at_start: dict[tuple[str, int], str] = {}  # (node, slot) -> the error it died of at the job's start
        self.cohort: tuple[int, frozenset[tuple[str, int]]] = (0, frozenset())  # the map they started in
        self.own_faults: dict[str, list[int]] = {}  # node -> when (wall ms) its ranks failed of their own fault

    def note(self, key: tuple[str, int], state: str) -> None:
        """A slot's new state: reported exits and restarts are indexed."""
        if state in REPORTED:
            self.reported.add(key)
        else:
            self.reported.discard(key)

    def forget(self, node_id: str, slots) -> None:
        for slot in slots:
            self.reported.discard((node_id, slot))
        for key in [k for k in self.failed_pids if k[0] == node_id]:
            del self.failed_pids[key]
        for book in (self.last_errors, self.at_start):
            for key in [k for k in book if k[0] == node_id]:
                del book[key]
        self.own_faults.pop(node_id, None)

    def repeated(self, node_id: str, local_rank: int, pid: int, digest: str, step: int) -> bool:
        """A process of the slot died of the error of `digest` (`error_digest`) in `step`: did the slot's
        previous process die the same way (the same error at the same step)? Then its restart met the
        same fault: one that repeats (a script's bug at step N, a model sharded after register(), a
        full disk), not one a process restarted elsewhere outlives. An exit with no error known (a
        signal) breaks a streak; the same process reported again (to a new leader) is not a repeat."""
        key = (node_id, local_rank)
        before = self.last_errors.get(key)
        if not digest:
            self.last_errors.pop(key, None)
            return False
        self.last_errors[key] = (digest, step, pid)
        return before is not None and before[:2] == (digest, step) and before[2] != pid

    def all_at_start(self, node_id: str, local_rank: int, error: str, step: int, rm: RankMap | None,
                     started: bool) -> tuple[int, int] | None:
        """A process of the slot died of `error` (or of a signal: "") in `step`: before the job's first
        step (`step` <= 1, the library's tag for its first; no rank past it, `started` False), did
        every rank of the map they started in (the map at the first such failure) die of the same
        error? Then a restart meets it again: (that map's generation, its ranks); else None."""
        key = (node_id, local_rank)
        if started or step > 1:  # past the job's start: a failure now is no start's
            self.at_start.clear()
            return None
        if not error:  # a signal (a kill from outside) is no fault of the script's
            self.at_start.pop(key, None)
            return None
        if not self.at_start:
            self.cohort = (rm.generation, frozenset((p.node_id, s) for p in rm.placements for s in p.slots)) \
                if rm else (0, frozenset())
        self.at_start[key] = error
        generation, slots = self.cohort
        if slots and all(self.at_start.get(k) == error for k in slots):
            return generation, len(slots)
        return None

    def node_fault(self, node_id: str, at_ms: int, others: Iterable[str]) -> int:
        """A rank of the node failed of its own fault at `at_ms` (wall): how often its ranks did within
        the window, or 0 while a node of `others` had such a failure within it too (the job's fault)."""
        window_ms = HOLD_OUT_WINDOW_S * 1000
        recent = [t for t in self.own_faults.get(node_id, ()) if at_ms - t < window_ms] + [at_ms]
        self.own_faults[node_id] = recent
        if any(at_ms - t < window_ms for n in others if n != node_id for t in self.own_faults.get(n, ())):
            return 0
        return len(recent)

    def faults_before(self, node_id: str, faults_ms: Iterable[int]) -> None:
        """A member's own faults as the job's state kept them (`Member.faults_ms`): a new leader's count
        goes on from them, as the last one's would have."""
        if faults_ms:
            self.own_faults[node_id] = list(faults_ms)

    def errors_before(self, node_id: str, last_errors: Iterable[tuple[int, str, int, int]]) -> None:
        """A member's slots' last failures as the job's state kept them (`Member.last_errors`): a new
        leader knows a repeat as the last one would have."""
        for slot, digest, step, pid in last_errors:
            self.last_errors[(node_id, slot)] = (digest, step, pid)

    def mark_failed(self, node_id: str, local_rank: int, pid: int) -> None:
        """The slot's process failed; a different pid in that slot later means it came back."""
        self.failed_pids[(node_id, local_rank)] = pid or -1

    def awaiting(self, node_id: str, slots: Iterable[int]) -> None:
        """Slots with no process yet (a node starting its ranks): any process there is their recovery."""
        for slot in slots:
            self.mark_failed(node_id, slot, -1)

    def came_back(self, node_id: str, r: RankReport) -> bool:
        """Whether `r` is a new process in a failed slot (then no longer failed)."""
        failed_pid = self.failed_pids.get((node_id, r.local_rank))
        if failed_pid is not None and r.pid and r.pid != failed_pid and r.state != "exited":
            del self.failed_pids[(node_id, r.local_rank)]
            return True
        return False

    def in_map(self, rm: RankMap | None, nodes: dict[str, NodeLive]) -> list[Failure]:
        """Slots of the map whose rank a node reports as exited, or as restarting in place in the
        current generation: an exit report that went to a previous leader is not lost. Acted on
        even during the grace, like any exit; the pid of an exited rank is remembered so that a new
        process in the slot counts as its recovery. A restarting slot keeps its place: the job
        re-forms once with its replacement. O(slots reporting so), in the order of the map."""
        if rm is None or not self.reported:
            return []
        found = []
        for p, slot, r in placed(self.reported, rm, nodes):
            if r.state == "exited":
                self.mark_failed(p.node_id, slot, r.pid)
                found.append((p.node_rank, slot, Failure(FailureKind.RANK_EXITED, p.node_id, slot,
                                                         f"reported exited (pid {r.pid})")))
            elif r.generation == rm.generation:
                found.append((p.node_rank, slot, Failure(FailureKind.RANK_RESTARTED, p.node_id, slot,
                                                         f"local rank {slot} (pid {r.pid}) is restarting in place")))
        return [f for _, _, f in sorted(found, key=lambda x: x[:2])]
