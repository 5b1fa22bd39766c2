"""The per-node silence clock: a timing wheel of nodes by the slot of their last frame.

A frame moves its node to the current slot, so a slot older than the heartbeat timeout holds only
silent nodes: a tally finds silence in O(silent nodes), not O(nodes). A node's slot is kept on the
node (`NodeLive.heard_slot`), not in a second dict.
"""

from __future__ import annotations

from muster.coordinator.core.kinds import FailureKind
from muster.coordinator.core.live_records import Failure, NodeLive
from muster.coordinator.core.state import JobState


class SilenceWheel:
    def __init__(self, heartbeat_timeout_s: float):
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._slot_s = heartbeat_timeout_s / 8
        self._slots: dict[int, set[str]] = {}  # wheel slot (of the last frame) -> nodes

    def heard(self, node_id: str, node: NodeLive, now: float, vouched: bool = False) -> None:
        """A frame of the node now; `vouched` (relayed): its relay judges its silence, not the wheel."""
        node.last_frame_at = now
        if vouched:
            self.drop(node_id, node)
            return
        slot = int(now / self._slot_s)
        if slot != node.heard_slot:
            self.drop(node_id, node)
            self._slots.setdefault(slot, set()).add(node_id)
            node.heard_slot = slot

    def drop(self, node_id: str, node: NodeLive) -> None:
        if node.heard_slot in self._slots:
            self._slots[node.heard_slot].discard(node_id)
        node.heard_slot = -1

    def silent(self, nodes: dict[str, NodeLive], state: JobState, now: float) -> list[tuple[int, int, Failure]]:
        """Members with no frame for the heartbeat timeout: the slots at or past it (emptied ones
        are dropped as found), keyed for the order of the map."""
        edge = now - self.heartbeat_timeout_s
        found = []
        for slot in [k for k in self._slots if k * self._slot_s <= edge]:
            in_slot = self._slots[slot]
            if not in_slot:
                del self._slots[slot]
                continue
            for node_id in in_slot:
                node, member = nodes[node_id], state.member(node_id)
                if member is not None and node.last_frame_at < edge:
                    found.append((member.seq, 0, Failure(FailureKind.NODE_SILENT, node_id, None,
                                                         f"no frame for {now - node.last_frame_at:.2f}s",
                                                         node.last_frame_at)))
        return found
