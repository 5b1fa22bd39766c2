"""Status in pages through the real gRPC server: the leader's live pages and a standby's persisted
ones, the node and states filters, precise refusals of bad paging input, and `muster status`
showing the summary and following the pages."""

import asyncio
import json
import subprocess
import sys

import grpc
import pytest
from muster.local import SimulatedNode

from muster.v1 import muster_pb2 as pb
from muster.v1 import muster_pb2_grpc as pb_grpc

JOB = "paged"


def muster(*args, timeout=30):
    return subprocess.run([sys.executable, "-m", "muster.cli", *args], capture_output=True, text=True, timeout=timeout)


async def pages(stub, **request) -> list[pb.JobStatus]:
    found, token = [], ""
    while True:
        js = (await stub.Status(pb.StatusRequest(job=JOB, page_token=token, **request), timeout=5)).jobs[0]
        found.append(js)
        token = js.next_page_token
        if not token:
            return found


async def refused(stub, request: pb.StatusRequest) -> tuple[str, str]:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Status(request, timeout=5)
    assert len(err.value.details()) < 300
    return err.value.code().name, err.value.details()


@pytest.mark.timeout(90)
def test_status_pages_live_at_the_leader_and_persisted_at_a_standby(coordinators):
    replicas = coordinators(2)

    async def scenario():
        agents = [SimulatedNode([replicas[0].address], JOB, f"n{i}", slots=3,
                                spec=pb.JobSpec(min_nodes=3, max_nodes=3)) for i in range(4)]
        for a in agents:
            await a.join()
            a.start()
        for a in agents[:3]:
            await a.wait_for(lambda x: x.assignment().role == pb.ROLE_ACTIVE and x.step > 2, 10, "steps")
        leader = agents[0].leader
        standby = next(r.address for r in replicas if r.address != leader)
        async with grpc.aio.insecure_channel(leader) as lc, grpc.aio.insecure_channel(standby) as sc:
            live, persisted = pb_grpc.CoordinatorStub(lc), pb_grpc.CoordinatorStub(sc)

            # The leader: 9 ranks in pages of 4 (the second starts inside node n1), summary first.
            got = await pages(live, page_size=4)
            assert [[r.rank for r in js.ranks] for js in got] == [[0, 1, 2, 3], [4, 5, 6, 7], [8]]
            assert (got[1].ranks[0].node, got[1].ranks[0].local_rank) == ("n1", 1)
            first = got[0]
            assert first.live and (first.summary.nodes, first.summary.spares) == (4, 1)
            assert dict(first.summary.rank_states) == {"running": 9} and first.health.live_ranks == 9
            assert list(first.spares) == ["n3"] and len(first.nodes) == 4
            assert all(not js.HasField("summary") and not js.nodes for js in got[1:])
            # A job under the default page size: one page, every rank.
            (whole,) = await pages(live)
            assert [r.rank for r in whole.ranks] == list(range(9)) and whole.next_page_token == ""

            node = (await live.Status(pb.StatusRequest(job=JOB, node="n2"), timeout=5)).jobs[0]
            assert [(r.rank, r.node) for r in node.ranks] == [(6, "n2"), (7, "n2"), (8, "n2")]
            assert not node.HasField("summary")
            assert not (await live.Status(pb.StatusRequest(job=JOB, node="n3"), timeout=5)).jobs[0].ranks
            exited = await pages(live, states=["exited", "unknown"])
            assert not [r for js in exited for r in js.ranks]

            # A standby: the persisted map, paged the same.
            got = await pages(persisted, page_size=5)
            assert [[r.rank for r in js.ranks] for js in got] == [[0, 1, 2, 3, 4], [5, 6, 7, 8]]
            assert not got[0].live and dict(got[0].summary.rank_states) == {"persisted": 9}
            assert {r.state for js in got for r in js.ranks} == {"persisted"}

            for stub in (live, persisted):
                assert await refused(stub, pb.StatusRequest(job=JOB, page_size=5001)) == \
                    ("INVALID_ARGUMENT", "page_size is 5001; at most 5000 (0: 1000)")
                code, details = await refused(stub, pb.StatusRequest(job=JOB, page_token="-1" * 5000))
                assert code == "INVALID_ARGUMENT" and "(10000 chars)" in details
                code, details = await refused(stub, pb.StatusRequest(job=JOB, page_token="g1r99"))
                assert code == "INVALID_ARGUMENT" and "beyond the job's world size 9" in details
                code, details = await refused(stub, pb.StatusRequest(job=JOB, page_token="g9r1"))
                assert code == "FAILED_PRECONDITION" and "without a page_token" in details
                code, details = await refused(stub, pb.StatusRequest(job=JOB, node="n7"))
                assert code == "NOT_FOUND" and "'n7' is no member" in details
                code, details = await refused(stub, pb.StatusRequest(job=JOB, states=["dead"]))
                assert code == "INVALID_ARGUMENT" and "'dead' is no rank state" in details
            code, details = await refused(persisted, pb.StatusRequest(page_token="g1r0"))
            assert code == "INVALID_ARGUMENT" and "need a job" in details

        # The CLI at the standby: the leader's live pages, all of them with --all.
        out = await asyncio.to_thread(muster, "status", "--coordinator", standby, "--job", JOB, "--json",
                                      "--page-size", "4", "--all")
        assert out.returncode == 0, out.stderr
        (job,) = json.loads(out.stdout)["jobs"]
        assert [r["rank"] for r in job["ranks"]] == list(range(9)) and job["next_page_token"] is None
        assert job["summary"]["rank_states"] == {"running": 9} and job["live"]
        table = await asyncio.to_thread(muster, "status", "--coordinator", standby, "--job", JOB, "--page-size", "4")
        assert table.returncode == 0, table.stderr
        assert "nodes 4  spares 1  ranks: 9 running" in table.stdout and "spares: n3" in table.stdout
        assert "more ranks: --page-token g1r4 (or --all)" in table.stdout
        node = await asyncio.to_thread(muster, "status", "--coordinator", standby, "--job", JOB, "--node", "n1")
        assert node.returncode == 0 and node.stdout.count(" n1 ") == 3 and " n0 " not in node.stdout
        bad = await asyncio.to_thread(muster, "status", "--coordinator", standby, "--job", JOB, "--states", "dead")
        assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr and "'dead' is no rank state" in bad.stderr
        for a in agents:
            await a.stop()

    asyncio.run(scenario())
