"""One coordinator replica: the jobs it leads, won by its campaigns (campaigns.py), and the
routing of every request to a job's leader; what it reports of runs is runs.py's.

Leadership is per job, so jobs spread over replicas (a replica that already leads jobs
campaigns a little later). A replica that does not lead a job answers its traffic with
NotLeader naming the leader. Losing the session ends every leadership of this replica;
it then starts a fresh session and campaigns again as a standby. A fault in leading one job
(its state, a fenced write, a bug) ends only that job's leadership: its key is resigned and
the job is campaigned for again after a backoff.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, replace

import structlog

from muster.coordinator.job import status_pages

from muster.coordinator import wire
from muster.coordinator.replica.campaigns import Campaigns
from muster.coordinator.claims import MemberKeys, check_claim
from muster.coordinator.coordination import Coordination, LeaderKey
from muster.coordinator.core.policy import JobSpec, Limits, Timing
from muster.coordinator.core.state import JobState, decode, decode_spec
from muster.coordinator.core.stragglers import StragglerPolicy
from muster.coordinator.replica.election_waits import ElectionWaits
from muster.coordinator.errors import FailedPrecondition, NotLeader, StoreUnavailable
from muster.coordinator.job.leader import JobLeader
from muster.coordinator.job.leader_stats import LeaderStats
from muster.coordinator.job.leadership import Leadership
from muster.coordinator.metrics import Metrics
from muster.coordinator.replica.ports import LeaderPort, RelayCall, RelayPort, SessionPort
from muster.coordinator.quotas import JobBudgets
from muster.coordinator.replica.relay import PeerAccess, Relays
from muster.coordinator.replica.runs import Runs
from muster.coordinator.store import JobStorage
from muster.v1 import muster_pb2 as pb

log = structlog.get_logger(__name__)

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
    stragglers: StragglerPolicy = StragglerPolicy()
    relay: bool = True  # relay node streams of jobs this replica does not lead (--no-relay: refuse them)
    relay_min_nodes: int = 64  # a job relays from this many nodes (members, or its min_nodes) on
    relay_batch_s: float = 0.02  # a relay's batch window (exits and hang-ups go at once)
    retain_finished_s: float = 7 * 86400.0  # a finished run's record is kept this long, then etcd deletes it


class Replica:
    def __init__(self, store: JobStorage, coordination: Coordination, config: ReplicaConfig, *,
                 peers: PeerAccess = PeerAccess()):
        """`store` and `coordination` (sessions, elections): etcd's (`etcd.store.JobStore`,
        `etcd.election.EtcdCoordination`), or their in-memory twins in tests. `peers`: how this
        replica, relaying, calls the leader."""
        self.config = config
        self.peers = peers
        self.address = config.address
        self.store = store
        self.coordination = coordination
        self.jobs: set[str] = set()
        self.leaders: dict[str, JobLeader] = {}
        # The figures (recoveries, history) of a leadership this replica lost, by job: taken up again
        # if it leads the job next with the run and map it left (no other leader changed them meanwhile).
        self._stood_down: dict[str, tuple[int, int, LeaderStats]] = {}
        self._creating: dict[str, asyncio.Future] = {}  # jobs being created, done once their spec is (or is not)
        self.relays = Relays(lambda: self.address, peers.security, self._elected, window_s=config.relay_batch_s,
                             # A dead leader's key outlives it by up to the session TTL: followed, not given up on.
                             connect_s=config.session_ttl_s + config.timing.heartbeat_timeout_s,
                             heartbeat_timeout_s=config.timing.heartbeat_timeout_s,
                             progress_s=config.timing.relay_progress_s)
        self.elections = ElectionWaits(coordination, self.leaders, self._leader_address, config.leader_wait_s)
        self.campaigns = Campaigns(coordination, session_ttl_s=config.session_ttl_s,
                                   renew_deadline_s=config.renew_deadline_s, balance_delay_s=config.balance_delay_s,
                                   jobs=self.jobs, leaders=self.leaders, won=self._lead,
                                   session_lost=self._session_lost)
        self.budgets = JobBudgets(config.limits)  # each job's rates, by name: its runs and terms share them
        self.runs = Runs(store, coordination, self.jobs, self.leaders, default_spec=config.default_spec,
                         limits=config.limits, budgets=self.budgets)
        self._cancel_watch = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._following: set[asyncio.Task] = set()  # one per leader: awaits its leadership's end
        self.log = log
        self.metrics = Metrics()
        self.metrics.watch(self.runs.gauges, self.ready)

    @property
    def started(self) -> bool:
        return self._loop is not None

    def ready(self) -> bool:
        """Serving with a live etcd session: a leader, or a standby able to take over."""
        return self.started and self.campaigns.ready()

    # ---- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        if not self.address:
            raise ValueError("the replica needs its advertise address before it starts")
        self.log = log.bind(replica=self.address)
        self._loop = asyncio.get_running_loop()
        await self.campaigns.start(self.address, self.log)
        self._cancel_watch = self.store.watch_jobs(
            lambda job: self._loop.call_soon_threadsafe(self._discovered, job),
            lambda job: self._loop.call_soon_threadsafe(self._forget, job),
        )
        for job in await asyncio.to_thread(self.store.list_jobs):
            self._discovered(job)
        self.log.info("replica_started", jobs=len(self.jobs))

    async def close(self) -> None:
        """Stop leading (resigning, so a standby takes over at once) and end the session."""
        self.campaigns.closing = True
        if self._cancel_watch:
            self._cancel_watch()
        self.relays.close()
        for job in list(self.leaders):
            if (leader := self.leaders.pop(job, None)) is not None:  # (see _session_lost)
                await leader.stop("replica shutting down", resigned=True)
        await self.campaigns.close()
        self.log.info("replica_stopped")

    async def _session_lost(self, reason: str) -> None:
        """Every leadership of the lost session is void: drop them (the campaigns then start over).
        While one leader stops, another may see the loss itself and be dropped by `_follow`: a
        KeyError here ended the renewal, and the replica never led again (fresh-clone run Z)."""
        self.log.warning("session_replaced", reason=reason, led=sorted(self.leaders))
        for job in list(self.leaders):
            if (leader := self.leaders.pop(job, None)) is not None:
                self._stand_down(leader)
                await leader.stop(reason)

    # ---- leadership ------------------------------------------------------------------

    def _discovered(self, job: str) -> None:
        if job not in self.jobs:
            self.jobs.add(job)
            self.log.info("job_discovered", job=job)
        self.campaigns.campaign(job)

    async def _lead(self, key: LeaderKey, stop: threading.Event) -> None:
        job = key.job
        try:
            data, spec = await asyncio.to_thread(lambda: (self.store.load_state(job), self.store.get_spec(job)))
            if stop.is_set() or self.campaigns.closing:
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
        self.elections.won(job)  # the Joins waiting on its election go on
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
        run, generation, stats = self._stood_down.pop(job, (0, 0, None))
        return JobLeader(
            replace(state, term=key.term),
            stats=stats if data and (run, generation) == (state.run, state.generation) else None,
            leadership=Leadership(key, self.store, session_alive=self.campaigns.session.alive, restore_spec=spec_lost),
            address=self.address,
            timing=self.config.timing,
            tick_s=self.config.tick_s,
            limits=self.config.limits,
            stragglers=self.config.stragglers,
            metrics=self.metrics,
            retain_s=self.config.retain_finished_s,
            member_keys=self.member_keys,
            budgets=self.budgets,
        )

    def member_keys(self) -> MemberKeys | None:
        """The keys that prove members after etcd lost their job: the tokens file's (`auth`)."""
        return self.peers.tokens.member_keys() if self.peers.tokens else None

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
        self._stood_down.pop(job, None)
        if leader is not None:
            del self.leaders[job]
            asyncio.ensure_future(leader.stop("the job's run ended"))
        self.campaigns.forget(job)
        self.relays.forget(job)
        self.metrics.forget(job)
        self.log.info("job_forgotten", job=job, jobs=len(self.jobs))

    def _leadership_lost(self, job: str, reason: str) -> None:
        """One job's leadership is void: drop it, resign its key and campaign for it again after a
        backoff; the other jobs are untouched. A lost session is the session listener's to handle
        (it ends every leadership of this replica)."""
        leader = self.leaders.pop(job, None)
        if leader is not None:
            self._stand_down(leader)
            asyncio.ensure_future(leader.stop(reason))
        self.campaigns.retry(job, reason)

    def _stand_down(self, leader: JobLeader) -> None:
        """Keep a lost leadership's figures for this replica's next one of the job: an etcd session
        lapsing under load (a missed renewal) lost a recovery's record, and the job's history with it."""
        self._stood_down[leader.job] = (leader.state.run, leader.state.generation, leader.stats)

    # ---- routing ---------------------------------------------------------------------

    async def leader_for(self, job: str, run: int = 0) -> JobLeader:
        """The leader of the job's run `run` (0: whichever runs) on this replica; else why not
        (NotLeader naming where, or how that run ended). `job` is a name the edge checked
        (`CoordinatorServicer.admit`)."""
        leader = self.leaders.get(job)
        if leader is not None:
            if run and run != leader.state.run:
                raise await self.runs.unknown(job, run)
            return leader
        if job not in self.jobs:
            raise await self.runs.unknown(job)
        raise NotLeader(job, await self._leader_address(job))

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

    async def open_session(self, first: pb.NodeFrame) -> SessionPort:
        """The port of a node's Session stream, by its first frame: the job's leader on this replica,
        or the relay of a job led elsewhere. A node of a job this replica never heard of (etcd lost
        the job, and this replica started since) says on its first frame who it was: the job is
        created from that as its Join did (a forged claim creates none) and its election awaited, so
        that the node is taken back rather than told it is no member (which ends its agent)."""
        try:
            if first.job not in self.jobs and first.HasField("rejoin"):
                check_claim(first, self.member_keys(), int(time.time() * 1000))
                await self.runs.refuse_ended(first.job, first.run)
                await self._create_job(first.job, wire.spec_of(first.rejoin.spec))
                await self.elections.wait(first.job)
            leader = await self.leader_for(first.job, first.run)  # (a node of a run that ended: how it ended)
        except NotLeader as exc:
            # Relayed where this replica relays and the node picked it as its relay, and (with
            # tokens) its secret proves it: what a relay carries shares one budget at the leader
            # with the job's real nodes (a real node that joined before the key goes direct).
            keys = self.member_keys()
            if (not (self.config.relay and first.via_relay) or self.campaigns.closing
                    or keys is not None and keys.verify(first.session_secret, first.job, first.run, first.node_id,
                                                        first.member_id) is None):
                raise
            return RelayPort(self.relays.of(first.job, exc.leader))
        return LeaderPort(leader)

    async def open_relay(self, first: pb.RelayUp) -> RelayCall:
        """The port of a replica's Relay call, by its first message: only at the job's leader, and
        only for a job whose nodes were told to go through relays."""
        leader = await self.leader_for(first.job)
        if not self.relayed(leader):
            raise FailedPrecondition(f"job {first.job!r} is not relayed (fewer than --relay-min-nodes "
                                     f"{self.config.relay_min_nodes} nodes): its nodes stream to the leader")
        return RelayCall(leader, first, self.config.limits.max_frames_per_s, self.config.timing.heartbeat_timeout_s)

    async def join(self, req: pb.JoinRequest) -> pb.JoinResponse:
        wire.check_join(req)
        requested = wire.spec_of(req.spec)
        if req.job not in self.leaders:
            if req.job not in self.jobs:
                await self._create_job(req.job, requested)
            await self.elections.wait(req.job)
        leader = await self.leader_for(req.job)
        response = await leader.join(req, requested)
        response.relay = self.relayed(leader)
        return response

    def relayed(self, leader: JobLeader) -> bool:
        """Whether the job's nodes go through relays: decided where the job is led (a standby run with
        --no-relay refuses, and the node streams here), for a Join's answer and a Relay call alike."""
        return self.config.relay and max(len(leader.state.members), leader.state.spec.min_nodes) >= \
            self.config.relay_min_nodes

    async def _create_job(self, job: str, requested: JobSpec) -> None:
        """Create a new job once, however many of its nodes ask at once (they start together, and
        each Join finds no job while the first one's etcd write is under way): one admits it, a run
        of the name's quota; the others wait for it, and try on their own only if it failed."""
        while (pending := self._creating.get(job)) is not None:
            await asyncio.shield(pending)  # (a waiter cancelled, its Join gone, leaves it to the others)
            if job in self.jobs:
                return
        self._creating[job] = done = asyncio.get_running_loop().create_future()
        try:
            await self.runs.admit(job, requested)
            self._discovered(job)
        finally:
            del self._creating[job]
            done.set_result(None)

    async def status(self, job: str, brief: bool = False, page: status_pages.Page = status_pages.Page(),
                     run: int = 0) -> pb.StatusResponse:
        return await self.runs.status(self.address, job, brief, page, run)

    async def events(self, job: str, run: int = 0) -> pb.EventsResponse:
        return await self.runs.events(job, run)

    # ---- operator verbs --------------------------------------------------------------

    async def list_jobs(self, job: str = "") -> pb.JobsResponse:
        return await self.runs.list_jobs(self.address, job)

    async def stop_job(self, job: str, reason: str) -> pb.StopResponse:
        try:
            await self.runs.check_running(job)
        except FailedPrecondition:
            if run := await self.runs.stopped_run(job):
                return pb.StopResponse(run=run, already=True)
            raise
        return await (await self.leader_for(job)).stop_job(reason or "stopped by an operator")

    async def drain_node(self, job: str, node: str, reason: str) -> pb.DrainResponse:
        await self.runs.check_running(job)
        return await (await self.leader_for(job)).drain_node(node, reason or "drained by an operator")

    async def delete_runs(self, job: str, run: int) -> pb.DeleteResponse:
        return await self.runs.delete_runs(job, run)
