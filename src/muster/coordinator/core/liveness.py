"""Liveness bookkeeping: what each node and rank last reported, and who has failed.

Three signals: a process exit (reported by the node, acted on at once elsewhere), silence
(no frame for heartbeat_timeout) and a stall (frames arrive but the step does not advance
for the progress timeout, calibrated from observed step times, suspended in declared long
phases). A generation is also watched as a whole: ranks that hold after a failed collective
with nobody found failed, or a map that does not form within the form timeout, are decided
again. Mutable for the hot path, but no clock reads and no I/O: `now` is an argument.

A tally costs O(what changed), not O(ranks): silence is found in a timing wheel (`silence.py`);
a node's ranks are judged when their earliest deadline can have passed (a heap, `stalls.py`: a
frame only updates fields, the deadline is found again when judged); exits, holds and digests
are kept in small indexes as frames report them (`exits.py`, `groups.py`). `Liveness` feeds
them frames and asks them at a tally. A leader's tally crosses into it twice: `assess`, one
snapshot of what it found for the decision (`assessment.py`), and `apply`, what the decision
adopted changes (whom to watch, the generation published).
"""

from __future__ import annotations

import math
import zlib
from collections import deque
from collections.abc import Sequence

from muster.coordinator.core.assessment import Assessment, RecoveryWatch, max_steps, median, reforming
from muster.coordinator.core.exits import ExitBook
from muster.coordinator.core.groups import DigestTally, GroupWatch
from muster.coordinator.core.live_records import (
    UNMONITORED, WAITING, Divergence, Failure, NodeLive, RankLive, RankReport, Recovery, Vouch)
from muster.coordinator.core.machine import Decision
from muster.coordinator.core.policy import Timing
from muster.coordinator.core.silence import SilenceWheel
from muster.coordinator.core.stalls import Deadlines, calibrated_timeout, judge_ranks
from muster.coordinator.core.state import JobState

__all__ = ["Divergence", "Failure", "Liveness", "RankReport", "Recovery", "Vouch"]  # the records callers import from here

JUDGED_PER_TALLY = 256  # nodes whose ranks one tally judges at most (a few ms)
TAKEOVER_UNHEARD_TIMEOUTS = 4  # the grace goes on this many heartbeat timeouts while no node reaches a new leader


