"""What one tenant may hold of a replica (a job's token; without tokens, a peer host): streams that
have not said who they are, Relay calls, Joins, and frames per stream; and what one job may cost the
etcd every job shares (its generations, runs and bytes written). Past a quota a call gets
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
from muster.coordinator.core.policy import Limits

log = structlog.get_logger(__name__)

M = TypeVar("M")  # a stream's message


class FrameBudget:
    """A token bucket: `rate` a second sustained, bursts of `burst_s` worth (at least `least`), and
    at least `floor`. A Session stream spends a frame each, a Relay stream its frames on one bucket
    scaled by the node streams it carries (a message of first frames, to attach them: its floor); a
    job's Joins spend one each (its floor: the job's members quota, so a whole job starts at once).
    What is charged rather than spent (a job's generations, its etcd bytes: they happen, refused or
    not) may run the bucket into debt, and `check` refuses until it is paid back."""

    def __init__(self, rate: float, clock=time.monotonic, floor: float = 0.0,
                 quota: str = "frames/s per node stream (--max-frames-per-second); the stream is closed",
                 burst_s: float = 2.0, per_s: float = 1.0, least: float = 10.0):
        self.rate, self.capacity, self.floor = rate, max(burst_s * rate, least), floor
        self.tokens, self._clock = max(self.capacity, floor), clock
        self.quota, self.per_s = quota, per_s  # the refusal says "more than <rate x per_s> <quota>"
        self._at = clock()

    def _refill(self, streams: int = 1) -> float:
        """The most the bucket holds; refilled to now."""
        now = self._clock()
        most = max(self.capacity * streams, self.floor)
        self.tokens = min(most, self.tokens + (now - self._at) * self.rate * streams)
        self._at = now
        return most

    def spend(self, frames: int = 1, streams: int = 1) -> None:
        self._refill(streams)
        if self.tokens < frames:
            self._refuse()
        self.tokens -= frames

    def charge(self, amount: float) -> None:
        self._refill()
        self.tokens -= amount

    def check(self) -> None:
        """Refused while the bucket is empty or in debt."""
        self._refill()
        if self.tokens < 1:
            self._refuse()

    def full(self) -> bool:
        most = self._refill()
        return self.tokens >= most

    def raise_floor(self, floor: float) -> None:
        """A larger floor, and its difference at once: it only grows, so this gives once."""
        if floor > self.floor:
            self.tokens += max(self.capacity, floor) - max(self.capacity, self.floor)
            self.floor = floor

    def _refuse(self):
        raise errors.ResourceExhausted(f"more than {self.rate * self.per_s:g} {self.quota}")


class JobBudget:
    """One job's rates (`Limits.for_job`): Joins, generations, new runs and the bytes its leader
    writes to etcd."""

    def __init__(self, job: str, limits: Limits, members: int, clock):
        raise_it = f"--job-quota {job}:{{key}}=N raises it for this job"
        self.joins = FrameBudget(limits.joins_per_s, clock, floor=members,
                                 quota=f"Joins/s of job {job!r} (--max-joins-per-second), past bursts of its "
                                       f"members quota; {raise_it.format(key='joins')}")
        self.generations = FrameBudget(limits.generations_per_min / 60, clock, burst_s=60, per_s=60,
                                       quota=f"generations a minute of job {job!r}, its Joins are refused until "
                                             f"it is back within them (--max-generations-per-minute; "
                                             f"{raise_it.format(key='generations')})")
        self.runs = FrameBudget(limits.runs_per_hour / 3600, clock, burst_s=600, per_s=3600, least=1,
                                quota=f"new runs an hour of job {job!r}, past bursts of 10 minutes' worth "
                                      f"(--max-runs-per-hour; {raise_it.format(key='runs')})")
        self.etcd = FrameBudget(limits.etcd_mib_per_min * 2**20 / 60, clock, burst_s=60, per_s=60 / 2**20,
                                quota=f"MiB a minute written to etcd by job {job!r}, its writes wait and its "
                                      f"Joins are refused until it is back within them (--max-etcd-mib-per-minute; "
                                      f"{raise_it.format(key='etcd_mib')})")
        self._all = (self.joins, self.generations, self.runs, self.etcd)

    def full(self) -> bool:
        return all(b.full() for b in self._all)


class JobBudgets:
    """Every job's `JobBudget`, kept by the replica by job name: a new run or a new term of a job
    spends what its last one left (a leader's own bucket was full again on each). One back to full
    is dropped, being as a new one: what is kept grows with the jobs that spent lately, not with the
    jobs ever run. Per replica: a job led by turns on R replicas may reach R times its rates."""

    SWEEP_S = 10.0

    def __init__(self, limits: Limits, clock=time.monotonic):
        self.limits, self._clock = limits, clock
        self._jobs: dict[str, JobBudget] = {}
        self._swept = clock()

    def of(self, job: str, members: int = 0) -> JobBudget:
        """`job`'s budget; `members` (its members quota) is the Joins' burst of a new one."""
        now = self._clock()
        if now - self._swept >= self.SWEEP_S:
            self._swept = now
            for name in [name for name, budget in self._jobs.items() if budget.full()]:
                del self._jobs[name]
        budget = self._jobs.get(job)
        if budget is None:
            budget = self._jobs[job] = JobBudget(job, self.limits.for_job(job), members, self._clock)
        budget.joins.raise_floor(members)  # a run of a larger spec since: it starts at once too
        return budget

    def __len__(self) -> int:
        return len(self._jobs)


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
