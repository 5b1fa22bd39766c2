"""A fault in leading one job (its tally, loading its state) ends only that job's leadership: its
election key is resigned, the job is campaigned for again after a backoff and led again once the
fault is gone; the other jobs of the replica keep their leader. In-process replica, real etcd."""

import asyncio

import pytest
from muster.local import SimulatedNode
from muster.testing import until

from muster.coordinator.core.policy import Timing
from muster.coordinator.etcd.client import connect
from muster.coordinator.etcd.election import EtcdCoordination, current_leader
from muster.coordinator.etcd.store import JobStore
from muster.coordinator.job.leader import JobLeader
from muster.coordinator.replica.replica import Replica, ReplicaConfig
from muster.coordinator.edges.server import create_server
from muster.v1 import muster_pb2 as pb

TIMING = Timing(heartbeat_interval_s=0.05, heartbeat_timeout_s=1.0, grace_s=2.0, last_call_s=0.3)




@pytest.mark.timeout(90)
def test_a_fault_in_one_jobs_leadership_drops_only_that_job_until_it_is_gone(etcd, monkeypatch):
    faults = {"tally": False, "load": 0}  # load: how many loads of the faulty job failed
    tally, load_state = JobLeader.tally_once, None

    async def faulty_tally(self, *events):
        if self.job == "bad" and faults["tally"]:
            raise RuntimeError("injected tally fault")
        await tally(self, *events)

    def faulty_load(job):
        if job == "bad" and faults["load"] >= 0:
            faults["load"] += 1
            raise RuntimeError("injected load fault")
        return load_state(job)

    async def scenario():
        nonlocal load_state
        client = connect([etcd.endpoint])
        replica = Replica(JobStore(client), EtcdCoordination(client), ReplicaConfig(timing=TIMING, session_ttl_s=2,
                                                                                   tick_s=0.05))
        server, port = await create_server(replica)
        replica.address = f"127.0.0.1:{port}"
        await server.start()
        await replica.start()
        load_state = replica.store.load_state
        nodes = {}
        try:
            for job in ("good", "bad"):
                nodes[job] = SimulatedNode([replica.address], job, "n", slots=1, spec=pb.JobSpec(min_nodes=1))
                await nodes[job].join()
                nodes[job].start()
            for node in nodes.values():
                await node.wait_for(lambda x: x.assignment().role == pb.ROLE_ACTIVE, 10, "first map")
            good, bad = replica.leaders["good"], replica.leaders["bad"]
            good_stream = good.streams["n"]

            monkeypatch.setattr(JobLeader, "tally_once", faulty_tally)
            faults["tally"] = True
            await until(lambda: replica.leaders.get("bad") is not bad, "the faulty job dropped", timeout_s=5)
            assert bad.lost_reason.startswith("tally failed: RuntimeError")

            # while it fails, loading it fails too: every new leadership of it is dropped again
            monkeypatch.setattr(replica.store, "load_state", faulty_load)
            faults["tally"] = False
            await until(lambda: faults["load"] >= 2, "the faulty job campaigned for again", timeout_s=10)
            assert "bad" not in replica.leaders
            found = await asyncio.to_thread(current_leader, client, "bad")
            assert found is None or found[1] != bad.term, "the failed term's election key was resigned"

            faults["load"] = -1
            led = await until(lambda: replica.leaders.get("bad"), "the job led again once the fault is gone",
                              timeout_s=15)
            assert led.term > bad.term and led.lost_reason is None
            asg = await nodes["bad"].wait_for(lambda x: x.term == led.term, 10, "its node follows the new term")
            assert asg.role == pb.ROLE_ACTIVE and not nodes["bad"].errors

            # the other job kept its leader, its term and its node's stream throughout
            assert replica.leaders["good"] is good and good.lost_reason is None
            assert good.streams["n"] is good_stream and nodes["good"].term == good.term
            assert not nodes["good"].errors and replica.ready()
        finally:
            for node in nodes.values():
                await node.stop()
            await replica.close()
            await server.stop(grace=1.0)
            client.close()

    asyncio.run(scenario())
