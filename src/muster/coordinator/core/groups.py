"""The current generation watched as a whole: whether its group formed and holds (`GroupWatch`),
and whether its ranks' parameters agree (`DigestTally`). Both keep small indexes that frames
update, so that a tally looks at the whole map only when one of them says it must.
"""

from __future__ import annotations

from collections import Counter

from muster.coordinator.core.kinds import FailureKind
from muster.coordinator.core.live_records import NO_PROGRESS, Divergence, Failure, NodeLive, placed
from muster.coordinator.core.policy import Timing
from muster.coordinator.core.state import RankMap

SCANNED_PER_TALLY = 1024  # nodes of the map one tally looks at when a generation may not have formed


class GroupWatch:
    """Ranks holding in the current generation for the heartbeat timeout (a collective failed;
    had a node died, silence would have found it by now) break the group. Past the form timeout,
    ranks of the map that never reached it are to blame (the waiting are not); when every rank
    arrived and it still did not form, it is decided again. Holding ranks come from an index; the
    whole map is looked at only past the form timeout, until it is found formed (then again once
    per form timeout), SCANNED_PER_TALLY nodes a tally."""

    def __init__(self, timing: Timing):
        self.timing = timing
        self.holding: set[tuple[str, int]] = set()  # slots reporting holding
        self._formed: tuple[int, float] = (0, 0.0)  # a generation found formed, and when to look again
        self._scan: tuple = (0, 0, False, [], [])  # a look at the whole map under way: (generation, next
        #                                            placement, any starting, waiting, missing so far)

    def note(self, key: tuple[str, int], state: str) -> None:
        """A slot's new state: holding ones are indexed."""
        if state == "holding":
            self.holding.add(key)
        else:
            self.holding.discard(key)

    def failures(self, rm: RankMap, nodes: dict[str, NodeLive], published: tuple[int, float],
                 now: float) -> list[Failure]:
        """Of the generation of `rm`, published (due) as `published` says: (generation, since)."""
        return self._broken(rm, nodes, now) or self._not_formed(rm, nodes, published, now)

    def _broken(self, rm: RankMap, nodes: dict[str, NodeLive], now: float) -> list[Failure]:
        holding = [p.rank_of(slot) for p, slot, r in placed(self.holding, rm, nodes)
                   if r.generation == rm.generation and r.phase_since is not None
                   and now - r.phase_since > self.timing.heartbeat_timeout_s]
        if not holding:
            return []
        return [Failure(FailureKind.GROUP_BROKEN, "", None, f"ranks {_few(sorted(holding))} of generation "
                        f"{rm.generation} hold after a failed collective and nobody was found failed")]

    def _not_formed(self, rm: RankMap, nodes: dict[str, NodeLive], published: tuple[int, float],
                    now: float) -> list[Failure]:
        t = self.timing
        generation, since = published
        if generation != rm.generation or now - since <= t.form_timeout_s:
            return []
        formed, look_again_at = self._formed
        if formed == rm.generation and now < look_again_at:
            return []
        end, starting, waiting, missing = self._look(rm, nodes)
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

    def _look(self, rm: RankMap, nodes: dict[str, NodeLive]) -> tuple:
        """The next SCANNED_PER_TALLY placements of the look under way (a new one for a new map or
        once it reached the end): (where it ended, any starting, waiting, missing so far)."""
        generation, start, starting, waiting, missing = self._scan
        if generation != rm.generation or start >= len(rm.placements):
            start, starting, waiting, missing = 0, False, [], []
        end = start + SCANNED_PER_TALLY
        for p in rm.placements[start:end]:
            node = nodes.get(p.node_id)
            for slot in p.slots:
                r = node.ranks.get(slot) if node else None
                if r is None or r.state in NO_PROGRESS:
                    continue  # no report yet (silence covers it), no library, or found by the exits
                if r.state == "starting" and r.generation == 0:
                    starting = True  # in no group yet: the start-up timeout judges it, and the others wait
                    continue
                if r.generation >= rm.generation and r.state in ("running", "long_phase", "starting"):
                    continue  # formed (starting: no step completed yet in this process)
                if r.generation == rm.generation and r.state == "forming" and r.phase:
                    continue  # formed, moving the state: its transfer has a bound of its own, by size and rate
                if r.generation == rm.generation and r.state in ("forming", "holding"):
                    waiting.append((p, slot))
                elif r.state in ("running", "long_phase") and not rm.abort_previous:
                    continue  # a planned switch ahead: it switches at its step (a stall is found by the judge)
                else:
                    missing.append((p, slot, r))
        self._scan = (rm.generation, end, starting, waiting, missing)
        return end, starting, waiting, missing


class DigestTally:
    """Parameter digests by step, so that the map is compared only when a new digest made some
    step's count reach the world size. Each step is judged once; the same odd ranks are flagged
    once until the set changes."""

    def __init__(self) -> None:
        self.checked_step = 0
        self.diverged_ranks: tuple[int, ...] = ()  # the last ranks flagged: not flagged again while unchanged
        self._counts: Counter[int] = Counter()  # digest step -> slots whose latest digest is of it
        self._new = False  # a digest arrived since `divergence` last looked

    def count(self, step: int, by: int) -> None:
        if step:
            self._counts[step] += by
            if self._counts[step] <= 0:
                del self._counts[step]

    def moved(self, old_step: int, new_step: int) -> None:
        """A slot's latest digest is now of `new_step` (it was of `old_step`: 0 for none)."""
        self.count(old_step, -1)
        self.count(new_step, 1)
        self._new = True

    def divergence(self, rm: RankMap | None, nodes: dict[str, NodeLive]) -> Divergence | None:
        """Once every rank of the map has sent a digest of the same step, compare them."""
        if rm is None or rm.world_size < 2 or not self._new:
            return None
        self._new = False
        if not any(step > self.checked_step and count >= rm.world_size for step, count in self._counts.items()):
            return None
        seen: list[tuple[int, str, int, bytes]] = []
        for p in rm.placements:
            node = nodes.get(p.node_id)
            for slot in p.slots:
                r = node.ranks.get(slot) if node else None
                if r is None or not r.digest_step:
                    return None
                seen.append((p.rank_of(slot), p.node_id, r.digest_step, r.digest))
        steps = {step for _, _, step, _ in seen}
        step = steps.pop()
        if steps or step <= self.checked_step:
            return None
        self.checked_step = step
        return self._odd(step, seen)

    def _odd(self, step: int, seen: list[tuple[int, str, int, bytes]]) -> Divergence | None:
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
