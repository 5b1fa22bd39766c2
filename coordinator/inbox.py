"""What waits for a leader's next tally: membership events, each with the future of the request
that asked for it (None where nobody waits). Requests and frames put; the tally takes them all,
and its decision settles each request."""

from __future__ import annotations

import asyncio

from muster.coordinator.core.machine import Decision, Join, Leave, MembershipEvent, Rejoin, Stop
from muster.coordinator.errors import MusterError

Queued = tuple[MembershipEvent, asyncio.Future | None]


class Inbox:
    def __init__(self):
        self._queued: list[Queued] = []
        self._wake = asyncio.Event()

    def put(self, event: MembershipEvent, want_result: bool = False) -> asyncio.Future | None:
        """Queue `event` and wake the tally; with `want_result`, the future its decision settles."""
        fut = asyncio.get_running_loop().create_future() if want_result else None
        self._queued.append((event, fut))
        self._wake.set()
        return fut

    def add(self, events) -> None:
        """Events for the next tally without waking it (the caller runs that tally)."""
        self._queued.extend((event, None) for event in events)

    async def wait(self, timeout_s: float) -> None:
        """Until something was put, or `timeout_s` passed."""
        try:
            await asyncio.wait_for(self._wake.wait(), timeout_s)
        except TimeoutError:
            pass
        self._wake.clear()

    def take(self) -> list[Queued]:
        batch, self._queued = self._queued, []
        return batch

    def defer(self, batch: list[Queued]) -> None:
        """Taken but not decided: first in the next tally."""
        self._queued[:0] = batch

    def refuse_all(self, error: MusterError) -> None:
        for _, fut in self._queued:
            if fut and not fut.done():
                fut.set_exception(error)
        self._queued.clear()


def settle(batch: list[Queued], d: Decision) -> None:
    """Answer each request of `batch` from the decision adopted: its refusal, or its result."""
    rejected = dict(d.rejected)
    for index, (event, fut) in enumerate(batch):
        if fut is None or fut.done():
            continue
        if index in rejected:
            fut.set_exception(rejected[index])
        elif isinstance(event, (Join, Rejoin)):
            fut.set_result(d.state.member(event.node_id))
        elif isinstance(event, Leave):
            rm = d.state.rank_map
            fut.set_result((d.state.generation, rm.switch_at_step if rm and not event.immediate else 0))
        elif isinstance(event, Stop):
            fut.set_result(max((step for node, step in d.drains), default=0))
