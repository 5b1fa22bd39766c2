"""Deployment churn: does a deployment that runs thousands of short jobs stay flat? Prints one JSON object.

A long-lived deployment (a real etcd and 2 `muster serve` replicas on it) runs `--jobs` short jobs,
`--concurrent` at a time. Each job is `--nodes` process nodes (JoinRequest.is_process, one slot,
min_nodes = max_nodes = nodes) which Join (following the `muster-leader` hint), open a Session
(first frame: member, secret, JoinResponse.run and a starting rank), read directives until their
Assignment (ROLE_ACTIVE), send one frame with the rank RANK_STATE_FINISHED, `Leave(finished=True)`
and close the stream. Nothing of a job should outlive it for long: if a replica's threads, memory,
election keys or jobs held, etcd's keys, or the Join latency grow with the jobs run so far, a
deployment that lives for months runs out of something (the `--max-jobs` refusal is one such end).

Measured after the first jobs (`start`), every `--checkpoint-every` jobs and at the `end`, each time
with no job in flight (new jobs wait while the running ones finish, then `--settle` seconds):
- per replica: threads and RSS (/proc/<pid>/status), CPU so far (and per job since the previous
  checkpoint), the jobs it knows and leads (its /metrics `muster_leader{job}` gauges), its open
  election keys (etcd keys under `/muster/v1/election/` holding its address) and its log's warnings
  by event (a lost etcd session shows there, and as a jump in threads: a campaign thread per job);
- etcd: keys and bytes (key + value) in all, under `/muster/` and per kind (`specs`, `state`,
  `election`, ...), its revision and its db size (`status()`);
- the window since the previous one: jobs run, completed and failed (by step and status code),
  jobs/s, Join latency (the node's Join call until answered, hints followed), a job's duration.
Then the restart check: both replicas stop (graceful), a fresh replica starts against the same etcd:
seconds from its process start to /readyz OK and to its first Join answered (a new one-node job),
and the same on an empty etcd. `flat`: end / start ratios at a glance (1.0 is flat).

`--reuse-names K` runs K names over and over (a name's next job waits for its previous one): a
finished name starts a new run. A refused Join (e.g. RESOURCE_EXHAUSTED, over `--max-jobs`) fails its job and is counted with
its code; the run goes on.

    python bench/churn.py                                 # 2000 jobs, 8 at a time, 2 nodes each
    python bench/churn.py --jobs 200 --checkpoint-every 50 --max-jobs 100000
    python bench/churn.py --jobs 2000 --reuse-names 20    # 20 names, 100 runs each
    python bench/churn.py --jobs 12 --concurrent 3 --checkpoint-every 6   # a smoke test
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import grpc

from muster import logs
from muster.client import TRANSIENT, redirect, run_ended
from muster.coordinator.etcd.client import DEFAULT_PREFIX, connect
from muster.coordinator.etcd.server import EtcdServer
from muster.local import CoordinatorProcess, end_on_sigterm, record_time
from muster.net import Backoff, free_port
from muster.v1 import muster_pb2 as pb
from muster.v1 import muster_pb2_grpc as pb_grpc

sys.path.insert(0, str(Path(__file__).parent))
from proc_cpu import cpu_seconds  # noqa: E402

ELECTION_PREFIX = f"{DEFAULT_PREFIX}/election/"  # src/muster/coordinator/etcd/election.py: {prefix}/election/{job}/{lease}
SERVE_DEFAULT_MAX_JOBS = 1_000  # `muster serve --max-jobs`'s default
CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 50), ("grpc.min_reconnect_backoff_ms", 50),
                   ("grpc.max_reconnect_backoff_ms", 200)]


def progress(message: str) -> None:
    print(f"[churn {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def ms(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"p50": round(statistics.median(values) * 1e3, 2), "p99": round(percentile(values, 0.99) * 1e3, 2),
            "max": round(max(values) * 1e3, 2), "n": len(values)}


# ---- what a replica and etcd hold ------------------------------------------------------------------


def proc_status(pid: int) -> dict:
    """Threads, RSS and CPU so far of a process, from /proc."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return {"threads": int(fields["Threads"]), "rss_mib": round(int(fields["VmRSS"].split()[0]) / 1024, 1),
            "cpu_s": round(cpu_seconds(pid), 2)}


