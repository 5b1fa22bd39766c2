"""Coordinator replicas as real processes on a real etcd, scripted agents over real gRPC."""

import asyncio

import pytest
from muster.local import SimulatedNode

from muster.v1 import muster_pb2 as pb


def active(a):
    return a.assignment().role == pb.ROLE_ACTIVE


def ranks_of(a):
    asg = a.assignment()
    return [asg.rank_offset + i for i in range(asg.local_world_size)]


@pytest.mark.timeout(60)
def test_agents_join_stream_and_a_silent_one_is_replaced_by_the_next_generation(coordinators):
    (leader,) = coordinators(1)

    async def scenario():
        spec = pb.JobSpec(min_nodes=2, max_nodes=3)
        agents = [SimulatedNode([leader.address], "train", f"node-{i}", slots=2, spec=spec) for i in range(3)]
        for a in agents:
            await a.join()
            a.start()
        for a in agents:
            await a.wait_for(active, 10, "first map")
        g1 = agents[0].assignment().generation
        assert sorted(r for a in agents for r in ranks_of(a)) == list(range(6))
        assert [a.assignment().node_rank for a in agents] == [0, 1, 2]
        assert agents[0].assignment().store_address == "127.0.0.1:29500"
        agents[1].silent = True
        for a in (agents[0], agents[2]):
            await a.wait_for(lambda x: x.assignment().generation > g1, 5, "next generation")
        a0, a2 = agents[0].assignment(), agents[2].assignment()
        assert a0.abort_previous and a0.world_size == 4 and a0.num_nodes == 2
        assert (a0.rank_offset, a0.node_rank, list(a0.local_ranks)) == (0, 0, [0, 1])
        assert (a2.rank_offset, a2.node_rank, list(a2.local_ranks)) == (2, 1, [0, 1])
        assert a0.store_prefix != agents[0].directives[0].assignment.store_prefix
        for a in agents:
            await a.stop()

    asyncio.run(scenario())
    kinds = [r["kind"] for r in leader.find("membership_changed")]
    assert "node_silent" in kinds and kinds.count("formed") == 1


@pytest.mark.timeout(60)
def test_a_node_joining_a_running_job_receives_its_map_at_a_planned_step(coordinators):
    (leader,) = coordinators(1)

    async def scenario():
        spec = pb.JobSpec(min_nodes=1, max_nodes=4)
        first = SimulatedNode([leader.address], "grow", "a", slots=2, spec=spec)
        await first.join()
        first.start()
        await first.wait_for(active, 10, "first map")
        late = SimulatedNode([leader.address], "grow", "b", slots=2, spec=spec)
        await late.join()
        late.start()
        asg = await late.wait_for(lambda x: active(x) and x.assignment().world_size == 4, 5, "map with b")
        assert (asg.node_rank, asg.rank_offset, asg.local_world_size) == (1, 2, 2)
        assert not asg.abort_previous and asg.switch_at_step >= 2
        seen = await first.wait_for(lambda x: x.assignment().world_size == 4, 5, "a sees the new map")
        assert seen.switch_at_step == asg.switch_at_step and seen.generation == asg.generation
        await first.stop()
        await late.stop()

    asyncio.run(scenario())


@pytest.mark.timeout(60)
def test_a_standby_points_callers_at_the_leader(coordinators):
    first, second = coordinators(2)

    async def scenario():
        agent = SimulatedNode([first.address], "ha", "a", slots=1)
        await agent.join()
        leader = agent.leader
        standby = second.address if leader == first.address else first.address
        async with __import__("grpc").aio.insecure_channel(standby) as channel:
            stub = __import__("muster.v1.muster_pb2_grpc", fromlist=["x"]).CoordinatorStub(channel)
            with pytest.raises(Exception) as err:
                await stub.Join(pb.JoinRequest(job="ha", node_id="b", slots=1, host="127.0.0.1", store_port=1))
            assert err.value.code().name == "UNAVAILABLE"
            assert dict(err.value.trailing_metadata())["muster-leader"] == leader
            assert leader in err.value.details()
            status = await stub.Status(pb.StatusRequest(job="ha"))
            assert status.jobs[0].leader == leader and not status.jobs[0].live
        follower = SimulatedNode([standby], "ha", "b", slots=1)
        await follower.join()  # follows the hint
        assert follower.leader == leader

    asyncio.run(scenario())
