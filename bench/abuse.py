"""What a token holder (or a replica's stolen relay token) can cost a replica (security reviews 3
and 4). Prints one JSON object.

A real etcd and one `muster serve --tokens` replica (tokens for jobs A and B, an operator's and the
replicas' `@relay`), relaying every job (`--relay-min-nodes 1`: the worst case, every job's relay
budget open to a Relay caller). Job B: `--nodes` simulated nodes stepping; job A: one node, so that
the replica leads A. The flood (review 3, F1): one Relay call for job A, with the relay token, of
`--messages` messages of `--frames` frames each (~0.95 MB at 46,000), every frame on a fresh
stream number and naming job A's node without its secret, the replies never read.

Measured: the replica's RSS (VmRSS, every 50 ms) before, at its peak and after the flood; the event
loop it held, as the latency of a brief Status of job B asked every 20 ms on a channel of its own
(every job's RPCs wait behind what holds the loop); job B's generation (it must not change) and its
nodes' steps before and during the flood; how the flood call ended as its caller saw it (its status,
and the messages its flow control let through) and as the replica logged it (`relay_refused`).

Then review 4's attacks, one after another (`attacks`), each with what it cost the replica (peak
RSS growth, CPU seconds, log bytes written) and what it did to job B: many unread Relay calls (N3),
job A's token holding idle Sessions while a node of job B joins from the same host (N2), a Join
flood with job A's token (N4), and forged rebuild claims of job A's member (N1: refused, nothing
taken).

Then review 5's floods on the etcd every job shares (H2), each with etcd's db growth and writes
(revisions): `etcd_join_flood`, job C's token Joining 64 at a time for `--etcd-flood` seconds as a job
that asks for 125,000 nodes, with 128-character node ids; `run_flood`, job D's token cycling runs
(Join, then Leave immediate: the run fails) as fast as it can for as long, and the runs it keeps.

And review 5's L1 on the page's port (`page_port`): `--idle-http` connections that each send half
a request line and nothing more, with the replica's threads and RSS at their peak, and when the
port closed them. Last, review 5's H1 (`store_planting`): bench/store_planting.py's trials
(`--store-planting-trials`).

    python bench/abuse.py                       # 8 x 46,000 frames, 30 s
    python bench/abuse.py --messages 2 --frames 20000 --duration 5   # a smoke test
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import selectors
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import grpc

from muster import logs
from muster.coordinator.core.policy import Limits
from muster.coordinator.etcd.server import EtcdServer
from muster.local import CoordinatorProcess, SimulatedNode, end_on_sigterm, process_alive
from muster.security import ClientSecurity
from muster.v1 import muster_pb2 as pb
from muster.v1 import muster_pb2_grpc as pb_grpc

import store_planting  # noqa: E402  (bench/, the script's own directory)

RELAY_METHOD = "/muster.v1.Coordinator/Relay"


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def flood_messages(job: str, node_id: str, messages: int, frames: int) -> list[bytes]:
    """Each frame on a fresh stream number, naming the job and a real node of it without its secret:
    each costs the leader a refused attach (PERMISSION_DENIED) and a reply."""
    out, stream = [], 0
    for _ in range(messages):
        up = pb.RelayUp(job=job, relay="flood")
        for _ in range(frames):
            stream += 1
            up.frames.add(stream=stream, frame=pb.NodeFrame(job=job, node_id=node_id, member_id=1))
        out.append(up.SerializeToString())
    return out


TOKENS = {"job-a": secrets.token_hex(16), "job-b": secrets.token_hex(16), "job-c": secrets.token_hex(16),
          "job-d": secrets.token_hex(16), "*": secrets.token_hex(16), "@relay": secrets.token_hex(16)}


def bearer(role: str) -> tuple:
    return (("authorization", f"Bearer {TOKENS[role]}"),)


class Flood:
    """One Relay call in a thread of its own, its replies never read. `sent`: messages the replica's
    flow control let through (taken off the iterator)."""

    def __init__(self, address: str, messages: list[bytes]):
        self.messages, self.sent = messages, 0
        self._channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 4 << 20)])
        self.call = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _requests(self):
        for message in self.messages:
            yield message
            self.sent += 1

    def _run(self) -> None:
        relay = self._channel.stream_stream(RELAY_METHOD, request_serializer=None, response_deserializer=None)
        self.call = relay(self._requests(), metadata=bearer("@relay"))

    def start(self) -> Flood:
        self.thread.start()
        return self

    def end(self) -> dict:
        """How the call ended: by the replica (its status) or, still open, cancelled here."""
        self.thread.join(5)
        ended = self.call is not None and self.call.done()
        code = self.call.code().name if ended else "still open (cancelled by the client)"
        details = self.call.details() if ended else ""
        if self.call is not None:
            self.call.cancel()
        self._channel.close()
        return {"messages_taken": self.sent, "ended_by_replica": ended, "status": code, "details": details[:200]}


async def probe_loop(address: str, job: str, stop: asyncio.Event, latencies: list[float]) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        while not stop.is_set():
            began = time.perf_counter()
            await stub.Status(pb.StatusRequest(job=job, brief=True), timeout=30, metadata=bearer(job))
            latencies.append(time.perf_counter() - began)
            await asyncio.sleep(0.02)


async def sample_rss(pid: int, stop: asyncio.Event, samples: list[float]) -> None:
    while not stop.is_set():
        samples.append(rss_mib(pid))
        await asyncio.sleep(0.05)


def ms(values: list[float]) -> dict:
    ordered = sorted(values)
    p99 = ordered[int(0.99 * (len(ordered) - 1))]
    return {"p50": round(statistics.median(ordered) * 1e3, 2), "p99": round(p99 * 1e3, 2),
            "max": round(ordered[-1] * 1e3, 2), "n": len(ordered)}


async def scenario(replica: CoordinatorProcess, args) -> dict:
    address, pid = replica.address, replica.pid
    messages = flood_messages("job-a", "a0", args.messages, args.frames)  # before the nodes: it takes seconds
    b_nodes = [SimulatedNode([address], "job-b", f"b{i}", slots=1, security=ClientSecurity(TOKENS["job-b"]),
                             spec=pb.JobSpec(min_nodes=args.nodes, max_nodes=args.nodes + 1))
               for i in range(args.nodes)]
    a_node = SimulatedNode([address], "job-a", "a0", slots=1, spec=pb.JobSpec(min_nodes=1, max_nodes=1),
                           security=ClientSecurity(TOKENS["job-a"]))
    for node in [*b_nodes, a_node]:
        await node.join()
        node.start()
    for node in [*b_nodes, a_node]:
        await node.wait_for(lambda n: n.assignment().role == pb.ROLE_ACTIVE, 20, "a place")
    generation = b_nodes[0].generation

    stop = asyncio.Event()
    baseline: list[float] = []
    latencies_before: list[float] = []
    tasks = [asyncio.create_task(sample_rss(pid, stop, baseline)),
             asyncio.create_task(probe_loop(address, "job-b", stop, latencies_before))]
    steps_at = [n.step for n in b_nodes]
    await asyncio.sleep(args.baseline)
    stop.set()
    await asyncio.gather(*tasks)
    steps_before = [n.step - s for n, s in zip(b_nodes, steps_at)]

    stop = asyncio.Event()
    during: list[float] = []
    latencies: list[float] = []
    tasks = [asyncio.create_task(sample_rss(pid, stop, during)),
             asyncio.create_task(probe_loop(address, "job-b", stop, latencies))]
    steps_at = [n.step for n in b_nodes]
    flood = Flood(address, messages).start()
    await asyncio.sleep(args.duration)
    stop.set()
    await asyncio.gather(*tasks)
    steps_during = [n.step - s for n, s in zip(b_nodes, steps_at)]
    call = await asyncio.to_thread(flood.end)
    await asyncio.sleep(args.settle)
    after = rss_mib(pid)
    generations = sorted({n.generation for n in b_nodes})
    attacks = {}
    for name, attack in (("relay_calls", relay_calls), ("idle_sessions", idle_sessions), ("join_flood", join_flood),
                         ("forged_claims", forged_claims), ("etcd_join_flood", etcd_join_flood),
                         ("run_flood", run_flood)):
        cost, before = Cost(replica), {n.generation for n in b_nodes}
        attacks[name] = {**await attack(address, a_node, b_nodes, args), **await cost.end(args.settle)}
        # (idle_sessions' own node of job B joins it: a planned generation of B's, none of the attack's)
        attacks[name]["other_job"] = {"new_generation": {n.generation for n in b_nodes} != before,
                                      "errors": sum(len(n.errors) for n in b_nodes)}
    for node in [*b_nodes, a_node]:
        await node.stop()
    start = statistics.median(baseline)
    # The replica's side: a refusal behind replies the caller never read reaches it only if it reads.
    refused = [{"code": r["code"], "error": r["error"][:200]} for r in replica.find("relay_refused")]
    return {
        "flood": {"messages": args.messages, "frames_per_message": args.frames,
                  "message_bytes": len(messages[0]), "duration_s": args.duration, **call,
                  "refused_by_replica": refused},
        "replica_rss_mib": {"before": round(start, 1), "peak": round(max(during), 1), "after": round(after, 1),
                            "peak_growth": round(max(during) - start, 1), "growth_after": round(after - start, 1)},
        "loop_held_ms": {"status_latency_before": ms(latencies_before), "status_latency_during": ms(latencies)},
        "other_job": {"generation_before": generation, "generations_after": generations,
                      "new_generation": generations != [generation],
                      "steps_per_node_before": steps_before, "steps_per_node_during": steps_during,
                      "baseline_s": args.baseline, "errors": sum(len(n.errors) for n in b_nodes)},
        "attacks": attacks,
    }


class Cost:
    """What the replica spent from now to `end`: peak RSS growth, CPU seconds, log bytes."""

    def __init__(self, replica: CoordinatorProcess):
        self.pid, self.log_path = replica.pid, replica.log_path
        self.rss, self.cpu, self.log_bytes = rss_mib(self.pid), cpu_s(self.pid), self.log_path.stat().st_size
        self.stop, self.samples = asyncio.Event(), [self.rss]
        self.sampler = asyncio.create_task(sample_rss(self.pid, self.stop, self.samples))

    async def end(self, settle_s: float) -> dict:
        await asyncio.sleep(settle_s)  # refusals still counted are logged a second after their first
        self.stop.set()
        await self.sampler
        return {"replica": {"rss_peak_growth_mib": round(max(self.samples) - self.rss, 1),
                            "cpu_s": round(cpu_s(self.pid) - self.cpu, 2),
                            "log_bytes": self.log_path.stat().st_size - self.log_bytes}}


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


async def ended(call, within_s: float = 10.0) -> str:
    """How a call ended (its status's name), or "open" if it had not by `within_s`."""
    try:
        await asyncio.wait_for(call.code(), within_s)
    except TimeoutError:
        call.cancel()
        return "open"
    return (await call.code()).name


async def quiet(stop: asyncio.Event, *messages):
    for message in messages:
        yield message
    await stop.wait()


async def relay_calls(address: str, a_node, b_nodes, args) -> dict:
    """N3: `--relay-calls` Relay calls for job A with the relay token, each one message of 1,024
    refused attaches, their replies never read; those the replica leaves open past its per-peer limit
    (or 30 s) are cancelled."""
    up = pb.RelayUp(job="job-a", relay="flood")
    for stream in range(1, 1025):
        up.frames.add(stream=stream, frame=pb.NodeFrame(job="job-a", node_id="a0", member_id=1))
    stop = asyncio.Event()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        calls = [stub.Relay(quiet(stop, up), metadata=bearer("@relay")) for _ in range(args.relay_calls)]
        # (30 s: at half speed, a 25-minute suite, 9 were still open at 10 s; the wait ends once the rest are)
        codes = await all_but_ended(calls, Limits().relay_calls, within_s=30.0)
        stop.set()
    return {"calls": args.relay_calls, "attaches_per_call": 1024, "ended": dict(Counter(codes))}


async def all_but_ended(calls, held: int, within_s: float) -> list[str]:
    """How each call ended (its status's name), waiting until no more than `held` are open or
    `within_s` passed; those still open then are cancelled and read "open". (A busy host refuses a
    flood slower: what is measured is what the replica leaves open, not how fast it refuses.)"""
    codes = [asyncio.ensure_future(call.code()) for call in calls]
    deadline = asyncio.get_running_loop().time() + within_s
    while (open_ := [c for c in codes if not c.done()]) and len(open_) > held:
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            break
        await asyncio.wait(open_, timeout=left, return_when=asyncio.FIRST_COMPLETED)
    ended = [code.result().name if code.done() else "open" for code in codes]
    for call, code in zip(calls, codes):
        if not code.done():
            call.cancel()
            code.cancel()
    return ended


async def idle_sessions(address: str, a_node, b_nodes, args) -> dict:
    """N2: job A's token opens `--idle-sessions` Sessions that send nothing, from the host job B's
    nodes share; a new node of job B joins and streams meanwhile."""
    stop = asyncio.Event()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        calls = [stub.Session(quiet(stop), metadata=bearer("job-a")) for _ in range(args.idle_sessions)]
        pending = asyncio.gather(*(ended(c, 15.0) for c in calls))
        await asyncio.sleep(0.5)
        began = time.perf_counter()
        late = SimulatedNode([address], "job-b", "b-late", slots=1, security=ClientSecurity(TOKENS["job-b"]),
                             spec=pb.JobSpec(min_nodes=args.nodes, max_nodes=args.nodes + 1))
        await late.join()
        late.start()
        await late.wait_for(lambda n: n.assignment().role != pb.ROLE_UNSPECIFIED, 10, "an assignment")
        took = time.perf_counter() - began
        codes = await pending
        stop.set()
        await late.session.leave(immediate=True, reason="measured")
        await late.stop()
    return {"sessions": args.idle_sessions, "ended": dict(Counter(codes)),
            "other_jobs_node_joined_and_placed_s": round(took, 3), "its_errors": len(late.errors)}


async def join_flood(address: str, a_node, b_nodes, args) -> dict:
    """N4: job A's token Joins `--joins` nodes as fast as it can (job A: max_nodes 1)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)

        async def join(i: int) -> str:
            try:
                await stub.Join(pb.JoinRequest(job="job-a", node_id=f"spam-{i}", slots=1, host="127.0.0.1",
                                               store_port=29500), metadata=bearer("job-a"), timeout=10)
            except grpc.aio.AioRpcError as exc:
                return exc.code().name
            return "OK"

        began = time.perf_counter()
        codes = [await join(i) for i in range(args.joins)]
        took = time.perf_counter() - began
    return {"joins": args.joins, "took_s": round(took, 2), "answered": dict(Counter(codes))}


async def forged_claims(address: str, a_node, b_nodes, args) -> dict:
    """N1: job A's token claims to be job A's real member (its node and member id, another host)
    and the same member under a node id of its own, at generations 1 and 2^32: no rebuild is on, and
    none proves itself (the real node streams on)."""
    stop = asyncio.Event()
    frames = [pb.NodeFrame(job="job-a", node_id=node, member_id=a_node.member_id, generation=generation, run=1,
                           session_secret=b"s" * 32, rejoin=pb.JoinRequest(job="job-a", node_id=node, slots=4,
                                                                           host="10.6.6.6", store_port=29500))
              for node in ("a0", "evil") for generation in (1, 2**32)]
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        codes = [await ended(stub.Session(quiet(stop, f), metadata=bearer("job-a"))) for f in frames]
        stop.set()
    return {"claims": len(frames), "ended": dict(Counter(codes)), "real_node_errors": len(a_node.errors),
            "real_node_role": pb.Role.Name(a_node.assignment().role)}


def etcd_db(endpoint: str) -> tuple[int, int]:
    """etcd's db size (bytes) and revision (one a write)."""
    from muster.coordinator.etcd.client import connect

    client = connect([endpoint])
    try:
        revision = client.get_prefix_response("/", keys_only=True, limit=1).header.revision
        return client.status().db_size, revision
    finally:
        client.close()


def etcd_growth(endpoint: str, before: tuple[int, int]) -> dict:
    size, revision = etcd_db(endpoint)
    return {"etcd": {"db_growth_mib": round((size - before[0]) / 2**20, 2), "writes": revision - before[1]}}


def refusal_counts(codes: list[str]) -> dict:
    """Answers by code, and RESOURCE_EXHAUSTED by the quota it named (its flag)."""
    return dict(Counter(c if not c.startswith("RESOURCE_EXHAUSTED") else
                        "RESOURCE_EXHAUSTED " + next((w.strip("();,") for w in c.split() if w.startswith("(--")),
                                                     "members quota") for c in codes))


async def etcd_join_flood(address: str, a_node, b_nodes, args) -> dict:
    """H2 (probe5_quota): job C's token Joins 64 at a time for `--etcd-flood` s, asking for 125,000
    nodes, each with a fresh 128-character node id."""
    before = etcd_db(args.etcd)
    spec = pb.JobSpec(min_nodes=1, max_nodes=125_000)
    codes: list[str] = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        deadline = time.monotonic() + args.etcd_flood

        async def joiner(k: int) -> None:
            i = 0
            while time.monotonic() < deadline:
                i += 1
                try:
                    await stub.Join(pb.JoinRequest(job="job-c", node_id=f"{k:03d}-{i:08d}-".ljust(128, "x"), slots=8,
                                                   host="127.0.0.1", store_port=29500, spec=spec),
                                    metadata=bearer("job-c"), timeout=10)
                    codes.append("OK")
                except grpc.aio.AioRpcError as exc:
                    codes.append(f"{exc.code().name} {exc.details()}")

        await asyncio.gather(*(joiner(k) for k in range(64)))
    return {"seconds": args.etcd_flood, "joins": len(codes), "answered": refusal_counts(codes),
            **etcd_growth(args.etcd, before)}


async def run_flood(address: str, a_node, b_nodes, args) -> dict:
    """H2 (147 runs in 20 s): job D's token starts runs (a Join) and fails them (Leave immediate)
    for `--etcd-flood` s (a cycle joins the running run until a new job's takeover grace is over);
    then the runs etcd keeps of it."""
    before = etcd_db(args.etcd)
    codes: list[str] = []
    runs: set[int] = set()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        deadline = time.monotonic() + args.etcd_flood
        while time.monotonic() < deadline:
            try:
                joined = await stub.Join(pb.JoinRequest(job="job-d", node_id="d0", slots=1, host="127.0.0.1",
                                                        store_port=29500), metadata=bearer("job-d"), timeout=10)
                runs.add(joined.run)
                await stub.Leave(pb.LeaveRequest(job="job-d", node_id="d0", member_id=joined.member_id,
                                                 immediate=True, session_secret=joined.session_secret),
                                 metadata=bearer("job-d"), timeout=10)
                codes.append("OK")
            except grpc.aio.AioRpcError as exc:
                codes.append(f"{exc.code().name} {exc.details()}")
                await asyncio.sleep(0.05)  # a draining run's UNAVAILABLE: as a node retries
        await asyncio.sleep(1.0)  # the last run's end written
        kept = await stub.Jobs(pb.JobsRequest(job="job-d"), metadata=bearer("*"), timeout=10)
    return {"seconds": args.etcd_flood, "cycles": codes.count("OK"), "runs_started": len(runs),
            "answered": refusal_counts(codes),
            "runs_kept": sum(1 for j in kept.jobs if j.ended_unix_ms), **etcd_growth(args.etcd, before)}


def raft_post_as(uid: int, url: str, cwd: str) -> str:
    """POST the start of a raft message to a peer listener as `uid` (a forked child drops to it): what
    another local user gets. A unix URL's socket is relative to etcd's working directory."""
    pid = os.fork()
    if pid == 0:  # only system calls here, then _exit: nothing of the parent's threads is touched
        outcome = 3
        try:
            os.setgid(uid)
            os.setuid(uid)
            if url.startswith("unix://"):
                s = socket.socket(socket.AF_UNIX)
                s.connect(os.path.join(cwd, url.removeprefix("unix://")))
            else:
                s = socket.create_connection(tuple(url.rsplit("/", 1)[-1].rsplit(":", 1)), timeout=2)
            s.sendall(b"POST /raft HTTP/1.0\r\nContent-Length: 2\r\n\r\n\x08\x08")
            outcome = 0
        except PermissionError:
            outcome = 1
        except OSError:
            outcome = 2
        os._exit(outcome)
    _, status = os.waitpid(pid, 0)
    return ("reached", "PermissionError", "OSError", "setuid failed")[os.waitstatus_to_exitcode(status)]


def etcd_peer_port(posts: int = 100) -> dict:
    """Review 5, M1a: one raft message POSTed to the embedded etcd's peer listener (http://127.0.0.1:PORT,
    every local user's) crashed it. A `muster serve` with its embedded etcd: the peer listeners its
    cmdline names (what any local user reads), `posts` POSTs to each as `nobody` (run as root), and
    whether the etcd lived through them."""
    # Its own base, which every user may pass through (a 0700 temporary directory would refuse `nobody`
    # before the data directory's own permissions are tried).
    base = Path(tempfile.mkdtemp(prefix="muster-abuse-m1-"))
    base.chmod(0o755)
    serve = CoordinatorProcess([], base / "embedded.log", ["--data-dir", str(base / "data")]).start()
    try:
        pid = serve.find("embedded_etcd_started")[0]["pid"]
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        urls = argv[argv.index("--listen-peer-urls") + 1].split(",")
        started = time.monotonic()
        outcomes = Counter(raft_post_as(65534, url, os.readlink(f"/proc/{pid}/cwd"))
                           for url in urls for _ in range(posts)) if os.geteuid() == 0 else "skipped: not root"
        return {"peer_urls": urls, "tcp_peer_urls": [u for u in urls if not u.startswith("unix://")],
                "posts_as_nobody": dict(outcomes) if isinstance(outcomes, Counter) else outcomes,
                "seconds": round(time.monotonic() - started, 3), "etcd_alive_after": process_alive(pid),
                "etcd_restarts": len(serve.find("embedded_etcd_restarted"))}
    finally:
        serve.stop()
        shutil.rmtree(base, ignore_errors=True)


def threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("Threads:")).split()[1])


