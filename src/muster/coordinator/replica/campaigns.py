"""A replica's candidacy for its jobs: one lease session, replaced once it is lost, and on it one
campaign thread per job. A won campaign is handed to the replica to lead; a lost session ends every
leadership of the replica (its `session_lost`) before each job is campaigned for again on the new one.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Collection, Sized
from dataclasses import dataclass

import structlog

from muster.coordinator.coordination import Coordination, JobElection, LeaderKey, LeaseSession
from muster.coordinator.errors import StoreError, StoreUnavailable
from muster.net import Backoff

# Campaigning again for a job whose leadership failed: the delay doubles from the first to the
# most, with jitter, and starts over once the job was led without a fault for RETRY_RESET_S.
RETRY_FIRST_S, RETRY_MOST_S, RETRY_RESET_S = 0.2, 5.0, 60.0
# A session or a campaign that etcd did not answer is retried within a second (jitter doubles this at
# most): etcd back after a long outage is used at once, and a grant or a campaign is one cheap request.
RETRY_ETCD_MOST_S = 0.5


async def revoked(session: LeaseSession, within_s: float) -> bool:
    """Revoke `session`'s lease, again while etcd does not answer, until it would have expired
    anyway. One try was not enough: the client may still be on a member that is not back (after a
    new session was granted through another), and the old keys then held every campaign for the
    rest of their TTL (4 s in a 30 s etcd outage test)."""
    loop = asyncio.get_running_loop()
    deadline, backoff = loop.time() + within_s, Backoff(0.05, RETRY_ETCD_MOST_S)
    while not await asyncio.to_thread(session.revoke):
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(backoff.next())
    return True


@dataclass
class _Campaign:
    election: JobElection
    stop: threading.Event
    thread: threading.Thread


class Campaigns:
    def __init__(self, coordination: Coordination, *, session_ttl_s: int, renew_deadline_s: float | None,
                 balance_delay_s: float, jobs: Collection[str], leaders: Sized,
                 won: Callable[[LeaderKey, threading.Event], Awaitable[None]],
                 session_lost: Callable[[str], Awaitable[None]]):
        """`jobs` and `leaders`: the replica's, read here (the jobs to campaign for again on a new
        session; how many it leads, for the balance delay). `won(key, stop)` runs on the event loop
        for a campaign won; `session_lost(reason)` ends the old session's leaderships."""
        self.coordination = coordination
        self._ttl_s, self._renew_deadline_s, self._balance_delay_s = session_ttl_s, renew_deadline_s, balance_delay_s
        self._jobs, self._leaders = jobs, leaders
        self._won, self._session_lost = won, session_lost
        self.session: LeaseSession | None = None
        self.closing = False  # set by the replica as it starts to close: nothing new is started
        self.address = ""
        self.log = structlog.get_logger(__name__)
        self._campaigns: dict[str, _Campaign] = {}
        self._retries: dict[str, Backoff] = {}  # job -> its campaigns after a failed leadership
        self._renewing: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def ready(self) -> bool:
        return not self.closing and self.session is not None and self.session.alive()

    async def start(self, address: str, log) -> None:
        """Grant the first session (retried while etcd is unreachable); elections name `address`."""
        self.address, self.log = address, log
        self._loop = asyncio.get_running_loop()
        await self._new_session()

    async def close(self) -> None:
        for c in self._stop_all():
            await asyncio.to_thread(c.thread.join, 5.0)
        if self.session:
            await asyncio.to_thread(self.session.close, True)

    def _stop_all(self) -> list[_Campaign]:
        campaigns, self._campaigns = self._campaigns, {}
        for c in campaigns.values():
            c.stop.set()
        return list(campaigns.values())

    # ---- the session -----------------------------------------------------------------

    async def _new_session(self) -> None:
        backoff = Backoff(0.1, RETRY_ETCD_MOST_S)
        while not self.closing:
            session = self.coordination.session(self._ttl_s, renew_deadline_s=self._renew_deadline_s)
            try:
                await asyncio.to_thread(session.start)
            except StoreUnavailable as exc:
                delay = backoff.next()
                self.log.warning("session_start_failed", error=str(exc), retry_in_s=round(delay, 2))
                await asyncio.sleep(delay)
                continue
            self.session = session
            session.add_listener(lambda: self._loop.call_soon_threadsafe(self._lost, session))
            return

    def _lost(self, session: LeaseSession) -> None:
        if session is not self.session or self.closing or self._renewing:
            return
        reason = session.lost_reason or "renew deadline passed"
        self._renewing = asyncio.create_task(self._renew(f"session lost: {reason}"))

    async def _renew(self, reason: str) -> None:
        """Every leadership of the old session is void: drop them, then campaign again."""
        try:
            await self._session_lost(reason)
            self._stop_all()
            old = self.session
            await asyncio.to_thread(old.close, True)  # best effort: lets a standby lead sooner
            await self._new_session()
            # etcd answers again: the old lease's keys (this replica's leadership and candidacies) go now,
            # not a TTL after etcd came back (a restarted etcd renews every lease), which every new
            # campaign, ours and the other replicas', would wait for
            await revoked(old, self._ttl_s)
            for job in sorted(self._jobs):
                self.campaign(job)
        finally:
            self._renewing = None
        if self.session is not None and not self.session.alive() and not self.closing:
            # lost while it was being set up (its loss was not acted on then): renew again, or the
            # replica would sit on a dead session, campaigning for nothing, for good
            self._lost(self.session)

    # ---- campaigns -------------------------------------------------------------------

    def campaign(self, job: str, delay: float | None = None, resign: JobElection | None = None) -> None:
        """Campaign for `job` after `delay` (default: the balance delay), first resigning the key
        of a leadership that failed, so that the new campaign does not find it and lead at once."""
        if self.closing or job in self._campaigns or self.session is None or not self.session.alive():
            return  # a lost session's renewal campaigns for every known job once the new one is up
        election = self.coordination.election(self.session, job, self.address)
        stop = threading.Event()
        if delay is None:
            # A replica that already leads jobs lets the others go first (capped: alone, it still leads soon).
            delay = self._balance_delay_s * min(len(self._leaders), 5)
        thread = threading.Thread(target=self._campaign_thread, args=(job, election, stop, delay, resign),
                                  name=f"campaign:{job}", daemon=True)
        self._campaigns[job] = _Campaign(election, stop, thread)
        thread.start()

    def retry(self, job: str, reason: str) -> None:
        """One job's leadership failed: resign its key and campaign for it again after a backoff. A lost
        session is not retried here: its renewal campaigns for every job."""
        if self.closing or self._renewing or not self.session.alive():
            return
        campaign = self._campaigns.pop(job, None)
        if campaign is not None:
            campaign.stop.set()
        retries = self._retries.get(job)
        if retries is None:
            retries = self._retries[job] = Backoff(RETRY_FIRST_S, RETRY_MOST_S, reset_after_s=RETRY_RESET_S,
                                                   clock=self._loop.time)
        delay = retries.next()
        self.log.warning("job_leadership_dropped", job=job, reason=reason, campaign_in_s=round(delay, 2))
        self.campaign(job, delay, resign=campaign.election if campaign else None)

    def forget(self, job: str) -> None:
        """The job's run ended: its campaign stops, its key goes, no retry of it stays."""
        campaign = self._campaigns.pop(job, None)
        if campaign is not None:
            campaign.stop.set()  # its thread withdraws its key as it ends...
            if not campaign.thread.is_alive():  # ...or it won already (the run ended as it did): here
                asyncio.ensure_future(asyncio.to_thread(self._withdraw, job, campaign.election))
        self._retries.pop(job, None)

    def _campaign_thread(self, job: str, election: JobElection, stop: threading.Event, delay: float,
                         resign: JobElection | None) -> None:
        try:
            self._campaign_for(job, election, stop, delay, resign)
        finally:
            if job not in self._jobs:  # the job ended: its key must not outlive it (it would until the session ends)
                self._withdraw(job, election)

    def _withdraw(self, job: str, election: JobElection) -> None:
        try:
            election.withdraw()
        except StoreError as exc:
            self.log.warning("withdraw_failed", job=job, error=str(exc))

    def _campaign_for(self, job: str, election: JobElection, stop: threading.Event, delay: float,
                      resign: JobElection | None) -> None:
        if resign is not None:
            try:  # lets a standby lead at once; else the key goes with the session
                resign.resign()
            except StoreError as exc:
                self.log.warning("resign_failed", job=job, error=str(exc))
        if stop.wait(delay):
            return
        backoff = Backoff(0.1, RETRY_ETCD_MOST_S)
        while not stop.is_set():
            try:
                key = election.campaign(stop)
            except Exception as exc:  # etcd unreachable, or a fault: this job's campaign must go on
                if isinstance(exc, StoreUnavailable):
                    self.log.warning("campaign_failed", job=job, error=str(exc))
                else:
                    self.log.exception("campaign_failed", job=job)
                stop.wait(backoff.next())
                continue
            if key is not None and not stop.is_set():
                self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._won(key, stop)))
            return
