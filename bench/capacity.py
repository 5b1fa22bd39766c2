"""How much one leader carries. Prints one JSON object.

1. Heartbeat capacity: a real etcd and one coordinator process, driven by simulated nodes
   (Join, then the bidi Session stream of NodeFrames, written as raw HTTP/2 by `h2_nodes.RawNode`
   so that they cost the shared host little; `--grpc-clients`: the real client,
   `muster.local.SimulatedNode`) in a few client processes, at several load points (node streams x frames/s). Per point: frames/s
   offered, sent by the clients and seen by the leader (rank steps in `Status`), the leader's
   CPU, the latency of a frame until the leader's `Status` reflects it, and whether any node
   was evicted (membership_changed events in the coordinator log). With `--relays N`, N more
   coordinator processes on the same etcd relay the node streams (each node streams through the
   replica its node_id hashes to, the leader included) and the probe's Session goes through a
   relay; the leader's CPU per delivered node frame is the figure to compare.
2. A membership change at 16k and 100k ranks, in-process with no network: the pure core
   (`decide`, `encode`) and the leader's own per-tick and per-change path (`JobLeader.tally_once`
   with an in-memory persist), plus the per-frame and `Status` costs at that size.

    python bench/capacity.py            # 50..1000 nodes x 8 ranks at 10 frames/s; 16k and 100k ranks
    python bench/capacity.py --quick    # a smoke test
    python bench/capacity.py --nodes 1000 --rate 10,15,20 --skip-membership   # one leader, 10k..20k frames/s
    python bench/capacity.py --relays 2 --rate 2 --nodes 200,500,1000 --skip-membership   # relayed
    python bench/capacity.py --relays 2 --rate 0.25 --heartbeat-timeout 20 --nodes 12500 --skip-membership
                                        # 100k ranks over the network (a low rate: the clients share the host)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime
from dataclasses import replace
from pathlib import Path

import grpc

from muster import logs
from muster.coordinator.job import status_pages
from muster.coordinator import wire
from muster.coordinator.core.liveness import RankReport
from muster.coordinator.core.machine import Context, Join, NodeLost, SlotDown, Tick, decide
from muster.coordinator.core.policy import MAX_NODES, JobSpec, Limits, Timing
from muster.coordinator.core.state import JobState, decode, encode
from muster.coordinator.etcd.client import connect
from muster.coordinator.coordination import LeaderKey
from muster.coordinator.etcd.server import EtcdServer
from muster.coordinator.etcd.store import JobStore
from muster.coordinator.job.leader import JobLeader
from muster.coordinator.job.leadership import Leadership
from muster.coordinator.job.straggler_duty import StragglerDuty
from muster.coordinator.job.streams import NodeStream
from muster.coordinator.memory import MemoryJobStore
from muster.local import CoordinatorProcess, SimulatedNode, end_on_sigterm, wait_until
from muster.v1 import muster_pb2 as pb
from muster.v1 import muster_pb2_grpc as pb_grpc

sys.path.insert(0, str(Path(__file__).parent))
from h2_nodes import RawNode, pump  # noqa: E402
from proc_cpu import cpu_seconds, loop_seconds  # noqa: E402
from recovery import percentile  # noqa: E402

JOB = "capacity"
PROBE_JOB = "probe"  # a one-node job on the same leader process: its Status is O(1) to poll
EVICTION_KINDS = {"node_silent", "rank_silent", "rank_stalled", "process_exited", "node_left"}
HEARTBEAT_TIMEOUT_S = 5.0  # FAST's 1 s would evict nodes of a loaded 2-core host; the grace matches it
POLL_S = 0.002  # the probe's Status polls after the first one
IDLE_S = 1.5  # the leader's CPU with every node paused (well under the heartbeat timeout): its cost besides frames


# ---- part 1: heartbeat capacity ------------------------------------------------------------------


def _client_main(conn, raw: bool) -> None:
    """A client process: simulated nodes on one asyncio loop, one load point after another
    (long-lived: importing the worker package, torch included, takes seconds)."""
    logs.configure("warning")
    asyncio.run(_client(conn, raw))


async def _client(conn, raw: bool) -> None:
    """`raw`: the nodes write their frames as raw HTTP/2 (`h2_nodes`, a few us each); otherwise
    through the real client (`SimulatedNode`: NodeSession on gRPC aio, ~80 us each)."""
    nodes: list[SimulatedNode | RawNode] = []
    joining = asyncio.Semaphore(32)
    pumping: asyncio.Task | None = None
    done = asyncio.Event()

    async def bring_up(node: SimulatedNode | RawNode) -> None:
        # Stream right after joining: a joined node silent for the heartbeat timeout is evicted.
        async with joining:
            await node.join()
        if raw:
            await node.open()  # the pump writes its frames from now on
        else:
            node.start()

    async def stop() -> None:
        done.set()
        if pumping is not None:
            await pumping
        await asyncio.gather(*(n.stop() for n in nodes))

    try:
        while True:
            command, *rest = await asyncio.to_thread(conn.recv)
            if command == "start":
                addresses, names, slots, interval_s, spec = rest
                node = RawNode if raw else SimulatedNode
                nodes = [node(addresses, JOB, name, slots=slots, spec=pb.JobSpec(**spec), interval_s=interval_s)
                         for name in names]
                if raw:
                    done.clear()
                    pumping = asyncio.create_task(pump(nodes, done))
                try:
                    await asyncio.gather(*(bring_up(n) for n in nodes))
                    conn.send("joined")
                except (grpc.RpcError, TimeoutError, OSError) as exc:  # the parent raises it
                    conn.send(f"join failed: {exc!r}")
            elif command in ("pause", "resume"):
                for n in nodes:
                    n.silent = command == "pause"
                conn.send(command)
            elif command == "silence_one":  # its stream stays open: only silence tells
                nodes[0].silent = True
                conn.send(time.time())
            elif command == "held":  # when every node still talking holds a generation past `rest[0]`
                generation, deadline = rest[0], time.monotonic() + rest[1]
                talking = [n for n in nodes if not n.silent]
                while any(n.generation <= generation for n in talking) and time.monotonic() < deadline:
                    await asyncio.sleep(0.005)
                conn.send(time.time() if all(n.generation > generation for n in talking) else None)
            elif command == "count":
                conn.send((time.monotonic(), sum(n.step for n in nodes), sum(len(n.errors) for n in nodes)))
            elif command == "stop":
                await stop()
                nodes, pumping = [], None
                conn.send("stopped")
            else:
                return
    finally:
        await stop()


class Clients:
    """Client processes (spawned: grpc does not survive a fork), each owning a share of the nodes."""

    def __init__(self, processes: int, raw: bool):
        ctx = multiprocessing.get_context("spawn")
        self.procs, self.conns = [], []
        for _ in range(processes):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_client_main, args=(child, raw), daemon=True)
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)

    def _ask(self, command: tuple, timeout_s: float, what: str) -> list:
        for conn in self.conns:
            conn.send(command)
        replies = []
        for conn in self.conns:
            if not conn.poll(timeout_s):
                raise AssertionError(f"client processes: no answer within {timeout_s}s ({what})")
            replies.append(conn.recv())
        return replies

    def start(self, addresses: list[str], nodes: int, slots: int, interval_s: float) -> None:
        """Join and stream `nodes` nodes, split over the processes. The job is --nodes N:N: it forms
        once, when the last joins (joining one by one into a running job, every join is a new
        generation sent to every stream: a join storm, not the steady state measured here)."""
        names = [f"node-{i:05d}" for i in range(nodes)]
        spec = {"min_nodes": nodes, "max_nodes": nodes}
        for k, conn in enumerate(self.conns):
            conn.send(("start", addresses, names[k::len(self.conns)], slots, interval_s, spec))
        for conn in self.conns:
            if not conn.poll(90 + nodes / 50):
                raise AssertionError(f"client nodes did not join within {90 + nodes / 50:.0f}s")
            reply = conn.recv()
            if reply != "joined":
                raise AssertionError(reply)

    def count(self) -> tuple[float, int, int]:
        """(when, frames with rank reports sent so far, node errors), over all processes."""
        replies = self._ask(("count",), 10, "count")
        return max(r[0] for r in replies), sum(r[1] for r in replies), sum(r[2] for r in replies)

    def cpu_seconds(self) -> float:
        return sum(cpu_seconds(p.pid) for p in self.procs)

    def pause(self, paused: bool) -> None:
        """Stop (or restart) every node's frames; the streams stay open."""
        self._ask(("pause" if paused else "resume",), 10, "pause")

    def change(self, generation: int, timeout_s: float) -> tuple[float, float | None]:
        """One node (of the first process) goes silent: (when, wall clock; when every other node
        held a generation past `generation`, or None)."""
        self.conns[0].send(("silence_one",))
        silenced = self.conns[0].recv()
        held = self._ask(("held", generation, timeout_s), timeout_s + 10, "held")
        return silenced, None if None in held else max(held)

    def stop_nodes(self) -> None:
        self._ask(("stop",), 20, "stop")

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(("exit",))
            except OSError:
                pass
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()  # by its own pid
                proc.join(5)


