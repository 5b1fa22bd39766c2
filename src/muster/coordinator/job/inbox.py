"""What waits for a leader's next tally: membership events, each with the future of the request
that asked for it (None where nobody waits). Requests and frames put; the tally takes them all,
and its decision settles each request by its ticket."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from muster.coordinator.core.machine import Decision, Join, Leave, MembershipEvent, Rejoin, Request, Stop
from muster.coordinator.errors import MusterError

Queued = tuple[MembershipEvent, asyncio.Future | None]


class Inbox:
    def __init__(self):
        self._queued: list[Queued] = []
        self._wake = asyncio.Event()
        self._tickets = 0  # the last ticket given: a request's number, unique for this leader

    def put(self, event: MembershipEvent) -> None:
        """Queue `event`, which nobody waits on, and wake the tally."""
        self._queued.append((event, None))
        self._wake.set()

    def ask(self, request: Request) -> asyncio.Future:
        """Queue `request` under a new ticket and wake the tally; the future its decision settles."""
        self._tickets += 1
        fut = asyncio.get_running_loop().create_future()
        self._queued.append((replace(request, ticket=self._tickets), fut))
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
    """Answer each request of `batch` from the decision adopted: its refusal (by its ticket,
    wherever its event stood among those decided), or its result."""
    for event, fut in batch:
        if fut is None or fut.done():
            continue  # a request's event is a `Request`, with the ticket `ask` gave it
        if event.ticket in d.rejected:
            fut.set_exception(d.rejected[event.ticket])
        elif isinstance(event, (Join, Rejoin)):
            fut.set_result(d.state.member(event.node_id))
        elif isinstance(event, Leave):
            rm = d.state.rank_map
            fut.set_result((d.state.generation, rm.switch_at_step if rm and not event.immediate else 0))
        elif isinstance(event, Stop):
            fut.set_result(max((step for node, step in d.drains), default=0))
