"""Replica in-process on the in-memory twins of etcd (its job store, its sessions and elections), no
etcd process: a lost session fails every job of its replica over to a standby and only those; a
replica that closes hands over at once; a store fault of one job, a fenced write or unavailability,
touches no other job of the replica. (tests/integration/test_job_faults.py and test_failover.py run
the same paths on real etcd.)"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager

import pytest
from muster.local import SimulatedNode
from muster.testing import until

from muster.coordinator.core.policy import Timing
from muster.coordinator.replica.replica import Replica, ReplicaConfig
from muster.coordinator.edges.server import create_server
from muster.coordinator.memory import MemoryCoordination, MemoryJobStore, MemorySession
from muster.v1 import muster_pb2 as pb

pytestmark = pytest.mark.timeout(20)

TIMING = Timing(heartbeat_interval_s=0.05, heartbeat_timeout_s=1.0, grace_s=2.0, last_call_s=0.1)
SPEC = pb.JobSpec(min_nodes=1, max_nodes=2)


class Twins:
    """What the replicas of one deployment share: the in-memory job store and coordination."""

    def __init__(self) -> None:
        self.store = MemoryJobStore()
        self.coordination = MemoryCoordination()


@asynccontextmanager
async def replicas_leading(twins: Twins, jobs: tuple[str, ...], n: int = 1):
    """`n` started replicas on `twins`, each job led by one of them with one node "n" active in it."""
    replicas, servers = [], []
    nodes: list[SimulatedNode] = []
    try:
        for _ in range(n):
            replica = Replica(twins.store, twins.coordination,
                              ReplicaConfig(timing=TIMING, session_ttl_s=2, tick_s=0.02))
            server, port = await create_server(replica)
            replica.address = f"127.0.0.1:{port}"
            replicas.append(replica)
            servers.append(server)
            await server.start()
            await replica.start()
        addresses = [r.address for r in replicas]
        for job in jobs:
            nodes.append(SimulatedNode(addresses, job, "n", slots=1, spec=SPEC))
            await nodes[-1].join()
            nodes[-1].start()
        for node in nodes:
            await node.wait_for(lambda x: x.assignment().role == pb.ROLE_ACTIVE, 5, "the first map")
        yield replicas, nodes
    finally:
        for node in nodes:
            await node.stop()
        for replica in replicas:
            await replica.close()
        for server in servers:
            await server.stop(grace=1.0)


def leader_and_standby(replicas: list[Replica], job: str) -> tuple[Replica, Replica]:
    """Of two replicas, the one leading `job`, then the other."""
    first = next(r for r in replicas if job in r.leaders)
    return first, next(r for r in replicas if r is not first)


def test_a_lost_session_fails_its_jobs_over_to_the_standby_and_the_node_stays_active():
    async def scenario():
        twins = Twins()
        async with replicas_leading(twins, ("j",), n=2) as (replicas, nodes):
            first, standby = leader_and_standby(replicas, "j")
            old = first.leaders["j"]
            twins.coordination.expire(twins.coordination.leader_session("j"))
            new = await until(lambda: standby.leaders.get("j"), "the standby leading")
            assert new.term > old.term
            assert old.lost_reason == "session lost: lease_expired" and "j" not in first.leaders
            await until(first.ready, "the old leader back as a standby, on a new session")
            await nodes[0].wait_for(lambda x: x.term == new.term and x.assignment().role == pb.ROLE_ACTIVE, 5,
                                    "the node active under the new leader")
            assert new.state.member("n") is not None and not nodes[0].errors

    asyncio.run(scenario())


def test_a_lost_session_ends_every_leadership_of_its_replica_and_each_job_is_led_again():
    async def scenario():
        twins = Twins()
        async with replicas_leading(twins, ("a", "b"), n=1) as ([replica], nodes):
            old = dict(replica.leaders)
            twins.coordination.expire(twins.coordination.leader_session("a"))
            for job in ("a", "b"):
                led = await until(lambda: replica.leaders.get(job) not in (None, old[job]) and replica.leaders[job],
                                  f"job {job} led again on the new session")
                assert led.term > old[job].term and old[job].lost_reason.startswith("session lost")
            assert not any(n.errors for n in nodes)

    asyncio.run(scenario())


def test_a_replica_leading_its_job_again_on_the_map_it_left_keeps_the_jobs_recoveries():
    """Fresh-clone runs E and B: a coordinator's etcd session lapsed under load, and the same replica
    took the job back at once, but the recovery it had measured was lost with the old term's memory."""
    async def scenario():
        twins = Twins()
        async with replicas_leading(twins, ("j",), n=1) as ([replica], nodes):
            old = replica.leaders["j"]
            await until(lambda: old.stats.recoveries, "the first map's recovery measured")
            measured = list(old.stats.recoveries)
            twins.coordination.expire(twins.coordination.leader_session("j"))
            led = await until(lambda: replica.leaders.get("j") not in (None, old) and replica.leaders["j"],
                              "j led again on the new session")
            assert led.term > old.term and led.state.generation == old.state.generation
            assert led.stats is old.stats and list(led.stats.recoveries) == measured
            await until(lambda: led.tallies, "a tally of the new term")
            assert list((await replica.events("j")).recoveries) == measured  # as `muster events` shows them

    asyncio.run(scenario())