LEADER_GAUGE = re.compile(r'^muster_leader\{job="((?:[^"\\]|\\.)*)"\} ([0-9.e+-]+)$')


def scrape_jobs(metrics: str) -> dict:
    """The jobs a replica knows (one `muster_leader{job}` gauge each) and those it leads (value 1)."""
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=30) as response:
        text = response.read().decode()
    known = led = 0
    for line in text.splitlines():
        m = LEADER_GAUGE.match(line)
        if m:
            known += 1
            led += float(m.group(2)) == 1
    return {"jobs_known": known, "jobs_led": led}


def ready(metrics: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{metrics}/readyz", timeout=1) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def etcd_usage(client) -> dict:
    """Keys and bytes (key + value) in all, under /muster/ and per kind; open election keys by
    holder (the address a candidate key holds); etcd's revision and db size."""
    response = client.get_all_response()
    total = {"keys": 0, "bytes": 0}
    muster = {"keys": 0, "bytes": 0}
    kinds: Counter = Counter()
    election_by_holder: Counter = Counter()
    for kv in response.kvs:
        key = kv.key.decode(errors="replace")
        size = len(kv.key) + len(kv.value)
        total["keys"] += 1
        total["bytes"] += size
        if key.startswith("/muster/"):
            muster["keys"] += 1
            muster["bytes"] += size
            kind = key[len(DEFAULT_PREFIX) + 1:].split("/", 1)[0] if key.startswith(DEFAULT_PREFIX + "/") else "other"
            kinds[kind] += 1
        if key.startswith(ELECTION_PREFIX):
            election_by_holder[kv.value.decode(errors="replace")] += 1
    status = client.status()
    return {"keys": total["keys"], "bytes": total["bytes"], "muster_keys": muster["keys"],
            "muster_bytes": muster["bytes"], "muster_keys_by_kind": dict(sorted(kinds.items())),
            "election_keys": sum(election_by_holder.values()), "election_keys_by_holder": dict(election_by_holder),
            "revision": response.header.revision, "db_size_bytes": status.db_size}


class Replica(CoordinatorProcess):
    """`muster serve` on free loopback ports (gRPC and /metrics), started without waiting (the
    restart check times its start)."""

    def __init__(self, etcd: str, log_path: Path, extra: list[str]):
        self.metrics = f"127.0.0.1:{free_port()}"
        super().__init__([etcd], log_path, [*extra, "--metrics-listen", self.metrics],
                         listen=f"127.0.0.1:{free_port()}")
        self.address = self.args[self.args.index("--listen") + 1]  # advertised as listened

    def launch(self) -> float:
        """Spawn it; its wall-clock start."""
        self._log = open(self.log_path, "ab")
        started = time.time()
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        return started

    def start(self, timeout_s: float = 30.0) -> Replica:
        self.launch()
        deadline = time.monotonic() + timeout_s
        while not ready(self.metrics):
            self._died()
            if time.monotonic() > deadline:
                raise AssertionError(f"replica {self.address} not ready within {timeout_s}s")
            time.sleep(0.05)
        return self

    def sample(self) -> dict:
        return {"address": self.address, "pid": self.pid, **proc_status(self.pid), **scrape_jobs(self.metrics),
                "log_warnings": self.warnings()}

    def warnings(self) -> dict:
        """Its log's warning and error records so far, by event (a lost etcd session, dropped leaderships)."""
        counts: Counter = Counter()
        with open(self.log_path, errors="replace") as f:
            for line in f:
                if line.startswith("{") and ('"warning"' in line or '"error"' in line):
                    try:
                        record = json.loads(line)
                    except ValueError:
                        continue
                    if record.get("level") in ("warning", "error", "critical"):
                        counts[record.get("event", "?")] += 1
        return dict(counts.most_common())


# ---- the jobs --------------------------------------------------------------------------------------


class NodeFailed(Exception):
    def __init__(self, step: str, code: str, detail: str = ""):
        super().__init__(f"{step}: {code} {detail}")
        self.step, self.code, self.detail = step, code, detail


class Window:
    """What happened since the last checkpoint."""

    def __init__(self):
        self.started = time.monotonic()
        self.cpu0 = time.process_time()
        self.jobs = self.completed = 0
        self.join_s: list[float] = []
        self.job_s: list[float] = []
        self.failures: Counter = Counter()  # "step:CODE" of each failed node
        self.retries: Counter = Counter()  # rpc -> transient answers retried (hints followed or backoff)
        self.stream_ends: Counter = Counter()  # how the streams ended after Leave (OK, a code, or JobEnd)

    def report(self) -> dict:
        elapsed = time.monotonic() - self.started
        return {"jobs": self.jobs, "completed": self.completed, "failed": self.jobs - self.completed,
                "elapsed_s": round(elapsed, 2), "jobs_per_s": round(self.jobs / elapsed, 2) if elapsed else None,
                "join_ms": ms(self.join_s), "job_ms": ms(self.job_s), "node_failures": dict(self.failures),
                "retries": dict(self.retries), "stream_ends": dict(self.stream_ends),
                "client_cpu_s": round(time.process_time() - self.cpu0, 2)}


class Churn:
    """The client side: every node on one event loop, one channel per replica."""

    def __init__(self, addresses: list[str], nodes: int, job_timeout_s: float, join_retry_s: float):
        self.addresses = addresses
        self.nodes = nodes
        self.job_timeout_s = job_timeout_s
        self.join_retry_s = join_retry_s
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.window = Window()
        self.total = Counter()
        self.all_failures: Counter = Counter()

    def stub(self, address: str) -> pb_grpc.CoordinatorStub:
        if address not in self._channels:
            self._channels[address] = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        return pb_grpc.CoordinatorStub(self._channels[address])

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()

    async def unary(self, rpc: str, request, prefer: str, retry_for_s: float):
        """(response, address): the job's leader answers; hints followed, transient answers retried."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + retry_for_s
        backoff = Backoff(0.02, 0.5)
        while True:
            order = [prefer] + [a for a in self.addresses if a != prefer]
            last = None
            for _ in range(len(self.addresses) + 3):
                if not order:
                    break
                address = order.pop(0)
                try:
                    return await getattr(self.stub(address), rpc)(request, timeout=10), address
                except grpc.aio.AioRpcError as exc:
                    if not redirect(exc, address, order):
                        raise
                    self.window.retries[rpc] += 1
                    last = exc
            if loop.time() >= deadline:
                raise last
            await asyncio.sleep(backoff.next())

    async def node(self, job: str, node_id: str, prefer: str) -> None:
        """One process node's life; raises NodeFailed."""
        request = pb.JoinRequest(job=job, node_id=node_id, slots=1, host="127.0.0.1", store_port=29500,
                                 spec=pb.JobSpec(min_nodes=self.nodes, max_nodes=self.nodes), agent_pid=os.getpid(),
                                 is_process=True)
        t0 = time.monotonic()
        try:
            joined, leader = await self.unary("Join", request, prefer, self.join_retry_s)
        except grpc.aio.AioRpcError as exc:
            raise NodeFailed("join", exc.code().name, exc.details() or "") from None
        self.window.join_s.append(time.monotonic() - t0)
        interval = max(joined.heartbeat_interval_ms, 20) / 1000
        term, generation = joined.term, 0

        def frame(state: int, step: int = 0, first: bool = False) -> pb.NodeFrame:
            f = pb.NodeFrame(job=job, node_id=node_id, member_id=joined.member_id, term=term, generation=generation,
                             ranks=[pb.RankReport(local_rank=0, pid=os.getpid(), step=step, state=state,
                                                  generation=generation)])
            if first:
                f.session_secret = joined.session_secret
                f.run = joined.run
                f.stream_seq = 1
            return f

        call = None
        left = False
        try:
            for attempt in range(3):  # a stream opened as the leadership moved is answered with the new leader
                call = self.stub(leader).Session()
                try:
                    await call.write(frame(pb.RANK_STATE_STARTING, first=True))
                    directive = await self._until_active(call, interval, frame)
                    generation, term = directive.assignment.generation, directive.term or term
                    break
                except grpc.aio.AioRpcError as exc:
                    hint = [v for k, v in (exc.trailing_metadata() or ()) if k == "muster-leader"]
                    if exc.code() not in TRANSIENT or attempt == 2:
                        raise NodeFailed("assignment", exc.code().name, exc.details() or "") from None
                    self.window.retries["Session"] += 1
                    call.cancel()
                    leader = hint[0] if hint else leader
                    await asyncio.sleep(0.05)
            try:
                await call.write(frame(pb.RANK_STATE_FINISHED, step=1))
                ended_first = False
            except grpc.aio.AioRpcError:
                # grpc aio's INTERNAL for a write to a stream the replica ended first (the run ended as the
                # other node's finish was tallied, or the leadership moved): the Leave below hears which
                self.window.stream_ends["ended_before_its_finish"] += 1
                ended_first = True
            try:
                await self.unary("Leave", pb.LeaveRequest(job=job, node_id=node_id, member_id=joined.member_id,
                                                          finished=True, reason="churn: done",
                                                          session_secret=joined.session_secret),
                                 leader, 5.0)
                left = True
            except grpc.aio.AioRpcError as exc:
                # Its run ended succeeded between this node's last frame and its Leave (the other node's
                # finish was tallied first): nothing left to leave, as a real agent takes it.
                ended = run_ended(exc)
                if ended is None or ended.outcome != "succeeded":
                    raise NodeFailed("leave", exc.code().name, exc.details() or "") from None
                left = True
            # Closed from this end after leaving (a process node's stream closing before it left is its exit).
            if not ended_first:
                await self._close(call)
        finally:
            if call is not None:
                call.cancel()
            if not left:  # failed or cancelled midway: out of the job at once
                try:
                    await asyncio.shield(self.unary("Leave", pb.LeaveRequest(
                        job=job, node_id=node_id, member_id=joined.member_id, immediate=True,
                        reason="churn: failed", session_secret=joined.session_secret), leader, 2.0))
                except (grpc.aio.AioRpcError, asyncio.CancelledError):
                    pass

    async def _close(self, call) -> None:
        """A stream closed from this end, and how it ended counted."""
        try:
            await call.done_writing()
            async with asyncio.timeout(2):
                while (d := await call.read()) is not grpc.aio.EOF:
                    if d.HasField("end"):
                        self.window.stream_ends[f"JobEnd:{d.end.outcome}"] += 1
            self.window.stream_ends["OK"] += 1
        except grpc.aio.AioRpcError as exc:
            self.window.stream_ends[exc.code().name] += 1
        except TimeoutError:
            self.window.stream_ends["open_2s_after_leave"] += 1

    async def _until_active(self, call, interval: float, frame) -> pb.Directive:
        """Read directives until this node's ROLE_ACTIVE assignment, writing a frame every heartbeat
        interval meanwhile (a silent node is lost). Raises NodeFailed, or AioRpcError as refused."""
        stop = asyncio.Event()

        async def beat() -> None:
            while not stop.is_set():
                try:
                    await asyncio.wait_for(stop.wait(), interval)
                except TimeoutError:
                    try:
                        await call.write(frame(pb.RANK_STATE_STARTING))
                    except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                        return

        beating = asyncio.create_task(beat())
        try:
            while True:
                directive = await call.read()
                if directive is grpc.aio.EOF:
                    raise NodeFailed("assignment", "EOF", "the stream ended before an assignment")
                if directive.HasField("end"):
                    raise NodeFailed("assignment", "JobEnd", directive.end.outcome)
                if directive.HasField("assignment"):
                    if directive.assignment.role == pb.ROLE_ACTIVE:
                        return directive
                    if directive.assignment.role == pb.ROLE_EVICTED:
                        raise NodeFailed("assignment", "EVICTED", directive.assignment.reason)
        finally:
            stop.set()
            await beating

    async def job(self, name: str, prefer: str) -> None:
        t0 = time.monotonic()
        tasks = [asyncio.create_task(self.node(name, f"node-{k}", prefer)) for k in range(self.nodes)]
        failures = []
        try:
            async with asyncio.timeout(self.job_timeout_s):
                for done in asyncio.as_completed(tasks):
                    try:
                        await done
                    except NodeFailed as exc:
                        failures.append(f"{exc.step}:{exc.code}")
                        for t in tasks:  # its siblings would wait for a map that never forms
                            t.cancel()
                    except asyncio.CancelledError:
                        if not failures:
                            raise
        except TimeoutError:
            failures.append("job:TIMEOUT")
            for t in tasks:
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.window.jobs += 1
        self.total["jobs"] += 1
        if failures:
            self.window.failures.update(failures)
            self.all_failures.update(failures)
            if len(self.all_failures) <= 3 and sum(self.all_failures.values()) <= 3:
                progress(f"job {name} failed: {failures}")
        else:
            self.window.completed += 1
            self.total["completed"] += 1
            self.window.job_s.append(time.monotonic() - t0)


# ---- the run ---------------------------------------------------------------------------------------


def measure(label: str, done: int, began: float, window: Window, replicas: list[Replica], etcd_client) -> dict:
    point = {"label": label, "jobs_done": done, "elapsed_s": round(time.monotonic() - began, 2),
             "window": window.report(), "replicas": [], "etcd": etcd_usage(etcd_client)}
    holders = point["etcd"]["election_keys_by_holder"]
    for r in replicas:
        point["replicas"].append({**r.sample(), "election_keys": holders.get(r.address, 0)})
    return point


async def churn_run(args, replicas: list[Replica], etcd_client) -> tuple[list[dict], Counter]:
    addresses = [r.address for r in replicas]
    churn = Churn(addresses, args.nodes, args.job_timeout, args.join_retry)
    names = args.reuse_names or args.jobs
    locks = [asyncio.Lock() for _ in range(min(names, args.jobs))]  # a name runs one job at a time
    marks = sorted({min(args.start_after, args.jobs), *range(args.checkpoint_every, args.jobs,
                                                             args.checkpoint_every), args.jobs})
    checkpoints: list[dict] = []
    began = time.monotonic()
    slots = asyncio.Semaphore(args.concurrent)
    loop = asyncio.get_running_loop()

    async def one(i: int) -> None:
        try:
            async with locks[i % names]:
                await churn.job(f"churn-{i % names:06d}", addresses[i % len(addresses)])
        finally:
            slots.release()

    i = 0
    try:
        for mark in marks:
            running = []
            while i < mark:
                await slots.acquire()
                running.append(asyncio.create_task(one(i)))
                i += 1
            await asyncio.gather(*running)  # nothing in flight while measuring
            await asyncio.sleep(args.settle)
            label = "end" if mark == args.jobs else "start" if not checkpoints else "checkpoint"
            point = await loop.run_in_executor(None, measure, label, mark, began, churn.window, replicas, etcd_client)
            if checkpoints:  # the replicas' CPU between the two checkpoints, per job run meanwhile
                for now, before in zip(point["replicas"], checkpoints[-1]["replicas"]):
                    now["cpu_ms_per_job"] = round((now["cpu_s"] - before["cpu_s"]) * 1e3 / point["window"]["jobs"], 1)
            checkpoints.append(point)
            churn.window = Window()
            w, e = point["window"], point["etcd"]
            progress(f"{label} after {mark} jobs ({point['elapsed_s']:.0f}s): {w['completed']}/{w['jobs']} "
                     f"completed, join p50 {w['join_ms'] and w['join_ms']['p50']} ms, etcd {e['muster_keys']} keys, "
                     + ", ".join(f"{r['address']}: {r['threads']} threads {r['rss_mib']} MiB "
                                 f"{r['jobs_known']} jobs {r['election_keys']} election keys"
                                 for r in point["replicas"]))
    finally:
        await churn.close()
    return checkpoints, churn.all_failures


def timed_start(etcd: str, log_path: Path, extra: list[str], timeout_s: float, settle_s: float,
                etcd_client) -> dict:
    """A fresh replica: seconds from its process start to /readyz OK, to `coordinator_serving` in its
    log and to its first Join answered (a new one-node job; answered: a response or a final refusal)."""
    replica = Replica(etcd, log_path, extra)
    result: dict = {}
    try:
        started = replica.launch()
        t0 = time.monotonic()

        def poll_ready() -> None:
            while time.monotonic() - t0 < timeout_s and replica.proc.poll() is None:
                if ready(replica.metrics):
                    result["readyz_s"] = round(time.monotonic() - t0, 3)
                    return
                time.sleep(0.01)

        def first_join() -> None:
            request = pb.JoinRequest(job="restart-probe", node_id="probe", slots=1, host="127.0.0.1",
                                     store_port=29500, spec=pb.JobSpec(min_nodes=1, max_nodes=1), is_process=True)
            with grpc.insecure_channel(replica.address, options=CHANNEL_OPTIONS) as channel:
                stub = pb_grpc.CoordinatorStub(channel)
                attempts = 0
                while time.monotonic() - t0 < timeout_s and replica.proc.poll() is None:
                    attempts += 1
                    try:
                        stub.Join(request, timeout=5)
                        code = "OK"
                    except grpc.RpcError as exc:
                        if exc.code() in TRANSIENT:
                            time.sleep(0.01)
                            continue
                        code = exc.code().name
                    result["first_join_s"] = round(time.monotonic() - t0, 3)
                    result["first_join_code"] = code
                    result["join_attempts"] = attempts
                    return

        threads = [threading.Thread(target=poll_ready), threading.Thread(target=first_join)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if replica.proc.poll() is not None:
            result["exited"] = replica.proc.returncode
            return result
        serving = replica.find("coordinator_serving")
        if serving:
            result["serving_s"] = round(record_time(serving[0]) - started, 3)
        time.sleep(settle_s)
        result["after_settle"] = {**replica.sample(),
                                  "election_keys": etcd_usage(etcd_client)["election_keys_by_holder"].get(
                                      replica.address, 0)}
        return result
    finally:
        t = time.monotonic()
        replica.stop(timeout_s=30)
        result["stop_s"] = round(time.monotonic() - t, 3)


def restart_check(workdir: Path, etcd: EtcdServer, etcd_client, replicas: list[Replica], extra: list[str],
                  settle_s: float) -> dict:
    stops = []
    for r in replicas:
        t = time.monotonic()
        r.stop(timeout_s=60)
        stops.append(round(time.monotonic() - t, 3))
    progress(f"restart check: replicas stopped in {stops} s; a fresh one on the same etcd")
    check = {"stop_s": stops, "same_etcd": timed_start(etcd.endpoint, workdir / "restart-same.log", extra, 120,
                                                       settle_s, etcd_client)}
    progress(f"same etcd: {check['same_etcd']}")
    empty = EtcdServer(workdir / "etcd-empty").start()
    empty_client = connect([empty.endpoint])
    try:
        check["empty_etcd"] = timed_start(empty.endpoint, workdir / "restart-empty.log", extra, 120, settle_s,
                                          empty_client)
    finally:
        empty_client.close()
        empty.stop()
    progress(f"empty etcd: {check['empty_etcd']}")
    return check


def ratio(end, start) -> float | None:
    return round(end / start, 2) if start else None


def flat(checkpoints: list[dict]) -> dict:
    """end / start of the deployment's totals (over both replicas), and of the Join p50."""
    first, last = checkpoints[0], checkpoints[-1]

    def total(point, key):
        return sum(r[key] for r in point["replicas"])

    def most(point, key):
        return max(r[key] for r in point["replicas"])

    # The Join's base is the first full window too: a new job's election waits 0.1 s per job its
    # replica leads already (up to 5: replica.py's balance delay), so the first jobs join faster.
    base = checkpoints[1] if len(checkpoints) > 2 else first
    join = [(p["window"]["join_ms"] or {}).get("p50") for p in (base, last)]
    out = {
        "jobs_done": [first["jobs_done"], last["jobs_done"]],
        "threads": ratio(total(last, "threads"), total(first, "threads")),
        "rss": ratio(total(last, "rss_mib"), total(first, "rss_mib")),
        "election_keys": ratio(last["etcd"]["election_keys"], first["etcd"]["election_keys"]),
        "jobs_held": ratio(most(last, "jobs_known"), most(first, "jobs_known")),
        "join_p50": ratio(join[1], join[0]) if None not in join else None,
        "join_p50_ms": [(p["window"]["join_ms"] or {}).get("p50") for p in checkpoints],
        "etcd_muster_keys": ratio(last["etcd"]["muster_keys"], first["etcd"]["muster_keys"]),
        "etcd_db_size": ratio(last["etcd"]["db_size_bytes"], first["etcd"]["db_size_bytes"]),
    }
    if len(checkpoints) > 2:  # the first window with a CPU figure (the one after `start`) against the last
        cpu = [sum(r["cpu_ms_per_job"] for r in p["replicas"]) for p in (checkpoints[1], last)]
        out["replica_cpu_per_job"] = ratio(cpu[1], cpu[0])
    out["definition"] = ("end / start (the `start` checkpoint is after the first jobs): threads and RSS summed over "
                         "the replicas, jobs held = the most any replica knows, election keys and /muster/ keys in "
                         "etcd, etcd's db size; the Join p50 and the replicas' CPU per job of the last window over "
                         "the second's (the first full one; the first jobs' elections wait less); ~1.0 is flat, "
                         f"growth with jobs_done shows as ~{last['jobs_done'] / max(1, first['jobs_done']):.0f}")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=2000, help="short jobs to run (default %(default)s)")
    p.add_argument("--concurrent", type=int, default=8, help="jobs in flight at once (default %(default)s)")
    p.add_argument("--nodes", type=int, default=2, help="process nodes per job (default %(default)s)")
    p.add_argument("--reuse-names", type=int, default=0, metavar="K",
                   help="cycle K job names (a name's next job waits for its previous one); default: a name per job")
    p.add_argument("--checkpoint-every", type=int, default=500, help="jobs between checkpoints (default %(default)s)")
    p.add_argument("--start-after", type=int, default=10,
                   help="jobs before the `start` checkpoint (default %(default)s)")
    p.add_argument("--settle", type=float, default=1.0,
                   help="seconds between the last job of a checkpoint ending and its measures (default %(default)s)")
    p.add_argument("--retain-finished", metavar="VALUE", help="passed to `muster serve --retain-finished` (if given)")
    p.add_argument("--max-jobs", type=int, help="passed to `muster serve --max-jobs` (if given; serve's default is "
                                                f"{SERVE_DEFAULT_MAX_JOBS}: a coordinator that counts finished jobs "
                                                "refuses the rest of a longer run)")
    p.add_argument("--heartbeat-timeout", type=float, default=3.0,
                   help="the replicas' heartbeat timeout and grace (the interval is a tenth); default %(default)s s")
    p.add_argument("--session-ttl", type=int, default=3,
                   help="the replicas' etcd lease TTL (default %(default)s s: serve's own, not the tests' 2 s)")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="one more `muster serve` argument (repeatable; `--serve-arg=--flag`)")
    p.add_argument("--job-timeout", type=float, default=60.0, help="a job not done by then fails (seconds)")
    p.add_argument("--join-retry", type=float, default=15.0,
                   help="seconds a node retries a transient Join answer (e.g. a name's previous run draining)")
    p.add_argument("--skip-restart", action="store_true", help="no restart check")
    p.add_argument("--workdir", type=Path, help="keep etcd's data and the logs here (default: a temporary directory)")
    args = p.parse_args()
    if min(args.jobs, args.concurrent, args.nodes, args.checkpoint_every, args.start_after) < 1 or args.reuse_names < 0:
        p.error("--jobs, --concurrent, --nodes, --checkpoint-every and --start-after must be at least 1")
    logs.configure("warning")
    timeout = args.heartbeat_timeout
    extra = ["--heartbeat-interval", str(timeout / 10), "--heartbeat-timeout", str(timeout), "--grace", str(timeout),
             "--session-ttl", str(args.session_ttl), *(["--max-jobs", str(args.max_jobs)] if args.max_jobs else []),
             *(["--retain-finished", args.retain_finished] if args.retain_finished else []),
             # a deployment's churn, not one tenant's: a reused name starts runs past --max-runs-per-hour
             "--max-runs-per-hour", "1000000", *args.serve_arg]
    result = {
        "benchmark": "churn",
        "host": {"cpus": os.cpu_count(), "loadavg_at_start": [round(x, 2) for x in os.getloadavg()]},
        "parameters": {"jobs": args.jobs, "concurrent": args.concurrent,
                       "effective_concurrent": min(args.concurrent, args.reuse_names or args.concurrent),
                       "nodes_per_job": args.nodes, "reuse_names": args.reuse_names or None,
                       "checkpoint_every": args.checkpoint_every, "start_after": args.start_after,
                       "settle_s": args.settle, "retain_finished": args.retain_finished, "max_jobs": args.max_jobs,
                       "replicas": 2, "serve_args": extra},
        "note": ("one machine: etcd, both replicas and this client (every node on one event loop) share its "
                 f"{os.cpu_count()} cores; each checkpoint is taken with no job in flight"),
    }
    wall0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="muster-churn-") as d:
        workdir = args.workdir or Path(d)
        workdir.mkdir(parents=True, exist_ok=True)
        etcd = EtcdServer(workdir / "etcd").start()
        etcd_client = connect([etcd.endpoint], timeout_s=30)
        replicas: list[Replica] = []
        try:
            for k in range(2):
                replicas.append(Replica(etcd.endpoint, workdir / f"replica-{k}.log", extra).start())
            progress(f"etcd {etcd.endpoint}, replicas {[r.address for r in replicas]}; {args.jobs} jobs")
            checkpoints, failures = asyncio.run(churn_run(args, replicas, etcd_client))
            result["checkpoints"] = checkpoints
            result["totals"] = {
                "jobs": sum(p["window"]["jobs"] for p in checkpoints),
                "completed": sum(p["window"]["completed"] for p in checkpoints),
                "node_failures": dict(failures),
                "churn_s": checkpoints[-1]["elapsed_s"],
            }
            result["flat"] = flat(checkpoints)
            if not args.skip_restart:
                result["restart"] = restart_check(workdir, etcd, etcd_client, replicas, extra, args.settle)
        finally:
            for r in replicas:
                r.stop()
            etcd_client.close()
            etcd.stop()
    result["wall_s"] = round(time.monotonic() - wall0, 1)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    end_on_sigterm()
    sys.exit(main())