class Liveness:
    def __init__(self, timing: Timing, now: float):
        self.timing = timing
        self.nodes: dict[str, NodeLive] = {}
        self.step_times: deque[float] = deque(maxlen=256)
        self.grace_until = now
        self.unheard_since_takeover = False  # a takeover no node's frame has reached yet
        self.opened_at = now  # a takeover's first frame: the path to this leader works from then
        self.held_until = now  # the leader itself paused (`after_a_pause`): until then only exits act
        self._unattached: set[str] = set()  # members taken over that have sent this leader no frame yet
        self.published: tuple[int, float] = (0, now)  # the current map's generation, and since when it is due
        # Indexes kept by `observe`, so that a tally looks only at what changed:
        self._wheel = SilenceWheel(timing.heartbeat_timeout_s)
        self._deadlines = Deadlines()
        self.exits = ExitBook()  # the ranks' exits and faults, asked by the frame reader as it reads them
        self._group = GroupWatch(timing)
        self._digests = DigestTally()
        self._recoveries = RecoveryWatch()

    def start_grace(self, node_ids, now: float) -> None:
        """A new leader: its members get time to reconnect before silence or a stall counts (`in_grace`)."""
        self.grace_until = now + self.timing.grace_s
        self.unheard_since_takeover = True
        self._unattached = set(node_ids)
        floor = self.timing.progress_timeout_s or self.timing.progress_floor_s
        for node_id in self._unattached:
            node = self._node(node_id, now)
            self._wheel.heard(node_id, node, now)
            self._deadlines.arm(node_id, self.grace_until + node.early * floor)  # spread: not every node in one tally

    def _first_frame_since_takeover(self, now: float) -> None:
        """The path to this leader works again: the silence of the members not attached yet counts
        from now (the others come the same way, moments later), not from the takeover, so none is
        judged before a heartbeat timeout after the first frame. (Counted from the takeover, a first
        frame just inside the grace left the others nothing: a soak's successor judged two healthy
        nodes silent 50 ms after the first one reached it.)"""
        self.unheard_since_takeover = False
        self.opened_at = now
        for node_id in self._unattached:
            self._wheel.heard(node_id, self.nodes[node_id], now)

    def after_a_pause(self, now: float) -> None:
        """The leader itself did not run for a while (its process stopped, its host starved): the
        nodes' frames of that time wait unread, so no silence or stall counts for a heartbeat timeout
        from now, and only exits act meanwhile. A node silent for that long after is judged as ever.
        (A fresh-clone run's coordinator, starved 11.6 s, woke to judge both nodes of a healthy job
        silent: its run ended 'every node was lost'.)"""
        self.held_until = max(self.held_until, now + self.timing.heartbeat_timeout_s)

    def in_grace(self, now: float) -> bool:
        """The takeover grace: only exits act while members may still be on their way to this leader.
        It ends once every member has attached (waiting longer hears nobody new: after an outage
        that took a node, its loss was held for the whole grace), else a heartbeat timeout after the
        first frame, or at grace_s if sooner: a member not attached by then is judged silent. A
        healthy one is there before: the nodes, and the relays carrying them, retry at most an eighth
        of the heartbeat timeout apart (jittered to a quarter), and those on a frozen predecessor find
        it silent within 1.5 timeouts of its last pulse (`NodeSession._watch`): with the defaults
        (timeout 2 s, lease TTL 3 s) half a timeout after its successor leads at the latest, which
        is 2/3 of the TTL after the freeze at the earliest.
        Prolonged past grace_s, by up to TAKEOVER_UNHEARD_TIMEOUTS heartbeat timeouts, while no node
        at all has reached this leader: every node silent at once after a takeover is the path to
        the new leader (a relay, or nodes still trying a frozen predecessor), not every node dead (a
        run ended 'every node was lost' so in a soak)."""
        if not self._unattached:
            return False
        if self.unheard_since_takeover:
            return now < self.grace_until + TAKEOVER_UNHEARD_TIMEOUTS * self.timing.heartbeat_timeout_s
        return now < min(self.grace_until, self.opened_at + self.timing.heartbeat_timeout_s)

    def track(self, node_id: str, now: float) -> None:
        if node_id not in self.nodes:
            self._wheel.heard(node_id, self._node(node_id, now), now)
            self._deadlines.arm(node_id, now)

    def forget(self, node_id: str) -> None:
        self._unattached.discard(node_id)
        node = self.nodes.pop(node_id, None)
        self._deadlines.disarm(node_id)
        if node is not None:
            self._wheel.drop(node_id, node)
        for slot, live in node.ranks.items() if node else ():
            self._group.holding.discard((node_id, slot))
            self._digests.count(live.digest_step, -1)
        self.exits.forget(node_id, node.ranks if node else ())

    def _node(self, node_id: str, now: float) -> NodeLive:
        node = self.nodes.get(node_id)
        if node is None:
            node = self.nodes[node_id] = NodeLive(now, early=zlib.crc32(node_id.encode()) / 2**33)
        return node

    def unvouched(self, node_id: str, now: float) -> None:
        """The relay that vouched for `node_id` is gone, or the node's stream there ended (lost by
        its carrier, not by the node): its silence is judged here, counting from now, so that it has
        the heartbeat timeout to reconnect elsewhere."""
        node = self.nodes.get(node_id)
        if node is not None:
            self._wheel.heard(node_id, node, now)
            if node.vouch is not None:  # nor its progress: judged from its own frames, from now on
                node.vouch, node.lagging = None, False
                self._deadlines.arm(node_id, now)

    def silent_since(self, node_id: str, since: float) -> None:
        """Its relay heard nothing from `node_id` since `since`: judged here as if its last frame
        came then (found silent at the next tally past the heartbeat timeout)."""
        node = self.nodes.get(node_id)
        if node is not None:
            self._wheel.heard(node_id, node, min(since, node.last_frame_at))

    def observe(self, node_id: str, generation: int, reports: list[RankReport], now: float, *,
                vouched: bool = False, vouch: Vouch | None = None) -> list[int]:
        """Record a frame. Returns the local ranks that came back (a new process in a failed slot).
        `vouched`: it came through a relay, which judges the node's silence and forwards frames
        that only advance steps now and then: the node leaves the wheel until `unvouched` or
        `silent_since`. `vouch`: the relay's summaries, which stand for its progress (`summarised`)."""
        if self._unattached:
            if self.unheard_since_takeover:
                self._first_frame_since_takeover(now)
            self._unattached.discard(node_id)
        node = self.nodes.get(node_id)
        if node is None:
            node = self._node(node_id, now)
            self._deadlines.arm(node_id, now)
        self._wheel.heard(node_id, node, now, vouched)
        self._vouched_by(node, vouch if vouched else None)
        node.generation, node.heard = generation, True
        recovered = []
        lost_ms = self.timing.heartbeat_timeout_s * 1000
        exits, failed_pids = self.exits, self.exits.failed_pids
        top_step = 0
        for r in reports:
            if r.state not in UNMONITORED:  # a script's steps (its probe's) restart with its process: not the job's
                top_step = max(top_step, r.step)
            live = node.ranks.get(r.local_rank)
            if live is None:
                live = node.ranks[r.local_rank] = RankLive(progress_at=now)
                self._deadlines.arm(node_id, now)
            if r.step != live.step or r.pid != live.pid:
                if r.step > live.step and r.pid == live.pid and r.step_time_s > 0:
                    self.step_times.append(r.step_time_s)
                live.progress_at = now
            if r.state != live.state:
                # Entering or leaving a phase is progress: a rank back from a long reform is not stalled.
                live.progress_at = now
                live.phase_since = now if r.state in WAITING else None
                exits.note((node_id, r.local_rank), r.state)
                self._group.note((node_id, r.local_rank), r.state)
                self._deadlines.arm(node_id, now)  # a new state: its deadlines are found at the next tally
            live.pid, live.step, live.step_time_s, live.generation = r.pid, r.step, r.step_time_s, r.generation
            live.compute_s, live.restarts = r.compute_s, r.restarts
            live.snapshot_every, live.snapshot_bytes = r.snapshot_every, r.snapshot_bytes
            live.steps_unmeasured = r.steps_unmeasured
            live.state, live.phase, live.heard_ms_ago = r.state, r.phase, r.heard_ms_ago
            if r.heard_ms_ago > lost_ms:
                self._deadlines.arm(node_id, now)  # its agent lost it: judged at the next tally
            if r.digest_step and (r.digest_step, r.digest) != (live.digest_step, live.digest):
                self._digests.moved(live.digest_step, r.digest_step)
                live.digest_step, live.digest = r.digest_step, r.digest
            if failed_pids and exits.came_back(node_id, r):
                recovered.append(r.local_rank)
        if reports:
            node.top_step = top_step
        return recovered

    def advance(self, node_id: str, generation: int, local_ranks: Sequence[int],
                steps: Sequence[tuple[int, int, int, int]], now: float, *, vouched: bool = False,
                vouch: Vouch | None = None) -> bool:
        """Record a frame that only advances steps (`NodeFrame.steps_only`): `steps` holds
        (step, step_time_us, heard_ms_ago, compute_us) for each rank of `local_ranks`, whose other
        fields are as last observed. The hot path: four numbers a rank. False, recording nothing, when these are
        not the node's ranks (the frame is then read in full)."""
        node = self.nodes.get(node_id)
        if node is None or node.generation != generation:
            return False
        ranks = node.ranks
        lives = [ranks.get(lr) for lr in local_ranks]
        if None in lives:
            return False
        self._wheel.heard(node_id, node, now, vouched)
        self._vouched_by(node, vouch if vouched else None)
        lost_ms = self.timing.heartbeat_timeout_s * 1000
        top_step = 0
        for live, (step, step_time_us, heard_ms_ago, compute_us) in zip(lives, steps):
            if live.state not in UNMONITORED:
                top_step = max(top_step, step)
            if step != live.step:
                if step > live.step and step_time_us:
                    self.step_times.append(step_time_us / 1e6)
                live.progress_at = now
                live.step, live.step_time_s = step, step_time_us / 1e6
            live.heard_ms_ago, live.compute_s = heard_ms_ago, compute_us / 1e6
            if heard_ms_ago > lost_ms:
                self._deadlines.arm(node_id, now)  # its agent lost it: judged at the next tally
        if steps:
            node.top_step = top_step
        return True

    @staticmethod
    def _vouched_by(node: NodeLive, vouch: Vouch | None) -> None:
        if node.vouch is not vouch:  # another relay (or none): what the last one said of it is void
            node.vouch, node.lagging = vouch, False

    def lagging(self, node_id: str, step: int, since: float) -> None:
        """Its relay names the node lagging: its ranks at `step` or below have not advanced since
        `since` (its latest frame, read just before, holds their steps). Its progress is judged from
        its ranks again, at the next tally."""
        node = self.nodes.get(node_id)
        if node is None or node.vouch is None:
            return
        node.lagging = True
        for live in node.ranks.values():
            if live.step <= step and live.state not in UNMONITORED:
                live.progress_at = since
        self._deadlines.arm(node_id, since)

    def resumed(self, node_id: str) -> None:
        """Its relay names the node progressing again: its summaries stand for it again."""
        node = self.nodes.get(node_id)
        if node is not None:
            node.lagging = False

    def all_at_start(self, node_id: str, local_rank: int, error: str, step: int,
                     state: JobState) -> tuple[int, int] | None:
        """Every rank of the map the job started in died of this error before its first step
        (`ExitBook.all_at_start`): that map's (generation, ranks), else None. O(nodes) while the
        job is at its start, to see whether a rank stepped past it."""
        started = bool(self.exits.at_start) and self.max_step(state) > 1
        return self.exits.all_at_start(node_id, local_rank, error, step, state.rank_map, started)

    def generation_published(self, generation: int, now: float) -> None:
        """A new map (or a new leader's first view of the current one): reforming is not a stall
        (every rank's progress counts from now), and the form timeout counts from now."""
        self.published = (generation, now)

    def progress_timeout(self) -> float:
        return calibrated_timeout(self.timing, self.step_times)

    def median_step_time(self) -> float | None:
        return median(self.step_times)

    def max_step(self, state: JobState, now: float | None = None, step_time_s: float | None = None) -> int:
        """The highest step a node of the map reported last (O(nodes), at a decision only). With
        `now` and the median step time: the step its ranks are likely at by now, each node's report
        advanced by its frame's age over the step time (a frame is up to 1.5 heartbeat intervals old
        at a tally), so that a planned switch's lead has only the map's delivery to cover."""
        return max_steps(self.nodes, state, self.timing.heartbeat_timeout_s, now, step_time_s)[0]

    def failures(self, state: JobState, now: float) -> list[Failure]:
        """Exited ranks of the map; silence and stalls among the members, except during the grace or
        a hold after the leader's own pause. A failure is found at every tally until a decision removes it."""
        exited = self.exits.in_map(state.rank_map, self.nodes)
        if self.in_grace(now) or now < self.held_until:
            return exited
        found = self._wheel.silent(self.nodes, state, now) + self._stalled(state, now)
        failures = exited + [f for _, _, f in sorted(found, key=lambda x: x[:2])]
        if not failures and state.rank_map is not None:
            failures = self._group.failures(state.rank_map, self.nodes, self.published, now)
        return failures

    def _stalled(self, state: JobState, now: float) -> list[tuple[int, int, Failure]]:
        """The ranks of nodes due: at most JUDGED_PER_TALLY nodes (and POPPED_PER_TALLY entries) a
        tally; deadlines that bunch, such as every node's first after a takeover, spread over the
        next tallies."""
        found, judged = [], []
        stall_after = self.progress_timeout()
        for node_id in self._deadlines.due(now):
            node, member = self.nodes.get(node_id), state.member(node_id)
            if node is None or member is None:
                continue  # armed again when it joins or reports
            vouch = node.vouch
            vouched_at = vouch.at if vouch is not None and not node.lagging else -math.inf
            failed, next_at = judge_ranks(self.timing, member, node, state.rank_map,
                                          max(self.published[1], vouched_at), stall_after, now)
            found.extend((member.seq, f.local_rank, f) for f in failed)
            if vouched_at == -math.inf or failed:
                judged.append((node_id, now if failed else next_at))
            # else its relay's summaries stand for its progress: judged again once it lags (`lagging`)
            if len(judged) == JUDGED_PER_TALLY:
                break
        for node_id, at in judged:
            self._deadlines.arm(node_id, at)
        return found

    def divergence(self, state: JobState) -> Divergence | None:
        """Once every rank of the map has sent a parameter digest of the same step, compare them
        (`DigestTally`: each step once, the same odd ranks flagged once)."""
        return self._digests.divergence(state.rank_map, self.nodes)

    def assess(self, state: JobState, now: float, *, slots_back: bool = False,
               recovering: Recovery | None = None) -> Assessment:
        """What liveness finds at a tally, the one snapshot its decision reads (`Assessment`).
        `slots_back`: slots came back, so ask whether the map still re-forms (O(ranks): only then);
        `recovering`: the recovery under way, whose end is looked for."""
        recovered = self._recoveries.look(self.nodes, state, recovering, now) if recovering else None
        return Assessment(state, now, recovered=recovered, grace_over=not self.in_grace(now),
                          reforming=slots_back and reforming(self.nodes, state), failures=self.failures(state, now),
                          diverged=self.divergence(state), nodes=self.nodes, step_times=self.step_times,
                          cap_s=self.timing.heartbeat_timeout_s)

    def apply(self, d: Decision, now: float) -> None:
        """What liveness learns of an adopted decision: whom to watch from now on, and its generation."""
        for node_id, _ in d.evicted:  # first: a proven claim displaces its node id's other member
            self.forget(node_id)
        for member in d.joined:
            self.track(member.node_id, now)
            self.exits.awaiting(member.node_id, member.down_slots)
        if d.new_generation:
            self.generation_published(d.state.generation, now)
