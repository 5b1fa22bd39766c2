"""The Joins (and rebuilt Sessions) waiting on a new job's election: a new job's election takes a
moment, so a caller waits for it rather than being bounced. A waiter is woken when this replica
leads the job (`won`) or the job's candidates change in etcd (another replica won); the waiters of
one job share one etcd watch, made by the first and cancelled by the last.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Container

from muster.coordinator.coordination import Coordination
from muster.coordinator.errors import NotLeader, StoreUnavailable

# A waiter re-reads etcd this often without an event (a watch lost with etcd's stream says so,
# but one never made, with etcd unreachable, does not).
ELECTION_RECHECK_S = 0.5


class ElectionWaits:
    def __init__(self, coordination: Coordination, led: Container[str],
                 leader_address: Callable[[str], Awaitable[str]], wait_s: float):
        """`led`: the jobs this replica leads; `leader_address`: another replica's that etcd names as
        a job's leader, or ""; `wait_s`: how long a caller waits at most."""
        self.coordination = coordination
        self._led = led
        self._leader_address = leader_address
        self.wait_s = wait_s
        self._electing: dict[str, set[asyncio.Event]] = {}  # job -> its waiters
        self._watches: dict[str, Callable[[], None]] = {}  # job -> cancel() of their shared watch

    def won(self, job: str) -> None:
        """This replica leads `job` now: its waiters go on."""
        for waiter in self._electing.get(job, ()):
            waiter.set()

    async def wait(self, job: str) -> None:
        """Until this replica leads `job` or `wait_s` passed; raises NotLeader naming the replica
        etcd elected instead."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_s
        changed = asyncio.Event()
        waiters = self._electing.setdefault(job, set())
        waiters.add(changed)
        try:
            if len(waiters) == 1:
                await self._watch(job, waiters, loop)
            while job not in self._led and (left := deadline - loop.time()) > 0:
                changed.clear()
                address = await self._leader_address(job)
                if address:
                    raise NotLeader(job, address)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), min(left, ELECTION_RECHECK_S))
        finally:
            waiters.discard(changed)
            if not waiters and self._electing.get(job) is waiters:
                del self._electing[job]
                cancel = self._watches.pop(job, None)
                if cancel is not None:
                    await asyncio.to_thread(cancel)

    async def _watch(self, job: str, waiters: set[asyncio.Event], loop: asyncio.AbstractEventLoop) -> None:
        """The watch that wakes `waiters` (those waiting on `job`'s election), kept while any waits."""
        def wake() -> None:
            for waiter in list(waiters):
                waiter.set()
        try:
            cancel = await asyncio.to_thread(self.coordination.watch_elections, job,
                                             lambda: loop.call_soon_threadsafe(wake))
        except StoreUnavailable:
            return  # etcd unreachable: the election cannot end either; the waiters re-read at ELECTION_RECHECK_S
        if self._electing.get(job) is waiters:
            self._watches[job] = cancel
        else:  # every waiter left meanwhile
            await asyncio.to_thread(cancel)