def page_port(replica: CoordinatorProcess, connections: int, watch_s: float = 30.0) -> dict:
    """L1 (probe5_web): `connections` connections to the page's port, each half a request line,
    held open: the replica's threads and RSS at their peak (was a thread each, for good), how many
    the port closed within 5 s of their connect (past its cap: at once) and the longest it held one;
    then /healthz."""
    pid, address = replica.pid, replica.find("coordinator_serving")[0]["metrics"]
    host, port = address.rsplit(":", 1)
    before_threads, before_rss = threads(pid), rss_mib(pid)
    began = time.monotonic()
    selector = selectors.DefaultSelector()
    for _ in range(connections):
        sock = socket.create_connection((host, int(port)), timeout=5)
        sock.sendall(b"GET /api/jo")
        selector.register(sock, selectors.EVENT_READ, time.monotonic())
    peak_threads, peak_rss, held_s = threads(pid), rss_mib(pid), []
    while selector.get_map() and time.monotonic() - began < watch_s:
        for key, _ in selector.select(0.2):
            try:
                data = key.fileobj.recv(1)
            except OSError:
                data = b""
            if not data:  # closed by the replica
                held_s.append(time.monotonic() - key.data)
                selector.unregister(key.fileobj)
                key.fileobj.close()
        peak_threads, peak_rss = max(peak_threads, threads(pid)), max(peak_rss, rss_mib(pid))
    still_open = len(selector.get_map())
    for key in list(selector.get_map().values()):
        key.fileobj.close()
    selector.close()
    asked = time.perf_counter()
    with urllib.request.urlopen(f"http://{address}/healthz", timeout=10) as resp:
        healthz = resp.status
    return {"connections": connections, "threads": {"before": before_threads, "peak": peak_threads},
            "rss_mib": {"before": round(before_rss, 1), "peak_growth": round(peak_rss - before_rss, 1)},
            "closed_within_5s": sum(1 for t in held_s if t < 5), "held_longest_s": round(max(held_s, default=0), 1),
            f"open_after_{watch_s:g}s": still_open,
            "healthz_after": {"status": healthz, "ms": round((time.perf_counter() - asked) * 1e3, 1)}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=8)
    parser.add_argument("--frames", type=int, default=46_000, help="frames a message (~0.95 MB at 46,000)")
    parser.add_argument("--nodes", type=int, default=3, help="nodes of the other job (B)")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds measured from the flood's start")
    parser.add_argument("--baseline", type=float, default=3.0, help="seconds measured before it")
    parser.add_argument("--settle", type=float, default=2.0, help="seconds after it, before RSS 'after'")
    parser.add_argument("--relay-calls", type=int, default=200, help="unread Relay calls (N3)")
    parser.add_argument("--idle-sessions", type=int, default=300, help="job A's idle Sessions (N2)")
    parser.add_argument("--joins", type=int, default=200, help="job A's Joins (N4)")
    parser.add_argument("--idle-http", type=int, default=600, help="idle connections to the page's port (L1)")
    parser.add_argument("--etcd-flood", type=float, default=20.0, help="seconds of each etcd flood (H2)")
    parser.add_argument("--store-planting-trials", type=int, default=3,
                        help="bench/store_planting.py's trials (review 5's H1), 0: none")
    args = parser.parse_args()
    logs.configure("warning")
    with tempfile.TemporaryDirectory(prefix="muster-abuse-") as tmp:
        workdir = Path(tmp)
        etcd = EtcdServer(workdir / "etcd").start()
        args.etcd = etcd.endpoint
        replica = None
        try:
            # Every job relayed: a Relay call for one that is not is refused at its first message.
            tokens = workdir / "tokens"
            tokens.write_text("".join(f"{job} {token}\n" for job, token in TOKENS.items()))
            tokens.chmod(0o600)
            replica = CoordinatorProcess([etcd.endpoint], workdir / "coordinator.log",
                                         ["--relay-min-nodes", "1", "--tokens", str(tokens),
                                          "--metrics-listen", "127.0.0.1:0", "--http"]).start()
            result = {"benchmark": "abuse", "host": {"cpus": os.cpu_count(), "loadavg_at_start": os.getloadavg()},
                      **asyncio.run(scenario(replica, args))}
            result["attacks"]["etcd_peer_port"] = etcd_peer_port()
            result["attacks"]["page_port"] = page_port(replica, args.idle_http)
            if args.store_planting_trials:
                result["attacks"]["store_planting"] = store_planting.run(trials=args.store_planting_trials)
        finally:
            if replica is not None:
                replica.stop()
            etcd.stop()
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    end_on_sigterm()
    sys.exit(main())
