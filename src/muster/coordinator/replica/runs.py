"""What a replica reports of its jobs' runs: the running run as its leader has it (here or, led
elsewhere, as etcd has it: the state, else the spec), the finished runs etcd retains (listed, read,
deleted), and the admission of a new job's first or next run.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Set

from muster import version
from muster.coordinator.job import status_pages
from muster.coordinator import wire
from muster.coordinator.coordination import Coordination
from muster.coordinator.core.policy import InvalidPolicy, JobSpec, Limits
from muster.coordinator.core.state import JobState, Outcome, decode, decode_spec, encode_spec
from muster.coordinator.errors import (FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, RunEnded,
                                       StoreUnavailable, Unavailable)
from muster.coordinator.job.leader import JobLeader
from muster.coordinator.metrics import JobGauges
from muster.coordinator.quotas import JobBudgets
from muster.coordinator.store import JobStorage
from muster.v1 import muster_pb2 as pb


class Runs:
    def __init__(self, store: JobStorage, coordination: Coordination, jobs: Set[str],
                 leaders: Mapping[str, JobLeader], *, default_spec: JobSpec, limits: Limits, budgets: JobBudgets):
        """`jobs` (known to be running) and `leaders` (those this replica leads) are the replica's,
        read here: the replica alone changes them."""
        self.store = store
        self.coordination = coordination
        self.jobs, self.leaders = jobs, leaders
        self.default_spec, self.limits, self.budgets = default_spec, limits, budgets

    def gauges(self) -> list[JobGauges]:
        """Every known job as a metrics scrape reports it (read at scrape time)."""
        found = []
        for job in sorted(self.jobs):
            leader = self.leaders.get(job)
            if leader is None:
                found.append(JobGauges(job, led=False))
                continue
            s = leader.state
            world = s.rank_map.world_size if s.rank_map else 0
            step_time = leader.live.median_step_time() if world else None  # (a sort of 256 floats)
            found.append(JobGauges(job, led=True, term=leader.term, generation=s.generation,
                                   live_ranks=leader.live_ranks(), world_size=world, spares=len(s.spares),
                                   stragglers=len(leader.stragglers.named),
                                   steps_per_second=round(1 / step_time, 3) if step_time else 0.0))
        return found

    async def admit(self, job: str, requested: JobSpec) -> None:
        """Create a new job's spec (its first run, or the next of a name whose runs ended), within --max-jobs
        and the name's runs an hour (a name cycled through runs costs a record each)."""
        if len(self.jobs) >= self.limits.max_jobs:
            raise ResourceExhausted(f"this deployment holds {len(self.jobs)} jobs, the most it takes "
                                    f"(--max-jobs {self.limits.max_jobs}); job {job!r} is refused")
        try:
            spec = requested.merged_over(self.default_spec).validate()
        except InvalidPolicy as exc:
            raise InvalidArgument(str(exc)) from exc
        self.budgets.of(job, self.limits.for_job(job).members_of(spec)).runs.spend()
        try:
            # A name whose runs ended starts the next run (numbered on from the retained records).
            await asyncio.to_thread(lambda: self.store.create_spec(job, encode_spec(spec, self.store.last_run(job) + 1)))
        except StoreUnavailable as exc:
            raise Unavailable(f"etcd is unavailable: {exc}") from exc

    async def unknown(self, job: str, run: int = 0) -> NotFound:
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

    async def refuse_ended(self, job: str, run: int) -> None:
        """A node's claim to be of run `run` of `job`, which this replica does not serve: refused with
        how it ended when the name's records hold that run or a later one. A run that ended is never
        rebuilt: a node's stream can come back after its run ended and its leader forgot the job
        (a leader change near the end), and taken for a lost job it made an empty run that never ended."""
        if not run:
            return
        try:
            last = await asyncio.to_thread(self.store.last_run, job)
        except StoreUnavailable as exc:
            raise Unavailable(f"etcd is unavailable: {exc}") from exc
        if last >= run:
            raise await self.unknown(job, run)

    async def check_running(self, job: str) -> None:
        wire.check_job(job)
        if job not in self.jobs:
            last = await asyncio.to_thread(self.store.last_run, job)
            raise FailedPrecondition(f"job {job!r} is not running" + (f" (its run {last} has ended)" if last else ""))

    async def stopped_run(self, job: str) -> int:
        """The latest run of `job` if it ended stopped and no run is under way (else 0): a stop repeated
        once the first took effect (its answer lost to a deadline, say) is answered, not refused."""
        if job in self.jobs:
            return 0
        try:
            state = await self._of_run(job, 0)
        except (NotFound, Unavailable):
            return 0
        return state.run if state is not None and state.outcome is Outcome.STOPPED else 0

    async def status(self, address: str, job: str, brief: bool, page: status_pages.Page, run: int) -> pb.StatusResponse:
        """The jobs' status as this replica, at `address`, reports it."""
        names = [wire.check_job(job)] if job else sorted(self.jobs)
        resp = pb.StatusResponse(replica=address, version=version())
        if job and (run or job not in self.jobs):  # a finished run, or the running one
            state = await self._of_run(job, run)
            if state is not None:
                resp.jobs.append(status_pages.job_status(state, "", 0, None, brief, page))
                return resp
        for name in names:
            leader = self.leaders.get(name)
            if leader is not None:
                resp.jobs.append(await leader.status(brief, page))
                continue
            state, (led_at, term) = await self._persisted(name)
            resp.jobs.append(status_pages.job_status(state, led_at, term, None, brief, page))
        return resp

    async def events(self, job: str, run: int = 0) -> pb.EventsResponse:
        wire.check_job(job)
        leader = self.leaders.get(job)
        state = await self._of_run(job, run) if run or job not in self.jobs else None
        if state is None:
            state = leader.state if leader is not None else (await self._persisted(job))[0]
        measured = leader.stats.recoveries if leader is not None and state is leader.state else ()
        return pb.EventsResponse(job=job, run=state.run, events=[wire.event_pb(e) for e in state.history],
                                 recoveries=measured)

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

    async def list_jobs(self, address: str, job: str = "") -> pb.JobsResponse:
        """Running jobs (each as its leader, here at `address`, or etcd has it), then retained finished
        runs, newest first."""
        if job:
            wire.check_job(job)
        try:
            finished = await asyncio.to_thread(self.store.runs, job)
        except StoreUnavailable as exc:
            raise Unavailable(f"etcd is unavailable: {exc}") from exc
        records = sorted((status_pages.job_record(name, run, json.loads(summary)) for name, run, summary in finished),
                         key=lambda r: (-r.ended_unix_ms, r.name))
        recorded = {(r.name, r.run) for r in records}
        resp = pb.JobsResponse()
        for name in sorted(self.jobs):
            if job and name != job:
                continue
            leader = self.leaders.get(name)
            if leader is not None:
                state, led_at = leader.state, address
            else:
                try:
                    state, (led_at, _) = await self._persisted(name)
                except NotFound:
                    continue  # it ended as we looked: its record is listed
            if (name, state.run) in recorded:
                continue
            rm = state.rank_map
            record = status_pages.job_record(name, state.run, {
                "outcome": state.outcome.value, "reason": state.outcome_reason, "generation": state.generation,
                "world_size": rm.world_size if rm else 0, "started_ms": state.started_ms, "ended_ms": state.ended_ms},
                led_at)
            if leader is not None:  # O(nodes) and a sort of the recent step times: a listing's, not a frame's
                step_time = leader.live.median_step_time()
                record.step, record.steps_per_second = leader.live.max_step(state), 1 / step_time if step_time else 0
            resp.jobs.append(record)
        resp.jobs.extend(records)
        return resp

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
