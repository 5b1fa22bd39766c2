"""Replica in-process on the in-memory store (its sessions and elections on a real etcd): a store
fault of one job, a fenced write or unavailability, touches no other job of the replica."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import pytest
from muster.local import SimulatedNode

from muster.coordinator.core.policy import Timing
from muster.coordinator.etcd.client import connect
from muster.coordinator.replica import Replica, ReplicaConfig
from muster.coordinator.server import create_server
from muster.coordinator.store import MemoryJobStore
from muster.v1 import muster_pb2 as pb

pytestmark = pytest.mark.timeout(20)

TIMING = Timing(heartbeat_interval_s=0.05, heartbeat_timeout_s=1.0, grace_s=2.0, last_call_s=0.1)
SPEC = pb.JobSpec(min_nodes=1, max_nodes=2)


@asynccontextmanager
async def replica_leading(etcd, store: MemoryJobStore, jobs: tuple[str, ...]):
    """A started replica on `store`, leading each job with one node "n" active in it."""
    client = connect([etcd.endpoint])
    replica = Replica(client, ReplicaConfig(timing=TIMING, session_ttl_s=2, tick_s=0.02), store=store)
    server, port = await create_server(replica)
    replica.address = f"127.0.0.1:{port}"
    nodes: list[SimulatedNode] = []
    try:
        await server.start()
        await replica.start()
        for job in jobs:
            nodes.append(SimulatedNode([replica.address], job, "n", slots=1, spec=SPEC))
            await nodes[-1].join()
            nodes[-1].start()
        for node in nodes:
            await node.wait_for(lambda x: x.assignment().role == pb.ROLE_ACTIVE, 5, "the first map")
        yield replica, nodes
    finally:
        for node in nodes:
            await node.stop()
        await replica.close()
        await server.stop(grace=1.0)
        client.close()


async def until(predicate, what: str, timeout_s: float = 5.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not (value := predicate()):
        assert asyncio.get_running_loop().time() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        await asyncio.sleep(0.02)
    return value


def test_a_fenced_write_of_one_job_ends_only_its_leadership_and_it_is_led_again(etcd):
    async def scenario():
        store = MemoryJobStore()
        async with replica_leading(etcd, store, ("good", "bad")) as (replica, nodes):
            good, bad = replica.leaders["good"], replica.leaders["bad"]
            store.fence_next_write("bad")
            joiner = SimulatedNode([replica.address], "bad", "m", slots=1, spec=SPEC)
            joining = asyncio.ensure_future(joiner.join())  # a decision to write, refused
            try:
                await until(lambda: bad.lost_reason, "the fenced leadership dropped")
                assert bad.lost_reason.startswith("fenced write refused")
                led = await until(lambda: replica.leaders.get("bad"), "the job led again")
                assert led.term > bad.term and led.lost_reason is None
                await asyncio.wait_for(joining, 10)  # the join is retried with the new leader
                assert led.state.member("m") is not None
            finally:
                await joiner.stop()
            assert replica.leaders["good"] is good and good.lost_reason is None and not nodes[0].errors

    asyncio.run(scenario())


def test_an_unavailable_store_for_one_job_holds_its_decisions_and_no_other_jobs(etcd):
    async def scenario():
        store = MemoryJobStore()
        async with replica_leading(etcd, store, ("good", "bad")) as (replica, nodes):
            good, bad = replica.leaders["good"], replica.leaders["bad"]
            store.make_unavailable("bad")
            joiners = [SimulatedNode([replica.address], job, "m", slots=1, spec=SPEC) for job in ("good", "bad")]
            joining = [asyncio.ensure_future(j.join()) for j in joiners]
            try:
                await asyncio.wait_for(joining[0], 5)
                assert good.state.member("m") is not None
                await asyncio.sleep(0.2)  # ten of bad's ticks: each decides the join again, and is deferred
                assert not joining[1].done() and bad.state.member("m") is None and bad.lost_reason is None
                store.make_available()
                await asyncio.wait_for(joining[1], 5)
                assert replica.leaders["bad"] is bad and bad.state.member("m") is not None
            finally:
                for j in joiners:
                    await j.stop()
            assert good.lost_reason is None and not any(n.errors for n in nodes)

    asyncio.run(scenario())