async def _steps(stub, job: str) -> tuple[float, dict[str, int], int]:
    """(when, step of each node as the leader sees it, world size)."""
    asked = time.monotonic()
    steps: dict[str, int] = {}
    request = pb.StatusRequest(job=job, page_size=status_pages.MAX_PAGE_SIZE)
    while True:  # every page: a job of 1,000 nodes has 8,000 ranks
        js = (await stub.Status(request, timeout=10)).jobs[0]
        steps.update((r.node, r.step) for r in js.ranks if r.local_rank == 0)
        if not js.next_page_token:
            break
        request.page_token = js.next_page_token
    when = (asked + time.monotonic()) / 2  # a large Status takes a while to build and return
    return when, steps, js.world_size


async def _wait_stepping(stub, coordinator: CoordinatorProcess, nodes: int, slots: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if coordinator.proc.poll() is not None:
            raise AssertionError(f"coordinator exited with {coordinator.proc.returncode}: "
                                 f"{coordinator.log_path.read_text(errors='replace')[-2000:]}")
        try:
            _, steps, world = await _steps(stub, JOB)
            if world == nodes * slots and len(steps) == nodes and all(steps.values()):
                return
        except grpc.aio.AioRpcError:
            pass
        if time.monotonic() > deadline:
            attached = len(coordinator.find("node_attached", job=JOB))
            raise AssertionError(f"{nodes} nodes not all stepping within {timeout_s}s ({attached} streams attached)")
        await asyncio.sleep(0.5)


PROBE_REJOINS = 3  # streams the probe opens again where the leader ended one


class ProbeEnded(Exception):
    """The leader ended the probe's stream (why: its status)."""


async def _probe(stub, sampling: asyncio.Event, stop: asyncio.Event,
                 relay: str = "") -> tuple[list[tuple[float, int]], list[str]]:
    """Frame -> leader-visible latency (an upper bound): write a frame with a change on a real
    Session (through `relay` when given): a new step and a rank state flipped between running and a
    long phase (a relay forwards changes at once, progress alone once per --relay-progress), then
    poll `Status` until both show; (response that shows it - write, polls needed). Samples while
    `sampling` is set (the CPU windows go without its polls); otherwise keeps its stream alive, until
    `stop`. A stream the leader ends (the probe evicted on a loaded machine: its run ends with it) is
    joined again, up to PROBE_REJOINS times, the samples kept; why each ended comes back with them."""
    relay_channel = grpc.aio.insecure_channel(relay) if relay else None
    samples: list[tuple[float, int]] = []
    ended: list[str] = []
    # One join key for every Join: a stream that ended while the probe stayed a member (a fresh-clone
    # run: ALREADY_EXISTS) is joined again as that membership; one evicted joins anew.
    join_key = os.urandom(32)
    try:
        while True:
            try:
                await _probe_session(stub, relay_channel, sampling, stop, samples, join_key)
                return samples, ended
            except ProbeEnded as exc:
                ended.append(str(exc))
                if len(ended) > PROBE_REJOINS:
                    raise
            except grpc.aio.AioRpcError as exc:  # a Join refused while the last run ends: as a node, again
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                await asyncio.sleep(0.1)
    finally:
        if relay_channel is not None:
            await relay_channel.close()


async def _probe_session(stub, relay_channel, sampling: asyncio.Event, stop: asyncio.Event,
                         samples: list[tuple[float, int]], join_key: bytes) -> None:
    """One membership of the probe node: `_probe`'s samples until `stop`, or ProbeEnded."""
    joined = await stub.Join(pb.JoinRequest(job=PROBE_JOB, node_id="probe", slots=1, host="127.0.0.1",
                                            store_port=29400, join_key=join_key), timeout=10)
    call = (pb_grpc.CoordinatorStub(relay_channel) if relay_channel else stub).Session()
    generation = 0
    step = 0
    state = pb.RANK_STATE_RUNNING

    def frame() -> pb.NodeFrame:
        ranks = [pb.RankReport(local_rank=0, pid=os.getpid(), step=step, step_time_us=1000, state=state,
                               phase="probe" if state == pb.RANK_STATE_LONG_PHASE else "")] if step else []
        return pb.NodeFrame(job=PROBE_JOB, node_id="probe", member_id=joined.member_id, term=joined.term,
                            generation=generation, ranks=ranks, session_secret=joined.session_secret,
                            via_relay=bool(relay_channel))

    async def ended() -> ProbeEnded:
        return ProbeEnded(f"{(await call.code()).name}: {await call.details()}")

    async def write() -> None:
        try:
            await call.write(frame())
        except asyncio.InvalidStateError:
            raise await ended() from None

    async def read() -> None:
        nonlocal generation
        while (d := await call.read()) is not grpc.aio.EOF:
            if d.HasField("assignment"):
                generation = d.assignment.generation

    reader = asyncio.create_task(read())
    try:
        await write()
        while not generation:  # the probe job forms after its last call
            await asyncio.sleep(0.05)
            await write()
        while not stop.is_set():
            if not sampling.is_set():
                step += 1  # alive and stepping: a silent or stalled probe node would be evicted
                await write()
                try:
                    await asyncio.wait_for(sampling.wait(), 0.5)
                except TimeoutError:
                    pass
                continue
            step += 1
            state = pb.RANK_STATE_LONG_PHASE if state == pb.RANK_STATE_RUNNING else pb.RANK_STATE_RUNNING
            shown = "long_phase" if state == pb.RANK_STATE_LONG_PHASE else "running"
            written = time.monotonic()
            await write()
            polls = 0
            while True:
                polls += 1
                status = await stub.Status(pb.StatusRequest(job=PROBE_JOB), timeout=10)
                ranks = status.jobs[0].ranks
                if ranks and ranks[0].step >= step and ranks[0].state == shown:
                    samples.append((time.monotonic() - written, polls))
                    break
                if call.done():
                    raise await ended()
                # Paced: through a relay a frame waits for its batch window, and polling back to
                # back meanwhile would load the leader more than the nodes do.
                await asyncio.sleep(POLL_S)
            # Spaced and jittered: a sample, not a load of its own.
            await asyncio.sleep(random.uniform(0.02, 0.05))
    finally:
        call.cancel()
        reader.cancel()


def _wall(record: dict) -> float:
    """A log record's time (structlog's ISO UTC timestamp) as epoch seconds."""
    return datetime.fromisoformat(record["timestamp"].replace("Z", "+00:00")).timestamp()


def _ms(values: list[float]) -> dict:
    return {"p50": round(statistics.median(values) * 1e3, 2), "p99": round(percentile(values, 0.99) * 1e3, 2),
            "max": round(max(values) * 1e3, 2)}


def _seed_jobs(etcd: EtcdServer, leader: CoordinatorProcess, nodes: int) -> None:
    """Relay mode: both jobs exist and are led by the first coordinator before the relays start
    (campaigning, they could win either job), so the probe measures the loaded leader."""
    client = connect([etcd.endpoint])
    try:
        store = JobStore(client)
        for job, size in ((JOB, nodes), (PROBE_JOB, 1)):
            store.create_spec(job, json.dumps(vars(JobSpec(size, size, 1))).encode())
    finally:
        client.close()
    wait_until(lambda: leader.leads(JOB) and leader.leads(PROBE_JOB), 20, "the first coordinator leading both jobs")


def load_point(workdir: Path, clients: Clients, nodes: int, rate: float, slots: int, window_s: float,
               warmup_s: float, relays: int = 0, timeout_s: float = HEARTBEAT_TIMEOUT_S) -> dict:
    """One fresh etcd + coordinator per point: no job or eviction of an earlier point leaks in.
    With `relays`, that many more coordinators relay the node streams to it."""
    etcd = EtcdServer(workdir / "etcd").start()
    coordinators: list[CoordinatorProcess] = []
    streaming = False
    args = ["--heartbeat-interval", str(1 / rate), "--heartbeat-timeout", str(timeout_s),
            "--grace", str(timeout_s), "--relay-min-nodes", "1",
            # A simulated node steps once per frame: at a low --rate its steps are that far apart.
            "--progress-floor", str(max(10.0, 3 * timeout_s)),
            # Every simulated node comes from this one host, and without tokens the quota of calls yet to
            # send their first message is per host (256): a real job's nodes each come from their own.
            "--max-idle-streams", str(nodes + 64),
            # One job of `nodes`: the operator's raised quotas for it (its members, and the state it writes).
            "--max-nodes-per-job", str(nodes + 16), "--max-etcd-mib-per-minute", "100000",
            # What is measured is the heartbeat path, not a failover: the harness's 2 s lease lapsed under
            # the test suite's load, and its nodes' raw streams, ended with the term, never join again.
            "--session-ttl", "10"]
    try:
        coordinators.append(CoordinatorProcess([etcd.endpoint], workdir / "coordinator.log", args).start())
        if relays:
            _seed_jobs(etcd, coordinators[0], nodes)
            for i in range(relays):
                coordinators.append(CoordinatorProcess([etcd.endpoint], workdir / f"relay-{i}.log", args).start())
        streaming = True
        started = time.monotonic()
        clients.start([c.address for c in coordinators], nodes, slots, 1 / rate)
        return asyncio.run(_measure(coordinators, clients, nodes, rate, slots, window_s, warmup_s, started,
                                    timeout_s))
    finally:
        if streaming:
            clients.stop_nodes()
        for coordinator in coordinators:
            coordinator.stop()
        etcd.stop()


async def _idle_cpu(coordinator: CoordinatorProcess, clients: Clients) -> tuple[float, float]:
    """The leader's CPU (and its loop's) besides node frames (ticks, pulses, the probe): every node
    paused a moment."""
    await asyncio.to_thread(clients.pause, True)
    await asyncio.sleep(0.3)
    idle0, idle_loop0, idle_t0 = cpu_seconds(coordinator.pid), loop_seconds(coordinator.pid), time.monotonic()
    await asyncio.sleep(IDLE_S)
    idle_s = time.monotonic() - idle_t0
    cores = (cpu_seconds(coordinator.pid) - idle0) / idle_s, (loop_seconds(coordinator.pid) - idle_loop0) / idle_s
    await asyncio.to_thread(clients.pause, False)
    await asyncio.sleep(0.5)
    return cores


def _change(since: list[dict], silenced: float, held: float | None, waited_s: float) -> dict:
    """The membership change after a load point, from the leader's changes `since` one node went
    silent (wall time `silenced`) and when every other node `held` the next map (None: not within
    `waited_s`)."""
    answer = [r for r in since if r.get("kind") in EVICTION_KINDS]
    if not answer:  # what the leader changed instead, and whether every node held a newer map
        return {"decided_after_silence_s": None, "every_node_held_it_after_s": None, "kind": None,
                "changes_since": [(r.get("kind"), r.get("reason")) for r in since][-5:],
                "held_by_all": held is not None, "waited_s": waited_s}
    decided = _wall(answer[0])
    return {"decided_after_silence_s": round(decided - silenced, 3),
            "every_node_held_it_after_s": round(held - decided, 3) if held else None,
            "kind": answer[0]["kind"]}  # (node_silent: its stream open, it sent nothing)


async def _measure(coordinators: list[CoordinatorProcess], clients: Clients, nodes: int, rate: float, slots: int,
                   window_s: float, warmup_s: float, started: float, timeout_s: float) -> dict:
    coordinator, relays = coordinators[0], coordinators[1:]
    async with grpc.aio.insecure_channel(coordinator.address, options=[
            ("grpc.max_receive_message_length", 64 << 20)]) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        await _wait_stepping(stub, coordinator, nodes, slots, 30 + nodes / 100)  # 12,500 joins take a while
        ramp_s = time.monotonic() - started
        changes_before = len(coordinator.find("membership_changed", job=JOB))
        sampling, stop = asyncio.Event(), asyncio.Event()
        sampling.set()
        probing = asyncio.create_task(_probe(stub, sampling, stop, relays[0].address if relays else ""))
        await asyncio.sleep(warmup_s + window_s)  # the probe job forms, the nodes settle; then latency samples
        sampling.clear()
        idle_cores, idle_loop_cores = await _idle_cpu(coordinator, clients)
        # Both ends counted at once: the leader's view (Status) and what the clients sent.
        (t0, seen0, _), (c0, sent0, _) = await asyncio.gather(_steps(stub, JOB), asyncio.to_thread(clients.count))
        leader_cpu0, leader_loop0, client_cpu0 = (cpu_seconds(coordinator.pid), loop_seconds(coordinator.pid),
                                                  clients.cpu_seconds())
        relay_cpu0 = [cpu_seconds(r.pid) for r in relays]
        await asyncio.sleep(window_s)
        (t1, seen1, world), (c1, sent1, errors) = await asyncio.gather(_steps(stub, JOB),
                                                                      asyncio.to_thread(clients.count))
        leader_cpu1, leader_loop1, client_cpu1 = (cpu_seconds(coordinator.pid), loop_seconds(coordinator.pid),
                                                  clients.cpu_seconds())
        relay_cpu1 = [cpu_seconds(r.pid) for r in relays]
        stop.set()
        samples, probe_ended = await probing
        generation = (await stub.Status(pb.StatusRequest(job=JOB, brief=True), timeout=10)).jobs[0].generation
    delivered = {n: seen1.get(n, 0) - seen0.get(n, 0) for n in seen0}
    changes = coordinator.find("membership_changed", job=JOB)[changes_before:]
    warnings = Counter(r["event"] for r in coordinator.records() if r.get("level") in ("warning", "error"))
    evictions = [r for r in coordinator.find("membership_changed") if r.get("kind") in EVICTION_KINDS]
    # Then a membership change at this size: a node goes silent; the leader decides (its log), and
    # every other node holds its part of the next generation (the clients' clocks; one machine).
    silenced, held = await asyncio.to_thread(clients.change, generation, 4 * timeout_s)
    change = _change(coordinator.find("membership_changed", job=JOB)[changes_before + len(changes):],
                     silenced, held, 4 * timeout_s)
    delivered_per_s = sum(delivered.values()) / (t1 - t0)
    leader_cores = (leader_cpu1 - leader_cpu0) / (t1 - t0)
    loop_cores = (leader_loop1 - leader_loop0) / (t1 - t0)
    return {
        "relays": len(relays),
        "nodes": nodes,
        "frames_per_s_per_node": rate,
        "ranks_per_node": slots,
        "ramp_s": round(ramp_s, 2),
        "offered_frames_per_s": round(nodes * rate, 1),
        "sent_frames_per_s": round((sent1 - sent0) / (c1 - c0), 1),
        "delivered_frames_per_s": round(delivered_per_s, 1),
        "nodes_not_advancing": sum(1 for d in delivered.values() if d <= 0),
        "frame_latency_ms": {**_ms([latency for latency, _ in samples]), "samples": len(samples),
                             "not_visible_at_first_poll": sum(1 for _, polls in samples if polls > 1),
                             "probe_streams_ended": probe_ended},
        "leader_cpu_cores": round(leader_cores, 3),
        "leader_cpu_us_per_node_frame": round(leader_cores * 1e6 / delivered_per_s, 1) if delivered_per_s else None,
        "leader_idle_cpu_cores": round(idle_cores, 3),
        "leader_frame_cpu_us_per_node_frame": (round((leader_cores - idle_cores) * 1e6 / delivered_per_s, 1)
                                               if delivered_per_s else None),
        "leader_loop_cpu_cores": round(loop_cores, 3),
        "leader_loop_us_per_node_frame": (round((loop_cores - idle_loop_cores) * 1e6 / delivered_per_s, 1)
                                          if delivered_per_s else None),
        "relay_cpu_cores": [round((b - a) / (t1 - t0), 3) for a, b in zip(relay_cpu0, relay_cpu1)],
        "relay_streams_at_leader": len(coordinator.find("relay_attached", job=JOB)),
        "client_cpu_cores": round((client_cpu1 - client_cpu0) / (c1 - c0), 3),
        "change": change,
        "healthy": not evictions and not errors and world == nodes * slots and not changes,
        "world_size": world,  # at the window's end (healthy: every node's slots)
        "evictions": len(evictions),
        "membership_changes_in_window": len(changes),
        "client_node_errors": errors,
        "leader_warnings": dict(warnings),
    }


def heartbeat_capacity(workdir: Path, points: list[tuple[int, float]], slots: int, processes: int,
                       window_s: float, warmup_s: float, relays: int = 0,
                       timeout_s: float = HEARTBEAT_TIMEOUT_S, grpc_clients: bool = False) -> dict:
    results = []
    clients = Clients(processes, raw=not grpc_clients)
    try:
        for i, (nodes, rate) in enumerate(points):
            point_dir = workdir / f"{i}-n{nodes}-r{rate:g}"
            point_dir.mkdir(parents=True, exist_ok=True)
            try:
                results.append(load_point(point_dir, clients, nodes, rate, slots, window_s, warmup_s, relays,
                                          timeout_s))
            except AssertionError as exc:  # reported; the sweep goes on
                results.append({"nodes": nodes, "frames_per_s_per_node": rate, "error": str(exc)[-1000:]})
    finally:
        clients.close()
    return {
        "latency_definition": (
            "frame_latency_ms, frame -> leader-visible, an upper bound: a probe node (a one-node job on the same "
            "leader process, so its Status is O(1)) writes a NodeFrame with a new step on its Session stream (with "
            "relays: through a relay), then polls Status on the leader, every 2 ms, until that step shows; latency "
            "= that response - the write, so it includes one Status round trip through the same event loop. One "
            "probe every 20-50 ms over warm-up + one window, before the CPU and delivery windows (which go without "
            "its polls); not_visible_at_first_poll counts probes the leader had not processed by the time it "
            "answered the first poll."),
        "change_definition": "after the window, one node (its stream open) stops sending: decided_after_silence_s "
                             "from then to the leader's node_silent decision (its log; the heartbeat timeout "
                             "included), every_node_held_it_after_s from the decision until every other node held "
                             "a newer generation (clients polled every 5 ms; wall clocks of one machine)",
        "delivered_definition": "sum over nodes of the rank step advance in the leader's Status over the window "
                                "(each frame advances the step by one) / window",
        "cpu_definition": (
            "leader_cpu_us_per_node_frame: the leader's CPU over the window / delivered frames; "
            "leader_frame_cpu_us_per_node_frame: the same less leader_idle_cpu_cores, the leader's CPU over "
            f"{IDLE_S}s with every node paused just before the window (ticks, pulses, the probe): what the node "
            "frames themselves cost it; leader_loop_us_per_node_frame: the same for the main thread alone "
            "(the event loop, where every frame's Python runs; gRPC's event-engine threads run beside it on "
            "other cores): one loop's ceiling is 1e6 / that frames/s"),
        "window_s": window_s,
        "client_processes": processes,
        "clients": "real client (NodeSession, gRPC aio)" if grpc_clients else "raw HTTP/2 writes (bench/h2_nodes.py)",
        "heartbeat_timeout_s": timeout_s,
        "setup": "per point: a fresh etcd and coordinator; one job of N nodes (--nodes N:N, formed once)"
                 + (f"; {relays} more coordinators relaying, every node streaming through the replica its node_id "
                    "hashes to (the leader for its own share), the probe through a relay" if relays else ""),
        "points": results,
    }


# ---- part 2: one membership change at scale (pure core, no network) ------------------------------

TIMING = Timing(heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)  # otherwise the `muster serve` defaults


def context(now: float, term: int = 1) -> Context:
    return Context(now, int(time.time() * 1000), term, TIMING, max_step=1000, step_time_s=0.05)


def running_state(nodes: int, slots: int) -> JobState:
    """A formed job: `nodes` joined (one tally) and the last call passed."""
    joins = [Join(f"node-{i:05d}", f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}", 29500, slots) for i in range(nodes)]
    state = decide(JobState(JOB, JobSpec(1, MAX_NODES, 1)), joins, context(0.0)).state
    state = decide(state, [Tick()], context(TIMING.last_call_s + 1)).state
    assert state.rank_map.world_size == nodes * slots
    return state


def forming_join_ms(nodes: int, slots: int, reps: int) -> float:
    """`decide` of one more Join while a job of `nodes` nodes forms (its max_nodes not reached): what
    every tally of a big job's start costs while its nodes gather."""
    joins = [Join(f"node-{i:05d}", f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}", 29500, slots) for i in range(nodes)]
    state = decide(JobState(JOB, JobSpec(nodes + 2, nodes + 2, 1)), joins, context(0.0)).state
    late = Join("node-new", "10.255.255.254", 29500, slots)
    return median_ms(lambda: decide(state, [late], context(0.0)), reps)


def rank_reports(slots: int, step: int) -> list[RankReport]:
    """Every rank stepping, its compute measured (what the straggler watch looks at)."""
    return [RankReport(s, 10_000 + s, step, 0.05, "running", compute_s=0.03 + 0.001 * s) for s in range(slots)]


def median_ms(fn, reps: int) -> float:
    """The median CPU time of `fn` (this thread's: other load on the host does not count)."""
    samples = []
    for _ in range(reps):
        t0 = time.thread_time()
        fn()
        samples.append(time.thread_time() - t0)
    return round(statistics.median(samples) * 1e3, 3)


def membership_at(ranks: int, slots: int, reps: int) -> dict:
    nodes = ranks // slots
    reps = max(1, min(reps, nodes - 2))  # a distinct victim node per change
    t0 = time.perf_counter()
    state = running_state(nodes, slots)
    build_s = time.perf_counter() - t0
    victims = random.Random(1).sample([m.node_id for m in state.members], 2 + reps)
    decide_ms, lost, aged = decide_costs(state, victims, slots, reps)
    decide_ms["forming_join"] = forming_join_ms(nodes, slots, reps)
    blob, aged_blob = encode(lost), encode(aged)  # (before the leader runs: it shares the members)
    leader = streaming_leader(state, slots)
    frame_us = frame_cost_us(leader, state, slots)
    tick_s, change_s = asyncio.run(leader_path(leader, nodes, victims[2:2 + reps], reps))
    node_ids = [m.node_id for m in lost.members]
    return {
        "ranks": nodes * slots,
        "nodes": nodes,
        "repetitions": reps,
        "build_s": round(build_s, 2),
        "decide_ms": decide_ms,
        "encode_ms": median_ms(lambda: encode(lost), reps),
        "state_bytes": len(blob),
        "decode_ms": median_ms(lambda: decode(blob), reps),
        "encode_full_history_ms": median_ms(lambda: encode(aged), reps),
        "state_bytes_full_history": len(aged_blob),
        "tick_ms": round(tick_s * 1e3, 3),
        "leader_change_ms": round(change_s * 1e3, 3),
        "assignments_ms": median_ms(lambda: [a.directive(n) for a in [wire.Assignments(lost, "bench")] for n in node_ids], reps),
        "frame_us": round(frame_us, 2),
        "straggler_look_ms": median_ms(lambda: straggler_look(leader), reps),
        **straggler_slices(leader),
        **status_costs(leader, reps),
    }


def decide_costs(state, victims: list[str], slots: int, reps: int) -> tuple[dict, object, object]:
    """What `decide` costs for a node lost, a slot down and a join; the state after the loss, and
    that state with a long-running job's full history (history_limit events, every other one a
    generation event listing every node of its map: the history grows with the job size)."""
    ctx = context(100.0)
    decided = {}

    def run(name, event):
        def fn():
            decided[name] = decide(state, [event], ctx)
        return median_ms(fn, reps)

    decide_ms = {
        "node_lost": run("node_lost", NodeLost(victims[0], "node_silent", "no frame for 5.1s")),
        "slot_down": run("slot_down", SlotDown(victims[1], slots - 1, "rank_exited", "exit code -9")),
        "join": run("join", Join("node-new", "10.255.255.254", 29500, slots)),
    }
    assert all(d.new_generation for d in decided.values())
    lost = decided["node_lost"].state
    silent, generation = decided["node_lost"].events
    return decide_ms, lost, replace(lost, history=(silent, generation) * (TIMING.history_limit // 2))


def streaming_leader(state, slots: int) -> JobLeader:
    """The leader itself: every node streaming, every rank reporting, out of its takeover grace. Its
    writes go to the in-memory store: encoded and written in a thread as on etcd, less etcd itself."""
    clock = [100.0]
    leadership = Leadership(LeaderKey(JOB, 1, "bench", "127.0.0.1:7600"), MemoryJobStore())
    leader = JobLeader(state, leadership=leadership, address="127.0.0.1:7600", timing=TIMING, tick_s=0.05,
                       clock=lambda: clock[0],  # a job an operator raised the quotas of (--job-quota)
                       limits=Limits(max_members=MAX_NODES + 16, etcd_mib_per_min=1e6))
    for m in state.members:
        leader.streams[m.node_id] = NodeStream(JOB, m.node_id, m.member_id, m.kind)
        leader.live.observe(m.node_id, state.generation, rank_reports(slots, 1000), clock[0])
    clock[0] += TIMING.grace_s + 0.5  # past the takeover grace: a tally judges silence and stalls
    for m in state.members:  # every node heard again just now, a step further
        leader.live.observe(m.node_id, state.generation, rank_reports(slots, 1001), clock[0])
    return leader


def frame_cost_us(leader: JobLeader, state, slots: int) -> float:
    """One frame as JobLeader.on_frame handles it (validation, member lookup, liveness)."""
    members = {m.node_id: m for m in state.members}
    sample = random.Random(2).choices(list(members), k=500)
    frames = [pb.NodeFrame(job=JOB, node_id=n, member_id=members[n].member_id, term=1, generation=state.generation,
                           ranks=[pb.RankReport(local_rank=s, pid=10_000 + s, step=1001, step_time_us=50_000,
                                                state=pb.RANK_STATE_RUNNING) for s in range(slots)]) for n in sample]
    t0 = time.thread_time()
    for f in frames:
        leader.on_frame(leader.streams[f.node_id], f)
    return (time.thread_time() - t0) / len(frames) * 1e6


async def leader_path(leader: JobLeader, nodes: int, victims: list[str], reps: int) -> tuple[float, float]:
    """The median CPU of a tally with nothing queued (what every tick costs), and of one that
    decides a node's loss: failures, decide, persist (encode), adopt (every node's directive)."""
    encode(leader.state)  # as a leader that wrote it before: members keep their encoded text
    generation = leader.state.generation
    for _ in range(nodes // 256 + 2):  # the first judgement of every node after the takeover grace
        await leader.tally_once()
    while leader.stragglers.looking:  # the first straggler look, in its slices (straggler_slices: its own figure)
        await leader.tally_once()
    tick = []
    for _ in range(reps):
        t = time.process_time()
        await leader.tally_once()
        tick.append(time.process_time() - t)
    assert leader.state.generation == generation, "a tally of the steady job changed it"
    change = []
    for victim in victims:
        t = time.process_time()  # CPU of the process (the encoding runs in a thread): load elsewhere does not count
        await leader.tally_once(NodeLost(victim, "node_silent", "bench"))
        change.append(time.process_time() - t)
        for stream in leader.streams.values():  # taken off as each stream's task would: no new objects
            while not stream.queue.empty():
                stream.queue.get_nowait()
    return statistics.median(tick), statistics.median(change)


def straggler_look(leader: JobLeader) -> None:
    """One look of the straggler watch over the whole map (the duty's O(ranks) part, on the loop)."""
    leader.stragglers.watch.assess(leader.state.rank_map.placements, leader.live.nodes,
                                   leader.live.median_step_time() or 0.0)


def straggler_slices(leader: JobLeader) -> dict:
    """One look as the leader takes it (StragglerDuty.look, once a tally, in slices of LOOK_SLICE_S):
    the longest one tally's part of it held the loop (CPU: preemption by other load on the host
    does not count), and how many tallies the look spans."""
    duty = StragglerDuty(leader.stragglers.watch.policy, 0.0, leader.log)
    now = leader._clock()
    held, tallies = [], 0
    while True:
        seen = leader.live.assess(leader.state, now)
        t0 = time.thread_time()
        duty.look(now, leader.state, seen, leader.streams)
        held.append(time.thread_time() - t0)
        tallies += 1
        if not duty.looking:
            return {"straggler_slice_max_ms": round(max(held) * 1e3, 3), "straggler_look_tallies": tallies}


def status_costs(leader: JobLeader, reps: int) -> dict:
    """A default Status, one node's page, the job summary: their time, size and the longest the
    loop waits on one."""
    middle = leader.state.rank_map.placements[len(leader.state.rank_map.placements) // 2]
    one_node = status_pages.Page(node=middle.node_id)

    async def status_stall() -> float:
        """The longest the loop waits on one default Status: a task that only yields measures it."""
        gaps, done = [0.0], False

        async def yielder() -> None:
            last = time.perf_counter()
            while not done:
                await asyncio.sleep(0)
                gaps.append(time.perf_counter() - last)
                last = time.perf_counter()

        task = asyncio.create_task(yielder())
        await asyncio.sleep(0)
        await leader.status()
        done = True
        await task
        return round(max(gaps) * 1e3, 3)

    return {
        "status_ms": median_ms(lambda: asyncio.run(leader.status()), reps),
        "status_bytes": asyncio.run(leader.status()).ByteSize(),
        "status_stall_ms": max(asyncio.run(status_stall()) for _ in range(reps)),
        "status_node_ms": median_ms(lambda: asyncio.run(leader.status(page=one_node)), reps),
        "status_node_bytes": asyncio.run(leader.status(page=one_node)).ByteSize(),
        "summary_ms": median_ms(lambda: status_pages.job_summary(leader.state, leader.live), reps),
    }


def membership_at_scale(sizes: list[int], slots: int, reps: int) -> dict:
    return {
        "definitions": {
            "clock": "every figure is CPU time (a median over the repetitions; leader_change_ms the process's, for "
                     "its worker thread; the others the measuring thread's), not wall time: load elsewhere on the "
                     "host does not count, though it still slows the CPU a little (shared caches)",
            "decide_ms": "machine.decide(state, [event], ctx) on a running job with every node in the map; "
                         "forming_join: one more Join while a job of as many nodes forms (max_nodes not reached)",
            "encode_ms": "state.encode of the state after the node-lost decision (what is written to etcd); a new "
                         "job's history",
            "state_bytes_full_history": f"the same once the history is full ({TIMING.history_limit} events, half "
                                        "of them generation events listing every node); etcd refuses requests over "
                                        "1.5 MiB by default (--max-request-bytes)",
            "tick_ms": "CPU of JobLeader.tally_once with nothing queued, every node streaming, past the takeover grace "
                       "and the first judgement of every node after it: what the leader runs every --tick (0.05 s)",
            "leader_change_ms": "CPU of JobLeader.tally_once with one NodeLost queued: liveness, decide, encode, adopt "
                                "(one assignment directive per streaming node, taken off its queue after, as its "
                                "stream would); the etcd write is left out",
            "assignments_ms": "wire.Assignments: every node's directive of one new map (the fan-out inside leader_change_ms)",
            "frame_us": "JobLeader.on_frame of one frame of `slots` rank reports (the protobuf already parsed)",
            "straggler_look_ms": "the straggler watch's look over every rank of the map in one piece (its CPU; the "
                                 "leader takes it once every 1 s + ranks / 20,000 s, in slices: straggler_duty.py)",
            "straggler_slice_max_ms": "the longest one tally's part of a look held the leader's loop (CPU; the "
                                      "duty stops slicing once 2 ms of wall time have gone)",
            "straggler_look_tallies": "the tallies (one a --tick, 0.05 s, or sooner) one look spans",
            "status_ms": "JobLeader.status of a default Status: header, summary, health and the first page of "
                         f"{status_pages.DEFAULT_PAGE_SIZE} ranks (one Status RPC, before serialization)",
            "status_stall_ms": "the longest the leader's loop waits while a default Status is built (the "
                               "summary is counted in slices of 500 nodes, yielding between them); worst of reps",
            "status_node_ms": "JobLeader.status of a page of one node's ranks (StatusRequest.node; no summary)",
            "summary_ms": "status_pages.job_summary: rank counts by state over the whole job at once (inside status_ms, "
                          "in slices)",
        },
        "sizes": [membership_at(ranks, slots, reps if ranks <= 20_000 else max(3, reps // 2)) for ranks in sizes],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a small sweep and small sizes (a smoke test)")
    p.add_argument("--nodes", help="load points: node streams, comma-separated (default 50,200,500,1000)")
    p.add_argument("--rate", default="10", help="frames/s per node stream, comma-separated: every --nodes point at each")
    p.add_argument("--slots", type=int, default=8, help="ranks per node")
    p.add_argument("--clients", type=int, default=2, help="client processes driving the nodes")
    p.add_argument("--window", type=float, help="seconds measured per load point (default 8)")
    p.add_argument("--ranks", help="sizes of part 2, comma-separated (default 16000,100000)")
    p.add_argument("--reps", type=int, default=7, help="repetitions per measure in part 2 (halved above 20k ranks)")
    p.add_argument("--skip-network", action="store_true", help="part 2 only")
    p.add_argument("--skip-membership", action="store_true", help="part 1 only")
    p.add_argument("--heartbeat-timeout", type=float, default=HEARTBEAT_TIMEOUT_S,
                   help="part 1's heartbeat timeout and grace (seconds); keep it 3+ frame intervals at low --rate")
    p.add_argument("--relays", type=int, default=0, help="part 1 with this many relaying coordinators besides the "
                                                         "leader (default 0: every node streams to the leader)")
    p.add_argument("--grpc-clients", action="store_true",
                   help="simulate the nodes with the real client (NodeSession on gRPC aio, ~80 us of CPU per frame) "
                        "instead of raw HTTP/2 writes (bench/h2_nodes.py, a few us)")
    p.add_argument("--workdir", type=Path, help="keep the logs here (default: a temporary directory)")
    args = p.parse_args()
    logs.configure("warning")
    points = [(int(n), float(r)) for n in (args.nodes or ("10,40" if args.quick else "50,200,500,1000")).split(",")
              for r in args.rate.split(",")]
    sizes = [int(n) for n in (args.ranks or ("800,4000" if args.quick else "16000,100000")).split(",")]
    window = args.window or (3.0 if args.quick else 8.0)
    result = {
        "benchmark": "capacity",
        "host": {"cpus": os.cpu_count(), "loadavg_at_start": [round(x, 2) for x in os.getloadavg()]},
        "note": ("one machine: the coordinator, etcd and the client processes that simulate the nodes share its "
                 f"{os.cpu_count()} cores (and whatever else runs there), so the clients' CPU is taken from the "
                 "leader; delivered < offered can be the clients' limit as much as the leader's (see the cpu fields)"),
    }
    with tempfile.TemporaryDirectory(prefix="muster-bench-") as d:
        workdir = args.workdir or Path(d)
        workdir.mkdir(parents=True, exist_ok=True)
        if not args.skip_network:
            result["heartbeat"] = heartbeat_capacity(workdir, points, args.slots, args.clients, window,
                                                     1.0 if args.quick else 2.0, args.relays,
                                                     args.heartbeat_timeout, args.grpc_clients)
        if not args.skip_membership:
            result["membership"] = membership_at_scale(sizes, args.slots, 3 if args.quick else args.reps)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    end_on_sigterm()
    sys.exit(main())