def test_a_session_lost_as_it_replaces_a_lost_one_is_replaced_too():
    # After a long etcd freeze a grant can come back already past its renew deadline; the loss of that
    # session, heard while the replica was still setting it up, once went unheard: no leader, for good.
    class BornLost(MemorySession):
        def start(self):
            super().start()
            self._lose("renew_deadline")
            return self

    async def scenario():
        twins = Twins()
        async with replicas_leading(twins, ("j",), n=1) as ([replica], nodes):
            old = replica.leaders["j"]
            sessions = iter([BornLost(twins.coordination)])
            made = twins.coordination.session
            twins.coordination.session = lambda ttl_s, **kw: next(sessions, None) or made(ttl_s, **kw)
            twins.coordination.expire(twins.coordination.leader_session("j"))
            led = await until(lambda: replica.leaders.get("j") not in (None, old) and replica.leaders["j"],
                              "j led again on a session that lives")
            assert led.term > old.term and replica.ready()

    asyncio.run(scenario())


def test_a_replica_that_closes_resigns_and_the_standby_leads_at_once():
    async def scenario():
        twins = Twins()
        async with replicas_leading(twins, ("j",), n=2) as (replicas, nodes):
            first, standby = leader_and_standby(replicas, "j")
            await first.close()
            new = await until(lambda: standby.leaders.get("j"), "the standby leading", timeout_s=1.0)
            assert twins.coordination.current_leader("j") == (standby.address, new.term)

    asyncio.run(scenario())


def test_a_replica_started_while_etcd_is_unreachable_serves_once_it_is_back():
    async def scenario():
        twins = Twins()
        twins.coordination.make_unavailable()
        replica = Replica(twins.store, twins.coordination, ReplicaConfig(address="127.0.0.1:1"))
        starting = asyncio.ensure_future(replica.start())
        await until(lambda: twins.coordination.refused >= 2, "a session grant refused, and again after a backoff")
        assert not starting.done() and not replica.ready()
        twins.coordination.make_available()
        await asyncio.wait_for(starting, 5)
        assert replica.ready()
        await replica.close()

    asyncio.run(scenario())


def test_a_fenced_write_of_one_job_ends_only_its_leadership_and_it_is_led_again():
    async def scenario():
        twins = Twins()
        async with replicas_leading(twins, ("good", "bad")) as ([replica], nodes):
            good, bad = replica.leaders["good"], replica.leaders["bad"]
            twins.store.fence_next_write("bad")
            joiner = SimulatedNode([replica.address], "bad", "m", slots=1, spec=SPEC)
            joining = asyncio.ensure_future(joiner.join())  # a decision to write, refused
            try:
                await until(lambda: bad.lost_reason, "the fenced leadership dropped")
                assert bad.lost_reason.startswith("fenced write refused")
                # (the dropped leadership may still be listed for a moment: a new one is awaited)
                led = await until(lambda: replica.leaders.get("bad") not in (None, bad) and replica.leaders["bad"],
                                  "the job led again")
                assert led.term > bad.term and led.lost_reason is None
                await asyncio.wait_for(joining, 10)  # the join is retried with the new leader
                assert led.state.member("m") is not None
            finally:
                await joiner.stop()
            assert replica.leaders["good"] is good and good.lost_reason is None and not nodes[0].errors

    asyncio.run(scenario())


def test_an_unavailable_store_for_one_job_holds_its_decisions_and_no_other_jobs():
    async def scenario():
        twins = Twins()
        async with replicas_leading(twins, ("good", "bad")) as ([replica], nodes):
            good, bad = replica.leaders["good"], replica.leaders["bad"]
            twins.store.make_unavailable("bad")
            joiners = [SimulatedNode([replica.address], job, "m", slots=1, spec=SPEC) for job in ("good", "bad")]
            joining = [asyncio.ensure_future(j.join()) for j in joiners]
            try:
                await asyncio.wait_for(joining[0], 5)
                assert good.state.member("m") is not None
                refused = twins.store.refused  # ten of bad's tallies: each decides the join again, and is deferred
                await until(lambda: twins.store.refused >= refused + 10, "ten writes of bad's join refused")
                assert not joining[1].done() and bad.state.member("m") is None and bad.lost_reason is None
                twins.store.make_available()
                await asyncio.wait_for(joining[1], 5)
                assert replica.leaders["bad"] is bad and bad.state.member("m") is not None
            finally:
                for j in joiners:
                    await j.stop()
            assert good.lost_reason is None and not any(n.errors for n in nodes)

    asyncio.run(scenario())


