"""What one Relay caller can cost a replica (security review 3, F1). Prints one JSON object.

A real etcd and one `muster serve` replica with no `--tokens` (anyone may call Relay: the worst case
the review and issue 24 looked at), relaying every job (`--relay-min-nodes 1`). Job B: `--nodes` simulated nodes stepping; job A: one node, so
that the replica leads A. The flood: one Relay call for job A of `--messages` messages of `--frames`
frames each (~0.95 MB at 46,000), every frame on a fresh stream number and naming job A's node
without its secret, the replies never read.

Measured: the replica's RSS (VmRSS, every 50 ms) before, at its peak and after the flood; the event
loop it held, as the latency of a brief Status of job B asked every 20 ms on a channel of its own
(every job's RPCs wait behind what holds the loop); job B's generation (it must not change) and its
nodes' steps before and during the flood; how the flood call ended as its caller saw it (its status,
and the messages its flow control let through) and as the replica logged it (`relay_refused`).

    python bench/abuse.py                       # 8 x 46,000 frames, 30 s
    python bench/abuse.py --messages 2 --frames 20000 --duration 5   # a smoke test
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

from muster import logs
from muster.coordinator.etcd.server import EtcdServer
from muster.local import CoordinatorProcess, SimulatedNode
from muster.v1 import muster_pb2 as pb
from muster.v1 import muster_pb2_grpc as pb_grpc

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
        self.call = relay(self._requests())

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
            await stub.Status(pb.StatusRequest(job=job, brief=True), timeout=30)
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
    b_nodes = [SimulatedNode([address], "job-b", f"b{i}", slots=1, spec=pb.JobSpec(min_nodes=args.nodes,
                                                                                   max_nodes=args.nodes))
               for i in range(args.nodes)]
    a_node = SimulatedNode([address], "job-a", "a0", slots=1, spec=pb.JobSpec(min_nodes=1, max_nodes=1))
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
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=8)
    parser.add_argument("--frames", type=int, default=46_000, help="frames a message (~0.95 MB at 46,000)")
    parser.add_argument("--nodes", type=int, default=3, help="nodes of the other job (B)")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds measured from the flood's start")
    parser.add_argument("--baseline", type=float, default=3.0, help="seconds measured before it")
    parser.add_argument("--settle", type=float, default=2.0, help="seconds after it, before RSS 'after'")
    args = parser.parse_args()
    logs.configure("warning")
    with tempfile.TemporaryDirectory(prefix="muster-abuse-") as tmp:
        workdir = Path(tmp)
        etcd = EtcdServer(workdir / "etcd").start()
        replica = None
        try:
            # Every job relayed: a Relay call for one that is not is refused at its first message.
            replica = CoordinatorProcess([etcd.endpoint], workdir / "coordinator.log",
                                         ["--relay-min-nodes", "1"]).start()
            result = {"benchmark": "abuse", "host": {"cpus": os.cpu_count(), "loadavg_at_start": os.getloadavg()},
                      **asyncio.run(scenario(replica, args))}
        finally:
            if replica is not None:
                replica.stop()
            etcd.stop()
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
