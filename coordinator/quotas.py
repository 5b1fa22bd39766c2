"""What one tenant may hold of a replica (a job's token; without tokens, a peer host): streams that
have not said who they are, Relay calls, Joins, and frames per stream. Past a quota a call gets
RESOURCE_EXHAUSTED (UNAVAILABLE for idle streams, retried with backoff) naming it. Refusals are
logged as counted lines: a flood writes a line a second, not a line a message."""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import TypeVar

import structlog

from muster.coordinator import errors

log = structlog.get_logger(__name__)

M = TypeVar("M")  # a stream's message


class FrameBudget:
    """A token bucket: `rate` a second sustained, bursts of 2 s worth (at least 10), and at least
    `floor`. A Session stream spends a frame each, a Relay stream its frames on one bucket scaled by
    the node streams it carries (a message of first frames, to attach them: its floor); a job's
    Joins spend one each (its floor: the job's members quota, so a whole job starts at once)."""

    def __init__(self, rate: float, clock=time.monotonic, floor: float = 0.0,
                 quota: str = "frames/s per node stream (--max-frames-per-second); the stream is closed"):
        self.rate, self.capacity, self.floor = rate, max(2.0 * rate, 10.0), floor
        self.tokens, self._clock = max(self.capacity, floor), clock
        self.quota = quota
        self._at = clock()

    def spend(self, frames: int = 1, streams: int = 1) -> None:
        now = self._clock()
        most = max(self.capacity * streams, self.floor)
        self.tokens = min(most, self.tokens + (now - self._at) * self.rate * streams)
        self._at = now
        if self.tokens < frames:
            raise errors.ResourceExhausted(f"more than {self.rate:g} {self.quota}")
        self.tokens -= frames


def tenant_of(grants: list[str] | None, peer: str) -> str:
    """Whose quota a call spends: its token's (the jobs it is for), else its peer host's."""
    if grants is not None:
        return "token for " + ",".join(sorted(grants))
    return peer.rsplit(":", 1)[0]  # "ipv4:10.0.0.1:5123" -> "ipv4:10.0.0.1"


class IdleStreams:
    """Session and Relay calls waiting for their first message, counted per tenant: each waits
    `timeout_s` at most, and a tenant holds at most `limit` such calls at once (each holds a task
    and the call's state while it sends nothing). Per tenant, not per host: one job's token holder
    behind the address another job's nodes share (NAT, a proxy) cannot lock them out."""

    def __init__(self, limit: int):
        self.limit = limit
        self.waiting: Counter[str] = Counter()

    async def first(self, request_iterator: AsyncIterator[M], tenant: str, timeout_s: float, missing: str) -> M:
        if self.waiting[tenant] >= self.limit:
            raise errors.Unavailable(f"{self.limit} calls of the {tenant} have sent no first message yet "
                                     f"(--max-idle-streams); retry later")
        self.waiting[tenant] += 1
        try:
            first = await asyncio.wait_for(anext(request_iterator, None), timeout_s)
        except TimeoutError:
            raise errors.DeadlineExceeded(f"no first message within {timeout_s:g}s of the call") from None
        finally:
            self.waiting[tenant] -= 1
            if not self.waiting[tenant]:
                del self.waiting[tenant]
        if first is None:
            raise errors.InvalidArgument(missing)
        return first


class RelayCalls:
    """Relay calls held open per peer host: `limit` per job (a replica relays a job on one call, two
    while it reconnects). Counted for the host before a call's first message is read (a Relay comes
    only to a job's leader: at most `limit` per job this replica leads; a flood of calls is refused
    before any of it is decoded), then for the job it names."""

    def __init__(self, limit: int):
        self.limit = limit
        self.hosts: Counter[str] = Counter()
        self.jobs: Counter[tuple[str, str]] = Counter()

    def enter(self, peer: str, jobs_led: int) -> str:
        host = peer.rsplit(":", 1)[0]
        most = self.limit * max(1, jobs_led)
        if self.hosts[host] >= most:
            raise errors.ResourceExhausted(f"{host} holds {most} Relay calls already, {self.limit} per job this "
                                           f"replica leads (--max-relay-calls)")
        self.hosts[host] += 1
        return host

    def name(self, host: str, job: str) -> tuple[str, str]:
        key = (host, job)
        if self.jobs[key] >= self.limit:
            raise errors.ResourceExhausted(f"{host} holds {self.limit} Relay calls for job {job!r} already, the "
                                           f"most one peer may (--max-relay-calls)")
        self.jobs[key] += 1
        return key

    def leave(self, host: str, key: tuple[str, str] | None) -> None:
        for counter, k in ((self.hosts, host), (self.jobs, key)):
            if k is not None:
                counter[k] -= 1
                if not counter[k]:
                    del counter[k]


class RefusalLog:
    """Refusals as counted lines: the first of a kind (event and status code) at once, then at most
    one line a `window_s`, saying how many were refused since the last (`refused`) and the latest's
    error; a count left over is written a window after the line before it."""

    def __init__(self, window_s: float = 1.0, clock=time.monotonic):
        self.window_s, self._clock = window_s, clock
        self._logged: dict[tuple[str, str], float] = {}
        self._held: dict[tuple[str, str], tuple[int, str, dict]] = {}

    def refused(self, event: str, code: str, error: str, **fields) -> None:
        key = (event, code)
        now = self._clock()
        due = self._logged.get(key, -math.inf) + self.window_s
        if now >= due and key not in self._held:
            self._logged[key] = now
            log.info(event, code=code, error=error, refused=1, **fields)
            return
        count = self._held[key][0] if key in self._held else 0
        if not count:
            asyncio.get_running_loop().call_later(max(0.0, due - now), self._flush, key)
        self._held[key] = (count + 1, error, fields)

    def _flush(self, key: tuple[str, str]) -> None:
        count, error, fields = self._held.pop(key)
        self._logged[key] = self._clock()
        log.info(key[0], code=key[1], error=error, refused=count, **fields)


refusals = RefusalLog()  # the replica's: kinds are few (events x codes), so is what it keeps
