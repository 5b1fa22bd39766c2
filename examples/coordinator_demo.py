"""Coordinator demo on an embedded etcd: two replicas, three simulated nodes (two train, one is a
hot spare). A node hangs, then the leader is SIGKILLed; the table shows the job carry on.
Exits 0 when both faults were recovered from. Run it with `make demo`."""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

from muster import logs
from muster.coordinator.client import Coordinators
from muster.coordinator.etcd_server import EtcdServer
from muster.testing import CoordinatorProcess, SimulatedNode
from muster.v1 import muster_pb2 as pb

JOB = "demo"


def table(addresses: list[str]) -> str:
    with Coordinators(addresses, timeout_s=1) as c:
        status = c.call("Status", pb.StatusRequest(job=JOB))
        job = status.jobs[0]
        if not job.live and job.leader:
            job = c.stub(job.leader).Status(pb.StatusRequest(job=JOB), timeout=1).jobs[0]
    rows = [f"leader {job.leader}  term {job.term}  generation {job.generation}  world_size {job.world_size}  "
            f"spares {list(job.spares)}"]
    rows += [f"  rank {r.rank}  node {r.node}  local_rank {r.local_rank}  step {r.step:>5}  {r.state}"
             for r in sorted(job.ranks, key=lambda r: r.rank)]
    return "\n".join(rows)


async def show(addresses: list[str], seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            print(await asyncio.to_thread(table, addresses), flush=True)
        except Exception as exc:  # the leader may be between lives: that is the point of the demo
            print(f"  (status unavailable: {exc.__class__.__name__})", flush=True)
        await asyncio.sleep(1.0)


async def main(workdir: Path) -> int:
    etcd = EtcdServer(workdir / "etcd").start()
    replicas = []
    nodes: list[SimulatedNode] = []
    try:
        replicas = [CoordinatorProcess([etcd.endpoint], workdir / f"replica-{i}.log").start() for i in range(2)]
        addresses = [r.address for r in replicas]
        print(f"etcd at {etcd.endpoint}; replicas at {addresses}", flush=True)
        spec = pb.JobSpec(min_nodes=2, max_nodes=2)
        nodes = [SimulatedNode(addresses, JOB, f"node-{i}", slots=2, spec=spec, interval_s=0.1) for i in range(3)]
        for n in nodes:
            await n.join()
            n.start()
        await nodes[0].wait_for(lambda n: n.assignment().role == pb.ROLE_ACTIVE, 15, "the first map")
        await show(addresses, 2)

        print("\n>>> node-1 hangs (stops sending frames)", flush=True)
        g = nodes[0].generation
        t0 = time.monotonic()
        nodes[1].silent = True
        await nodes[0].wait_for(lambda n: n.generation > g, 15, "the next generation")
        hang_recovery = time.monotonic() - t0
        spare_promoted = nodes[2].assignment().role == pb.ROLE_ACTIVE or (
            await nodes[2].wait_for(lambda n: n.assignment().role == pb.ROLE_ACTIVE, 5, "spare promoted")
        ).role == pb.ROLE_ACTIVE
        await show(addresses, 2)

        leader = next(r for r in replicas if r.address == nodes[0].leader)
        print(f"\n>>> SIGKILL the leader {leader.address}", flush=True)
        term = nodes[0].term
        t0 = time.monotonic()
        leader.kill()
        await nodes[0].wait_for(lambda n: n.term > term, 15, "a new leader")
        failover = time.monotonic() - t0
        generation_kept = nodes[0].generation == nodes[2].generation
        await show([r.address for r in replicas if r is not leader], 3)

        with Coordinators([r.address for r in replicas if r is not leader]) as c:
            events = c.call("Events", pb.EventsRequest(job=JOB)).events
        print("\nmembership history:")
        for e in events:
            print(f"  g{e.generation} term {e.term} {e.kind:<16} {','.join(e.nodes):<16} {e.reason}")
        print(f"\nhang detected and spare promoted in {hang_recovery:.2f}s (heartbeat timeout 1.0s)")
        print(f"leader failover: nodes on the new leader after {failover:.2f}s, no generation change: {generation_kept}")
        ok = spare_promoted and generation_kept
        print("RECOVERED" if ok else "NOT RECOVERED")
        return 0 if ok else 1
    finally:
        for n in nodes:
            await n.stop()
        for r in replicas:
            r.stop()
        etcd.stop()


if __name__ == "__main__":
    logs.configure("warning")
    with tempfile.TemporaryDirectory(prefix="muster-demo-") as d:
        sys.exit(asyncio.run(main(Path(d))))