def test_the_nodes_of_a_new_job_joining_at_once_create_it_once_within_its_runs_quota():
    """A job's nodes start together: their first Joins find no job and each would create it. One
    creates it (one run of the name's quota, whose burst is 10); the others wait for it and join it,
    none refused for runs it never made."""
    async def main():
        twins = Twins()
        create = twins.store.create_spec

        def slow_create(*args):  # an etcd write takes a while: the other Joins come meanwhile
            time.sleep(0.05)
            return create(*args)
        twins.store.create_spec = slow_create
        replica = Replica(twins.store, twins.coordination, ReplicaConfig(timing=TIMING, session_ttl_s=2, tick_s=0.02))
        server, port = await create_server(replica)
        replica.address = f"127.0.0.1:{port}"
        await server.start()
        await replica.start()
        nodes = [SimulatedNode([replica.address], "crowd", f"n{i}", slots=1, spec=pb.JobSpec(min_nodes=1, max_nodes=40))
                 for i in range(40)]
        try:
            await asyncio.gather(*(n.join() for n in nodes))
            assert replica.runs.budgets.of("crowd").runs.tokens >= 8, "one run spent of the burst of 10"
        finally:
            for node in nodes:
                await node.stop()
            await replica.close()
            await server.stop(grace=1.0)

    asyncio.run(main())



def test_a_leader_that_sees_the_session_loss_itself_while_another_stops_leaves_the_renewal_going():
    # Fresh-clone run Z: while the lost session's first leader stopped, the second saw the loss itself
    # and was dropped meanwhile; the renewal then met a KeyError and ended, and no job was led again.
    async def scenario():
        twins = Twins()
        async with replicas_leading(twins, ("a", "b"), n=1) as ([replica], nodes):
            old = dict(replica.leaders)
            stop = old["a"].stop

            async def stop_while_b_sees_it_itself(reason, **kw):
                replica._leadership_lost("b", "session lost: lease renewals failed past the renew deadline")
                await stop(reason, **kw)

            old["a"].stop = stop_while_b_sees_it_itself
            twins.coordination.expire(twins.coordination.leader_session("a"))
            for job in ("a", "b"):
                led = await until(lambda: replica.leaders.get(job) not in (None, old[job]) and replica.leaders[job],
                                  f"job {job} led again on the new session")
                assert led.term > old[job].term

    asyncio.run(scenario())


def test_a_client_call_waits_out_an_election_but_not_a_replica_that_does_not_answer():
    """Fresh-clone run S: `muster stop` met the one replica between two leaderships (its session lapsed
    under load) and failed with "no leader is elected yet, retry". A client verb now asks again for
    --election-wait (a failover takes seconds), and only while a replica answers so: an address
    nobody serves fails within the call's timeout."""
    import grpc

    from muster.client import Coordinators, electing
    from muster.net import free_port

    async def scenario():
        twins = Twins()
        async with replicas_leading(twins, ("j",), n=1) as ([replica], nodes):
            twins.coordination.make_unavailable()  # (the campaign for the next term waits)
            twins.coordination.expire(twins.coordination.leader_session("j"))
            await until(lambda: "j" not in replica.leaders, "the leadership lost")
            with Coordinators(replica.address, timeout_s=2) as at_once:
                with pytest.raises(grpc.RpcError) as refused:
                    await asyncio.to_thread(at_once.call, "Stop", pb.StopRequest(job="j"))
            assert electing(refused.value) and "no leader is elected yet" in refused.value.details()

            with Coordinators(replica.address, timeout_s=2, election_wait_s=10) as waiting:
                stop = asyncio.ensure_future(asyncio.to_thread(waiting.call, "Stop", pb.StopRequest(job="j")))
                await asyncio.sleep(1.0)
                assert not stop.done()
                twins.coordination.make_available()
                assert (await asyncio.wait_for(stop, 10)).run == 1
                assert replica.leaders["j"].term > 1

        with Coordinators(f"127.0.0.1:{free_port()}", timeout_s=1, election_wait_s=10) as nobody:
            began = time.monotonic()
            with pytest.raises(grpc.RpcError) as unanswered:
                await asyncio.to_thread(nobody.call, "Stop", pb.StopRequest(job="j"))
            assert not electing(unanswered.value) and time.monotonic() - began < 5

    asyncio.run(scenario())
