"""One coordinator replica: its etcd session, a campaign per job, and the jobs it leads.

Leadership is per job, so jobs spread over replicas (a replica that already leads jobs
campaigns a little later). A replica that does not lead a job answers its traffic with
NotLeader naming the leader. Losing the session ends every leadership of this replica;
it then starts a fresh session and campaigns again as a standby. A fault in leading one job
(its state, a fenced write, a bug) ends only that job's leadership: its key is resigned and
the job is campaigned for again after a backoff.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, replace

import structlog

from muster.coordinator import wire
from muster.coordinator.coordination import Coordination, JobElection, LeaderKey, LeaseSession
from muster.coordinator.core.policy import InvalidPolicy, JobSpec, Limits, Timing
from muster.coordinator.core.state import JobState, decode, decode_spec, encode_spec
from muster.coordinator.errors import (FailedPrecondition, InvalidArgument, NotFound, NotLeader, ResourceExhausted,
                                       RunEnded, StoreError, StoreUnavailable, Unavailable)
from muster.coordinator.leader import JobLeader
from muster.coordinator.leadership import Leadership
from muster.coordinator.metrics import JobGauges, Metrics
from muster.coordinator.relay import PeerAccess, Relay
from muster.coordinator.store import JobStorage
from muster.net import Backoff
from muster.v1 import muster_pb2 as pb

log = structlog.get_logger(__name__)

# Campaigning again for a job whose leadership failed: the delay doubles from the first to the
# most, with jitter, and starts over once the job was led without a fault for RETRY_RESET_S.
RETRY_FIRST_S, RETRY_MOST_S, RETRY_RESET_S = 0.2, 5.0, 60.0
# A session or a campaign that etcd did not answer is retried within a second (jitter doubles this at
# most): etcd back after a long outage is used at once, and a grant or a campaign is one cheap request.
RETRY_ETCD_MOST_S = 0.5
LEADER_LOOKUP_S = 0.5  # a NotLeader hint is worth this much wait, no more


@dataclass(frozen=True)
class ReplicaConfig:
    address: str = ""  # advertised to workers and other replicas; may be set once bound
    timing: Timing = Timing()
    default_spec: JobSpec = JobSpec()
    tick_s: float = 0.05
    session_ttl_s: int = 3
    renew_deadline_s: float | None = None  # default 2/3 of the TTL
    balance_delay_s: float = 0.1  # per job already led (up to 5), before campaigning for another
    leader_wait_s: float = 3.0  # a Join for a new job waits this long for its election
    limits: Limits = Limits()
    relay: bool = True  # relay node streams of jobs this replica does not lead (--no-relay: refuse them)
    relay_min_nodes: int = 64  # a job relays from this many nodes (members, or its min_nodes) on
    relay_batch_s: float = 0.02  # a relay's batch window (exits and hang-ups go at once)
    retain_finished_s: float = 7 * 86400.0  # a finished run's record is kept this long, then etcd deletes it


@dataclass
class _Campaign:
    election: JobElection
    stop: threading.Event
    thread: threading.Thread


class Replica:
    def __init__(self, store: JobStorage, coordination: Coordination, config: ReplicaConfig, *,
                 peers: PeerAccess = PeerAccess()):
        """`store` and `coordination` (sessions, elections): etcd's (`etcd.store.JobStore`,
        `etcd.election.EtcdCoordination`), or their in-memory twins in tests. `peers`: how this
        replica, relaying, calls the leader."""
        self.config = config
        self.peers = peers
        self.relays: dict[str, Relay] = {}
        self.address = config.address
        self.store = store
        self.coordination = coordination
        self.jobs: set[str] = set()
        self.leaders: dict[str, JobLeader] = {}
        self._campaigns: dict[str, _Campaign] = {}
        self._session: LeaseSession | None = None
        self._cancel_watch = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False
        self._renewing: asyncio.Task | None = None
        self._retries: dict[str, Backoff] = {}  # job -> its campaigns after a failed leadership
        self._following: set[asyncio.Task] = set()  # one per leader: awaits its leadership's end
        self.log = log
        self.metrics = Metrics()
        self.metrics.watch(self.gauges, self.ready)

    @property
    def started(self) -> bool:
        return self._loop is not None

    def ready(self) -> bool:
        """Serving with a live etcd session: a leader, or a standby able to take over."""
        return self.started and not self._closing and self._session is not None and self._session.alive()

    def gauges(self) -> list[JobGauges]:
        """Every known job as a metrics scrape reports it (read at scrape time)."""
        found = []
        for job in sorted(self.jobs):
            leader = self.leaders.get(job)
            if leader is None:
                found.append(JobGauges(job, led=False))
                continue
            s = leader.state
            found.append(JobGauges(job, led=True, term=leader.term, generation=s.generation,
                                   live_ranks=leader.live_ranks(),
                                   world_size=s.rank_map.world_size if s.rank_map else 0, spares=len(s.spares)))
        return found

    # ---- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        if not self.address:
            raise ValueError("the replica needs its advertise address before it starts")
        self.log = log.bind(replica=self.address)
        self._loop = asyncio.get_running_loop()
        await self._new_session()
        self._cancel_watch = self.store.watch_jobs(
            lambda job: self._loop.call_soon_threadsafe(self._discovered, job),
            lambda job: self._loop.call_soon_threadsafe(self._forget, job),
        )
        for job in await asyncio.to_thread(self.store.list_jobs):
            self._discovered(job)
        self.log.info("replica_started", jobs=len(self.jobs))

    async def close(self) -> None:
        """Stop leading (resigning, so a standby takes over at once) and end the session."""
        self._closing = True
        if self._cancel_watch:
            self._cancel_watch()
        for relay in self.relays.values():
            relay.close()
        for job in list(self.leaders):
            await self.leaders.pop(job).stop("replica shutting down", resigned=True)
        campaigns, self._campaigns = self._campaigns, {}
        for c in campaigns.values():
            c.stop.set()
        for c in campaigns.values():
            await asyncio.to_thread(c.thread.join, 5.0)
        if self._session:
            await asyncio.to_thread(self._session.close, True)
        self.log.info("replica_stopped")

    async def _new_session(self) -> None:
        backoff = Backoff(0.1, RETRY_ETCD_MOST_S)
        while not self._closing:
            c = self.config
            session = self.coordination.session(c.session_ttl_s, renew_deadline_s=c.renew_deadline_s)
            try:
                await asyncio.to_thread(session.start)
            except StoreUnavailable as exc:
                delay = backoff.next()
                self.log.warning("session_start_failed", error=str(exc), retry_in_s=round(delay, 2))
                await asyncio.sleep(delay)
                continue
            self._session = session
            session.add_listener(lambda: self._loop.call_soon_threadsafe(self._session_lost, session))
            return

    def _session_lost(self, session: LeaseSession) -> None:
        if session is not self._session or self._closing or self._renewing:
            return
        reason = session.lost_reason or "renew deadline passed"
        self._renewing = asyncio.create_task(self._renew_session(f"session lost: {reason}"))

    async def _renew_session(self, reason: str) -> None:
        """Every leadership of the old session is void: drop them, then campaign again."""
        try:
            self.log.warning("session_replaced", reason=reason, led=sorted(self.leaders))
            for job in list(self.leaders):
                await self.leaders.pop(job).stop(reason)
            campaigns, self._campaigns = self._campaigns, {}
            for c in campaigns.values():
                c.stop.set()
            old = self._session
            await asyncio.to_thread(old.close, True)  # best effort: lets a standby lead sooner
            await self._new_session()
            # etcd answers again: the old lease's keys (this replica's leadership and candidacies) go now,
            # not a TTL after etcd came back (a restarted etcd renews every lease), which every new
            # campaign, ours and the other replicas', would wait for
            await asyncio.to_thread(old.revoke)
            for job in sorted(self.jobs):
                self._campaign(job)
        finally:
            self._renewing = None
        if self._session is not None and not self._session.alive() and not self._closing:
            # lost while it was being set up (its loss was not acted on then): renew again, or the
            # replica would sit on a dead session, campaigning for nothing, for good
            self._session_lost(self._session)

    # ---- campaigns -------------------------------------------------------------------

    def _discovered(self, job: str) -> None:
        if job not in self.jobs:
            self.jobs.add(job)
            self.log.info("job_discovered", job=job)
        self._campaign(job)

    def _campaign(self, job: str, delay: float | None = None, resign: JobElection | None = None) -> None:
        """Campaign for `job` after `delay` (default: the balance delay), first resigning the key
        of a leadership that failed, so that the new campaign does not find it and lead at once."""
        if self._closing or job in self._campaigns or self._session is None or not self._session.alive():
            return  # a lost session's renewal campaigns for every known job once the new one is up
        election = self.coordination.election(self._session, job, self.address)
        stop = threading.Event()
        if delay is None:
            # A replica that already leads jobs lets the others go first (capped: alone, it still leads soon).
            delay = self.config.balance_delay_s * min(len(self.leaders), 5)
        thread = threading.Thread(target=self._campaign_thread, args=(job, election, stop, delay, resign),
                                  name=f"campaign:{job}", daemon=True)
        self._campaigns[job] = _Campaign(election, stop, thread)
        thread.start()

    def _campaign_thread(self, job: str, election: JobElection, stop: threading.Event, delay: float,
                         resign: JobElection | None) -> None:
        try:
            self._campaign_for(job, election, stop, delay, resign)
        finally:
            if job not in self.jobs:  # the job ended: its key must not outlive it (it would until the session ends)
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
                self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._lead(key, stop)))
            return

    async def _lead(self, key: LeaderKey, stop: threading.Event) -> None:
        job = key.job
        try:
            data, spec = await asyncio.to_thread(lambda: (self.store.load_state(job), self.store.get_spec(job)))
            if stop.is_set() or self._closing:
                return
            if data is None and spec is None and (job not in self.jobs or await asyncio.to_thread(
                    self.store.last_run, job)):
                # The job's run ended (its spec went with it) as this campaign won: not a job etcd lost.
                self.log.info("ended_job_not_led", job=job)
                self._forget(job)
                return
            leader = self._leader(key, data, spec)
        except StoreUnavailable as exc:
            self.log.warning("job_state_unreadable", job=job, error=str(exc))
            self._leadership_lost(job, f"could not load job state: {exc}")
            return
        except Exception as exc:  # a fault in one job (its state, a bug) must not leave its key held by nobody
            self.log.exception("leadership_failed", job=job, term=key.term)
            self._leadership_lost(job, f"could not lead: {exc!r}")
            return
        self.leaders[job] = leader
        leader.start()
        following = asyncio.ensure_future(self._follow(leader))
        self._following.add(following)
        following.add_done_callback(self._following.discard)
        self.log.info("leadership_acquired", job=job, term=key.term, generation=leader.state.generation,
                      members=len(leader.state.members))

    def _leader(self, key: LeaderKey, data: bytes | None, spec: bytes | None) -> JobLeader:
        job = key.job
        spec_lost = False
        if data:
            state = decode(data)
        else:
            # No state: a new job, or one etcd lost. Nodes that were members say so as they
            # reconnect, and are taken back (a new job has none); without a spec either, the
            # first of them brings it.
            asked, run = decode_spec(spec) if spec else (self.config.default_spec, 1)
            state = JobState(job, asked, rebuilding=True, spec_lost=spec is None, run=run)
            if spec is None:
                self.log.warning("job_spec_missing", job=job)
                spec_lost = True
        return JobLeader(
            replace(state, term=key.term),
            leadership=Leadership(key, self.store, session_alive=self._session.alive, restore_spec=spec_lost),
            address=self.address,
            timing=self.config.timing,
            tick_s=self.config.tick_s,
            limits=self.config.limits,
            metrics=self.metrics,
            retain_s=self.config.retain_finished_s,
        )

    async def _follow(self, leader: JobLeader) -> None:
        """A leadership that ended by itself (a fenced write, a fault, the session past its renew
        deadline) is dropped here; one this replica ended (closing, a lost session) is gone already."""
        await leader.leadership.lost.wait()
        if self.leaders.get(leader.job) is not leader:
            return
        if leader.ended:
            self._forget(leader.job)
        else:
            self._leadership_lost(leader.job, leader.lost_reason)

    def _forget(self, job: str) -> None:
        """The job's run ended (its spec is gone): no campaign, leader, relay, retry or metric of it
        stays. A leader ending the run itself (the watch can tell before it is done) is forgotten
        once it is; one still holding members is rebuilding a job etcd lost, and stays."""
        leader = self.leaders.get(job)
        if leader is not None and not leader.ended and (leader.state.ended or leader.state.members):
            return
        self.jobs.discard(job)
        if leader is not None:
            del self.leaders[job]
            asyncio.ensure_future(leader.stop("the job's run ended"))
        campaign = self._campaigns.pop(job, None)
        if campaign is not None:
            campaign.stop.set()  # its thread withdraws its key as it ends...
            if not campaign.thread.is_alive():  # ...or it won already (the run ended as it did): here
                asyncio.ensure_future(asyncio.to_thread(self._withdraw, job, campaign.election))
        relay = self.relays.pop(job, None)
        if relay is not None:
            relay.close()
        self._retries.pop(job, None)
        self.metrics.forget(job)
        self.log.info("job_forgotten", job=job, jobs=len(self.jobs))

    def _leadership_lost(self, job: str, reason: str) -> None:
        """One job's leadership is void: drop it, resign its key and campaign for it again after a
        backoff; the other jobs are untouched. A lost session is the session listener's to handle
        (it ends every leadership of this replica)."""
        leader = self.leaders.pop(job, None)
        if leader is not None:
            asyncio.ensure_future(leader.stop(reason))
        if self._closing or self._renewing or not self._session.alive():
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
        self._campaign(job, delay, resign=campaign.election if campaign else None)

    # ---- routing ---------------------------------------------------------------------

    async def leader_for(self, job: str) -> JobLeader:
        wire.check_job(job)
        leader = self.leaders.get(job)
        if leader is not None:
            return leader
        if job not in self.jobs:
            raise await self._unknown(job)
        raise NotLeader(job, await self._leader_address(job))

    async def _unknown(self, job: str, run: int = 0) -> NotFound:
        """Why `job` (its run `run`, or its latest) is not served: its run ended (how), or it is unknown."""
        try:
            runs = await asyncio.to_thread(self.store.runs, job)
        except StoreUnavailable:
            runs = []
        found = [(r, json.loads(summary)) for _, r, summary in runs if not run or r == run]
        if found:
            ended, summary = found[-1]
            return RunEnded(job, ended, summary["outcome"], summary["reason"])
        return NotFound(f"job {job!r} is unknown to this deployment" if not run else
                        f"run {run} of job {job!r} has ended")

    async def _leader_address(self, job: str) -> str:
        """Where the job's leader is, for a NotLeader hint; quickly, or "" (with etcd unreachable
        a read waits for the client's timeout, and a node waiting on an answer thinks us silent)."""
        address = await self._elected(job)
        return address if address != self.address else ""

    async def _elected(self, job: str) -> str:
        """The address etcd names as the job's leader (this replica's own included), or ""."""
        try:
            found = await asyncio.wait_for(asyncio.to_thread(self.coordination.current_leader, job), LEADER_LOOKUP_S)
        except (StoreUnavailable, TimeoutError):
            return ""
        return found[0] if found else ""

    def relay_for(self, first: pb.NodeFrame, not_leader: NotLeader) -> Relay:
        """The relay of a job this replica does not lead, for a node that picked this replica as its
        relay; raises `not_leader` (go to the leader) where this replica relays nothing."""
        if not (self.config.relay and first.via_relay) or self._closing:
            raise not_leader
        relay = self.relays.get(first.job)
        if relay is None or not relay.accepting:
            relay = self.relays[first.job] = Relay(
                first.job, self.address, not_leader.leader, security=self.peers.security(),
                find_leader=self._elected, window_s=self.config.relay_batch_s,
                # A dead leader's key outlives it by up to the session TTL: followed, not given up on.
                connect_s=self.config.session_ttl_s + self.config.timing.heartbeat_timeout_s,
                heartbeat_timeout_s=self.config.timing.heartbeat_timeout_s,
                progress_s=self.config.timing.relay_progress_s)
        return relay

    async def session_leader(self, first: pb.NodeFrame) -> JobLeader:
        """The leader for a Session stream. A node of a job this replica never heard of (etcd lost
        the job, and this replica started since) says on its first frame who it is: the job is
        created from that as its Join did and its election awaited, so that the node is taken
        back rather than told it is no member (which ends its agent)."""
        wire.check_job(first.job)
        if first.job not in self.jobs and first.HasField("rejoin"):
            wire.check_rejoin(first)
            await self._create_job(first.job, wire.spec_of(first.rejoin.spec))
            await self._await_election(first.job)
        leader = await self.leader_for(first.job)
        if first.run and first.run != leader.state.run:  # a node of a run that ended: how it ended
            raise await self._unknown(first.job, first.run)
        return leader

    async def join(self, req: pb.JoinRequest) -> pb.JoinResponse:
        wire.check_join(req)
        requested = wire.spec_of(req.spec)
        if req.job not in self.leaders:
            if req.job not in self.jobs:
                await self._create_job(req.job, requested)
            await self._await_election(req.job)
        leader = await self.leader_for(req.job)
        response = await leader.join(req, requested)
        # Relaying is decided where the job is led: a standby run with --no-relay refuses, and the node streams here.
        response.relay = self.config.relay and max(len(leader.state.members), leader.state.spec.min_nodes) >= \
            self.config.relay_min_nodes
        return response

    async def _create_job(self, job: str, requested: JobSpec) -> None:
        if len(self.jobs) >= self.config.limits.max_jobs:
            raise ResourceExhausted(f"this deployment holds {len(self.jobs)} jobs, the most it takes "
                                    f"(--max-jobs {self.config.limits.max_jobs}); job {job!r} is refused")
        try:
            spec = requested.merged_over(self.config.default_spec).validate()
        except InvalidPolicy as exc:
            raise InvalidArgument(str(exc)) from exc
        try:
            # A name whose runs ended starts the next run (numbered on from the retained records).
            await asyncio.to_thread(lambda: self.store.create_spec(job, encode_spec(spec, self.store.last_run(job) + 1)))
        except StoreUnavailable as exc:
            raise Unavailable(f"etcd is unavailable: {exc}") from exc
        self._discovered(job)

    async def _await_election(self, job: str) -> None:
        """A new job's election takes a moment: wait for it rather than bounce the caller."""
        deadline = self._loop.time() + self.config.leader_wait_s
        while job not in self.leaders and self._loop.time() < deadline:
            address = await self._leader_address(job)
            if address:
                raise NotLeader(job, address)
            await asyncio.sleep(0.02)

    async def status(self, job: str, brief: bool = False, page: wire.Page = wire.Page(),
                     run: int = 0) -> pb.StatusResponse:
        names = [wire.check_job(job)] if job else sorted(self.jobs)
        resp = pb.StatusResponse(replica=self.address)
        if job and (run or job not in self.jobs):  # a finished run, or the running one
            state = await self._of_run(job, run)
            if state is not None:
                resp.jobs.append(wire.job_status(state, "", 0, None, brief, page))
                return resp
        for name in names:
            leader = self.leaders.get(name)
            if leader is not None:
                resp.jobs.append(await leader.status(brief, page))
                continue
            state, term_leader = await self._persisted(name)
            address, term = term_leader
            resp.jobs.append(wire.job_status(state, address, term, None, brief, page))
        return resp

    async def events(self, job: str, run: int = 0) -> pb.EventsResponse:
        wire.check_job(job)
        leader = self.leaders.get(job)
        state = await self._of_run(job, run) if run or job not in self.jobs else None
        if state is None:
            state = leader.state if leader is not None else (await self._persisted(job))[0]
        return pb.EventsResponse(job=job, run=state.run, events=[wire.event_pb(e) for e in state.history])

    async def _of_run(self, job: str, run: int) -> JobState | None:
        """A finished run's final state: `run`, or at 0 the latest retained one of a name with no
        running run. None: the running run is the one asked for. NotFound when there is neither."""
        if job in self.jobs:
            leader = self.leaders.get(job)
            current = leader.state.run if leader is not None else (await self._persisted(job))[0].run
            if not run or run == current:
                return None

        def read():
            found = run or self.store.last_run(job)
            return self.store.load_run(job, found) if found else None

        try:
            data = await asyncio.to_thread(read)
        except StoreUnavailable as exc:
            raise Unavailable(f"etcd is unavailable: {exc}") from exc
        if data is None:
            raise NotFound(f"job {job!r} has no run {run} in this deployment" if run else
                           f"job {job!r} is unknown to this deployment (no running or retained run)")
        return decode(data)

    # ---- operator verbs --------------------------------------------------------------

    async def list_jobs(self, job: str = "") -> pb.JobsResponse:
        """Running jobs (each as its leader or etcd has it), then retained finished runs, newest first."""
        if job:
            wire.check_job(job)
        try:
            finished = await asyncio.to_thread(self.store.runs, job)
        except StoreUnavailable as exc:
            raise Unavailable(f"etcd is unavailable: {exc}") from exc
        records = sorted((wire.job_record(name, run, json.loads(summary)) for name, run, summary in finished),
                         key=lambda r: (-r.ended_unix_ms, r.name))
        recorded = {(r.name, r.run) for r in records}
        resp = pb.JobsResponse()
        for name in sorted(self.jobs):
            if job and name != job:
                continue
            leader = self.leaders.get(name)
            if leader is not None:
                state, address = leader.state, self.address
            else:
                try:
                    state, (address, _) = await self._persisted(name)
                except NotFound:
                    continue  # it ended as we looked: its record is listed
            if (name, state.run) in recorded:
                continue
            rm = state.rank_map
            resp.jobs.append(wire.job_record(name, state.run, {
                "outcome": state.outcome.value, "reason": state.outcome_reason, "generation": state.generation,
                "world_size": rm.world_size if rm else 0, "started_ms": state.started_ms, "ended_ms": state.ended_ms},
                address))
        resp.jobs.extend(records)
        return resp

    async def stop_job(self, job: str, reason: str) -> pb.StopResponse:
        await self._running(job)
        return await (await self.leader_for(job)).stop_job(reason or "stopped by an operator")

    async def drain_node(self, job: str, node: str, reason: str) -> pb.DrainResponse:
        await self._running(job)
        return await (await self.leader_for(job)).drain_node(node, reason or "drained by an operator")

    async def delete_runs(self, job: str, run: int) -> pb.DeleteResponse:
        wire.check_job(job)
        leader = self.leaders.get(job)
        if run and leader is not None and leader.state.run == run:
            raise FailedPrecondition(f"run {run} of job {job!r} is running: stop it first (muster stop {job})")
        try:
            deleted = await asyncio.to_thread(self.store.delete_runs, job, run)
        except StoreUnavailable as exc:
            raise Unavailable(f"etcd is unavailable: {exc}") from exc
        if not deleted:
            raise NotFound(f"job {job!r} has no retained finished run" + (f" {run}" if run else ""))
        return pb.DeleteResponse(deleted=deleted)

    async def _running(self, job: str) -> None:
        wire.check_job(job)
        if job not in self.jobs:
            last = await asyncio.to_thread(self.store.last_run, job)
            raise FailedPrecondition(f"job {job!r} is not running" + (f" (its run {last} has ended)" if last else ""))

    async def _persisted(self, job: str) -> tuple[JobState, tuple[str, int]]:
        def read():
            return self.store.load_state(job), self.store.get_spec(job), self.coordination.current_leader(job)

        try:
            data, spec, found = await asyncio.to_thread(read)
        except StoreUnavailable as exc:
            raise Unavailable(f"etcd is unavailable: {exc}") from exc
        if data:
            state = decode(data)
        elif spec:
            asked, run = decode_spec(spec)
            state = JobState(job, asked, run=run)
        else:
            raise NotFound(f"job {job!r} is unknown to this deployment")
        return state, found or ("", 0)
