"""Leader election and fencing with coordinator replicas as real processes on a real etcd."""

import asyncio
import signal
import time

import pytest
from muster.local import SimulatedNode, wait_until

from muster.client import Coordinators
from muster.coordinator.core.state import decode
from muster.coordinator.etcd.store import JobStore
from muster.v1 import muster_pb2 as pb

TTL_S = 2  # the harness runs replicas with --session-ttl 2


def live_leader(address: str, job: str):
    """(leader, term) as the replica at `address` sees it, when it leads the job itself."""
    with Coordinators([address], timeout_s=1) as c:
        try:
            status = c.call("Status", pb.StatusRequest(job=job))
        except Exception:
            return None
    j = status.jobs[0]
    return (j.leader, j.term) if j.live and j.leader == address else None


def stored_state(etcd_client, job):
    return decode(JobStore(etcd_client).load_state(job))


async def running_agents(addresses, job, n):
    agents = [SimulatedNode(addresses, job, f"node-{i}", slots=1, spec=pb.JobSpec(min_nodes=n, max_nodes=n))
              for i in range(n)]
    for a in agents:
        await a.join()
        a.start()
    for a in agents:
        await a.wait_for(lambda x: x.assignment().role == pb.ROLE_ACTIVE, 10, "first map")
    return agents


@pytest.mark.timeout(90)
def test_exactly_one_replica_leads_and_after_sigkill_the_standby_leads_within_ttl(coordinators, etcd_client):
    replicas = coordinators(2)
    addresses = [r.address for r in replicas]

    async def scenario():
        agents = await running_agents(addresses, "kill", 2)
        leaders = [r for r in replicas if r.find("leadership_acquired", job="kill")]
        assert len(leaders) == 1
        old, standby = leaders[0], next(r for r in replicas if r is not leaders[0])
        _, old_term = live_leader(old.address, "kill")
        generation = agents[0].generation
        killed_at = time.monotonic()
        old.kill()
        while live_leader(standby.address, "kill") is None:
            assert time.monotonic() - killed_at < TTL_S + 1, "standby did not lead within TTL + 1 s"
            await asyncio.sleep(0.02)
        _, new_term = live_leader(standby.address, "kill")
        assert new_term > old_term
        # agents reconnect within the grace period: nobody is evicted, the generation stays
        for a in agents:
            await a.wait_for(lambda x: x.term == new_term, 5, "reconnect to the new leader")
        # four of the new leader's pulses each (1 s of its clock: a pulse every heartbeat timeout / 4),
        # which carry any generation it decided meanwhile
        pulses = [a.session.pulses for a in agents]
        for a, heard in zip(agents, pulses):
            await a.wait_for(lambda x: x.session.pulses >= heard + 4, 5, "four pulses of the new leader")
        assert all(a.generation == generation for a in agents)
        state = stored_state(etcd_client, "kill")
        assert len(state.members) == 2 and state.generation == generation
        # still within the new leader's grace (2 s): a process-exit report acts at once
        agents[1].exits.append(pb.RankExit(local_rank=0, pid=10_000, exit_code=-9))
        reported = time.monotonic()
        await agents[0].wait_for(lambda x: x.generation > generation, 0.9, "abort generation during the grace")
        assert time.monotonic() - reported < 0.5
        asg = agents[0].assignment()  # min_nodes=2: the job waits for a node
        assert asg.abort_previous and asg.role == pb.ROLE_WAITING and "min_nodes=2" in asg.reason
        for a in agents:
            await a.stop()

    asyncio.run(scenario())


@pytest.mark.timeout(90)
def test_a_stopped_leader_is_replaced_and_once_resumed_steps_down_without_writing(coordinators, etcd_client):
    replicas = coordinators(2)
    addresses = [r.address for r in replicas]

    async def scenario():
        agents = await running_agents(addresses, "stop", 2)
        old = next(r for r in replicas if r.find("leadership_acquired", job="stop"))
        standby = next(r for r in replicas if r is not old)
        _, old_term = live_leader(old.address, "stop")
        old.signal(signal.SIGSTOP)
        try:
            stopped_at = time.monotonic()
            while live_leader(standby.address, "stop") is None:
                assert time.monotonic() - stopped_at < TTL_S + 2, "no new leader while the old one is stopped"
                await asyncio.sleep(0.05)
            _, new_term = live_leader(standby.address, "stop")
            for a in agents:
                await a.wait_for(lambda x: x.term == new_term, 5, "agents follow the new leader")
        finally:
            old.signal(signal.SIGCONT)
        await asyncio.to_thread(wait_until, lambda: old.find("leadership_lost", job="stop"), 10, "old steps down")
        lost = old.find("leadership_lost", job="stop")[0]
        assert "session lost" in lost["reason"] or "fenced" in lost["reason"]
        # it now points callers at the new leader, and never wrote state after losing
        with Coordinators([old.address], timeout_s=2) as c:
            job = c.call("Status", pb.StatusRequest(job="stop")).jobs[0]
        assert job.leader == standby.address and not job.live
        # the resumed replica saw no frame for seconds, yet evicted nobody: it could not write
        late = SimulatedNode(addresses, "stop", "late", slots=1)
        await late.join()
        state = stored_state(etcd_client, "stop")
        assert state.term == new_term and [m.node_id for m in state.members] == ["node-0", "node-1", "late"]
        assert [e.term for e in state.history] == sorted(e.term for e in state.history)
        assert {e.term for e in state.history} == {old_term, new_term}
        assert not [e for e in state.history if e.kind == "node_silent"]
        for a in agents:
            await a.stop()

    asyncio.run(scenario())


@pytest.mark.timeout(90)
def test_jobs_spread_over_the_replicas(coordinators):
    replicas = coordinators(2)
    addresses = [r.address for r in replicas]

    async def scenario():
        nodes = []
        for i in range(4):
            node = SimulatedNode(addresses[i % 2:] + addresses[:i % 2], f"job-{i}", "n", slots=1)
            await node.join()
            nodes.append(node)
        return {n.leader for n in nodes}

    leaders = asyncio.run(scenario())
    assert leaders == set(addresses)
    for r in replicas:
        assert r.find("leadership_acquired")
