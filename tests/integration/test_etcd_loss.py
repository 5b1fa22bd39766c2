"""etcd loses the job (its keys deleted under the nodes' feet, or its data directory): the replica
that leads next finds no spec and no state, takes the nodes back as they reconnect and re-forms
them in one generation above theirs (a planned switch: the group they ran was whole); the job keeps its nodes, its member ids, and its
failure detection. Its ranks follow the order the nodes were taken back in (a claimed member id
proves no seniority)."""

import asyncio
import json
import shutil
import time

import pytest
from muster.local import CoordinatorProcess, SimulatedNode, wait_until

from muster.client import Coordinators
from muster.coordinator.core.state import decode
from muster.coordinator.etcd.store import JobStore
from muster.net import free_port
from muster.v1 import muster_pb2 as pb

JOB = "lost"


def events(address: str) -> list[pb.Event]:
    with Coordinators([address], timeout_s=2) as c:
        try:
            return list(c.call("Events", pb.EventsRequest(job=JOB)).events)
        except Exception:  # not serving the job yet
            return []


@pytest.mark.timeout(90)
def test_after_etcd_lost_the_job_the_new_leader_rebuilds_it_from_the_nodes(coordinators, etcd_client):
    replicas = coordinators(2)
    addresses = [r.address for r in replicas]

    async def scenario():
        spec = pb.JobSpec(min_nodes=2, max_nodes=3)
        nodes = [SimulatedNode(addresses, JOB, f"node-{i}", slots=2, spec=spec) for i in range(3)]
        for n in nodes:
            await n.join()
            n.start()
        for n in nodes:
            await n.wait_for(lambda x: x.assignment().world_size == 6, 10, "the first map")
        before = {n.node_id: (n.member_id, n.assignment().rank_offset) for n in nodes}
        generation = nodes[0].generation
        old = next(r for r in replicas if r.find("leadership_acquired", job=JOB))
        standby = next(r for r in replicas if r is not old)

        deleted = await asyncio.to_thread(etcd_client.delete_prefix, "/muster/")
        assert deleted.deleted >= 3  # spec, state, election keys
        old.kill()  # its streams end: the nodes look for the leader

        rebuilt = await asyncio.to_thread(
            wait_until, lambda: [e for e in events(standby.address) if e.kind == "state_rebuilt"], 15,
            "the new leader's state_rebuilt event")
        assert "rebuilt from the 3 node(s)" in rebuilt[0].reason and sorted(rebuilt[0].nodes) == sorted(before)
        taken_back = [r["node"] for r in standby.find("node_taken_back", job=JOB)]
        assert sorted(taken_back) == sorted(before)
        for n in nodes:
            asg = await n.wait_for(lambda x: x.generation > generation and x.assignment().world_size == 6, 10,
                                   "the rebuilt generation")
            # every node came back from one generation, whole: kept, a planned switch past their steps
            assert not asg.abort_previous and asg.switch_at_step > 0, asg
            assert asg.role == pb.ROLE_ACTIVE and asg.generation == generation + 1
            assert n.member_id == before[n.node_id][0] and not n.errors
            assert asg.rank_offset == 2 * taken_back.index(n.node_id)
            assert n.leader == standby.address

        state = decode(JobStore(etcd_client).load_state(JOB))
        assert {m.node_id: m.member_id for m in state.members} == {k: v[0] for k, v in before.items()}
        assert all(m.secret_hash for m in state.members) and not state.rebuilding
        assert state.generation == generation + 1 and (state.spec.min_nodes, state.spec.max_nodes) == (2, 3)
        assert JobStore(etcd_client).get_spec(JOB) is not None

        # failure detection goes on: a node that falls silent is replaced by the next generation
        nodes[2].silent = True
        silenced = time.monotonic()
        for n in nodes[:2]:
            asg = await n.wait_for(lambda x: x.generation > generation + 1, 10, "the generation without node-2")
            assert asg.abort_previous and asg.world_size == 4
        assert time.monotonic() - silenced < 5
        assert "node_silent" in [e.kind for e in events(standby.address)]
        for n in nodes:
            await n.stop()

    asyncio.run(scenario())


@pytest.mark.timeout(120)
def test_etcd_coming_back_empty_is_rebuilt_from_the_nodes_though_its_terms_start_again(coordinators, etcd,
                                                                                       etcd_client):
    for i in range(40):  # revisions (the terms) well past where an empty etcd's election ends
        etcd_client.put(f"/unrelated/{i}", b"x")
    replicas = coordinators(2)
    addresses = [r.address for r in replicas]

    async def scenario():
        spec = pb.JobSpec(min_nodes=2, max_nodes=2)
        nodes = [SimulatedNode(addresses, JOB, f"node-{i}", slots=1, spec=spec) for i in range(2)]
        for n in nodes:
            await n.join()
            n.start()
        for n in nodes:
            await n.wait_for(lambda x: x.assignment().world_size == 2, 10, "the first map")
        generation, term = nodes[0].generation, nodes[0].term

        # a lost volume: etcd restarts with nothing, its revisions (the terms) start again at 1
        await asyncio.to_thread(etcd.kill)
        shutil.rmtree(etcd.data_dir / f"{etcd.name}.etcd")
        await asyncio.to_thread(etcd.start)

        for n in nodes:
            asg = await n.wait_for(lambda x: x.generation > generation, 30, "the rebuilt generation")
            assert not asg.abort_previous and asg.role == pb.ROLE_ACTIVE and asg.generation == generation + 1
            assert not n.errors and n.term < term
        leader = nodes[0].leader
        assert [e.kind for e in events(leader)][-2:] == ["state_rebuilt", "generation"]
        for n in nodes:
            await n.stop()

    asyncio.run(scenario())



@pytest.mark.timeout(90)
def test_a_replica_started_after_etcd_lost_the_job_creates_it_from_the_nodes_that_reconnect(etcd, etcd_client,
                                                                                              tmp_path):
    first = CoordinatorProcess([etcd.endpoint], tmp_path / "first.log").start()
    late = CoordinatorProcess([etcd.endpoint], tmp_path / "late.log", listen=f"127.0.0.1:{free_port()}")
    late_address = late.args[late.args.index("--listen") + 1]

    async def scenario():
        spec = pb.JobSpec(min_nodes=2, max_nodes=2)
        nodes = [SimulatedNode([first.address, late_address], JOB, f"node-{i}", slots=1, spec=spec) for i in range(2)]
        for n in nodes:
            await n.join()
            n.start()
        for n in nodes:
            await n.wait_for(lambda x: x.assignment().world_size == 2, 10, "the first map")
        generation = nodes[0].generation

        await asyncio.to_thread(etcd_client.delete_prefix, "/muster/")
        await asyncio.to_thread(late.start)  # it has never heard of the job
        first.kill()
        for n in nodes:
            asg = await n.wait_for(lambda x: x.generation > generation, 15, "the rebuilt generation")
            assert not asg.abort_previous and asg.role == pb.ROLE_ACTIVE and not n.errors and n.leader == late_address
        assert "state_rebuilt" in [e.kind for e in events(late_address)]
        store = JobStore(etcd_client)  # the job's spec came with its nodes
        assert json.loads(store.get_spec(JOB)) == {"min_nodes": 2, "max_nodes": 2, "world_size_multiple": 1, "run": 1}
        assert len(decode(store.load_state(JOB)).members) == 2
        for n in nodes:
            await n.stop()

    try:
        asyncio.run(scenario())
    finally:
        first.stop()
        late.stop()
