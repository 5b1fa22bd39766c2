"""A job's life on real coordinator processes and a real etcd, nodes over the real protocol: a run
ends exactly once with a recorded outcome, leaves nothing behind on any replica, and its name
starts a new numbered run; the operator verbs (jobs, stop, drain, delete) as a user calls them."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.request

import grpc
import pytest

from muster.client import Coordinators
from muster.local import SimulatedNode, wait_until
from muster.net import free_port
from muster.v1 import muster_pb2 as pb
from muster.v1 import muster_pb2_grpc as pb_grpc
from muster.worker.node_session import JobEnded

pytestmark = pytest.mark.timeout(90)


def active(node):
    return node.assignment().role == pb.ROLE_ACTIVE


def jobs(addresses, job: str = "") -> list[pb.JobRecord]:
    with Coordinators(addresses, timeout_s=5, retry_for_s=5) as c:
        return list(c.call("Jobs", pb.JobsRequest(job=job)).jobs)


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "muster.cli", "--log-level", "warning", *args], capture_output=True,
                          text=True, timeout=30)


async def session_refusal(address: str, first: pb.NodeFrame) -> grpc.aio.AioRpcError:
    """How a Session opened with `first` is refused."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = pb_grpc.CoordinatorStub(channel).Session(iter([first]))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in call:
                pass
    return refused.value


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def test_a_finished_run_ends_once_leaves_nothing_and_its_name_starts_run_two(coordinators, etcd_client):
    ports = [free_port("127.0.0.1") for _ in range(2)]
    replicas = [coordinators(1, ["--max-jobs", "1", "--metrics-listen", f"127.0.0.1:{p}"])[0] for p in ports]
    addresses = [r.address for r in replicas]

    async def run_once(job: str, expected_run: int) -> list[SimulatedNode]:
        spec = pb.JobSpec(min_nodes=2, max_nodes=2)
        nodes = [SimulatedNode(addresses, job, f"n{i}", slots=1, spec=spec) for i in range(2)]
        for n in nodes:
            assert (await n.join()).run == expected_run
            n.start()
        for n in nodes:
            await n.wait_for(active, 10, "the first map")
        g = nodes[0].assignment().generation
        nodes[0].finished = True  # its rank completed the script: the job is finishing
        await nodes[1].wait_for(lambda n: n.session.finishing, 5, "the leader says the job is finishing")
        nodes[1].exits.append(pb.RankExit(local_rank=0, pid=10_000, exit_code=-6))  # a crash now: no re-form
        nodes[1].session.send_now()
        # two of the leader's pulses each after it (a pulse period and more: many tallies), which carry
        # any generation it decided for the crash
        pulses = [n.session.pulses for n in nodes]
        for n, heard in zip(nodes, pulses):
            await n.wait_for(lambda x: x.session.pulses >= heard + 2, 5, "two pulses after the crash")
        assert all(n.generation == g and n.assignment().generation == g for n in nodes), \
            "nothing re-forms a finishing job"
        return nodes

    async def scenario():
        nodes = await run_once("a", 1)
        nodes[1].finished = True
        for n in nodes:
            await n.session.leave(finished=True, reason="done")
            await n.stop()
        (record,) = wait_until(lambda: [j for j in jobs(addresses, "a") if j.outcome != "running"], 10.0,
                               "run 1 recorded", interval_s=0.1)
        assert (record.run, record.outcome) == (1, "failed") and "rank 1" in record.reason  # the crash while finishing
        # Nothing of it stays on any replica, and --max-jobs 1 counts running jobs only.
        wait_until(lambda: all('job="a"' not in scrape(p) for p in ports), 10.0, "every replica forgot job a",
                   interval_s=0.1)
        assert any('muster_runs_ended_total{outcome="failed"} 1.0' in scrape(p) for p in ports), [[l for l in scrape(p).splitlines() if 'runs_ended' in l] for p in ports]
        # a standby's campaign withdraws its key as its thread sees the stop (within the campaign's poll, 0.5 s)
        wait_until(lambda: not list(etcd_client.get_prefix("/muster/v1/election/a/")), 5.0,
                   "every replica's election key for job a withdrawn", interval_s=0.1)
        assert not list(etcd_client.get_prefix("/muster/v1/specs/"))
        b = SimulatedNode(addresses, "b", "x", slots=1)
        await b.join()
        await b.session.leave(finished=True)
        wait_until(lambda: all('job="b"' not in scrape(p) for p in ports), 10.0, "every replica forgot job b",
                   interval_s=0.1)
        # The same name again: run 2, from generation 1, never joined by run 1's nodes.
        again = await run_once("a", 2)
        assert again[0].assignment().generation == 1
        stale = SimulatedNode(addresses, "a", "n0", slots=1)
        stale.session.member_id, stale.session.secret = nodes[0].member_id, nodes[0].session.secret
        stale.session.joined_run = 1
        stale.session.leader = again[0].leader
        stale.start()
        # told how its run ended, so that its agent exits with that outcome's code
        await stale.wait_for(lambda x: x.errors, 5, "the stale node's session ended")
        assert isinstance(stale.errors[0], JobEnded)
        assert (stale.errors[0].end.run, stale.errors[0].end.outcome) == (1, "failed")
        for n in again:
            n.finished = True
        for n in again:
            await n.session.leave(finished=True, reason="done")
            await n.stop()
        def ended() -> list[tuple[int, str]] | None:  # run 2 is listed as running until its end is recorded
            listed = [(j.run, j.outcome) for j in jobs(addresses, "a")]
            return listed if len(listed) == 2 and all(outcome != "running" for _, outcome in listed) else None

        runs = wait_until(ended, 10.0, "both runs listed as ended", interval_s=0.1)
        assert sorted(runs) == [(1, "failed"), (2, "failed")]

    asyncio.run(scenario())
    status = cli("status", "--coordinator", addresses[0], "--job", "a", "--run", "1", "--json")
    assert status.returncode == 0, status.stderr
    (js,) = json.loads(status.stdout)["jobs"]
    assert (js["run"], js["outcome"]) == (1, "failed")
    events = cli("events", "--coordinator", addresses[1], "--job", "a", "--run", "1")
    assert "finishing" in events.stdout and "failed" in events.stdout
    listed = cli("jobs", "--coordinator", addresses[0])
    assert listed.returncode == 0 and "succeeded" in listed.stdout  # b
    assert sum(line.split()[0] == "a" for line in listed.stdout.splitlines()[1:]) == 2


def test_every_rank_completing_succeeds_and_a_spare_is_told(coordinators):
    (leader,) = coordinators(1)

    async def scenario():
        spec = pb.JobSpec(min_nodes=1, max_nodes=1)
        worker, spare = (SimulatedNode([leader.address], "s", n, slots=1, spec=spec) for n in ("w", "spare"))
        for n in (worker, spare):
            await n.join()
            n.start()
        await worker.wait_for(active, 10, "its map")
        await spare.wait_for(lambda n: n.assignment().role == pb.ROLE_SPARE, 10, "a spare's place")
        worker.finished = True
        await worker.wait_for(lambda n: n.session.finishing, 5, "the leader heard the rank finish")
        await worker.session.leave(finished=True, reason="done")
        await spare.wait_for(lambda n: n.errors, 5, "the end of the run")
        assert isinstance(spare.errors[0], JobEnded) and spare.errors[0].end.outcome == "succeeded"
        for n in (worker, spare):
            await n.stop()

    asyncio.run(scenario())
    (record,) = jobs([leader.address], "s")
    assert record.outcome == "succeeded" and "completed its script" in record.reason and record.ended_unix_ms


def test_stop_drains_every_node_at_one_step_and_ends_stopped(coordinators):
    # The grace outlasts two CLI calls (a new interpreter each: 2-3 s at a load of 10 here)
    (leader,) = coordinators(1, ["--stop-grace", "8"])

    async def scenario():
        spec = pb.JobSpec(min_nodes=2, max_nodes=2)
        nodes = [SimulatedNode([leader.address], "st", f"n{i}", slots=1, spec=spec) for i in range(2)]
        for n in nodes:
            await n.join()
            n.start()
        for n in nodes:
            await n.wait_for(active, 10, "the first map")
        stopped = await asyncio.to_thread(cli, "stop", "--coordinator", leader.address, "st", "--reason", "maintenance")
        assert stopped.returncode == 0 and "stopped" in stopped.stdout, stopped.stderr
        drains = []
        for n in nodes:
            await n.wait_for(lambda x: any(d.HasField("drain") for d in x.directives), 5, "the stop's drain")
            drains.append(next(d.drain for d in n.directives if d.HasField("drain")))
        assert all(d.stop and d.reason == "maintenance" for d in drains)
        assert len({d.after_step for d in drains}) == 1, "every node drains at one step"
        await nodes[0].session.leave(reason="drained")  # n1 never leaves: the run ends after --stop-grace
        again = await asyncio.to_thread(cli, "stop", "--coordinator", leader.address, "st")
        assert again.returncode == 0 and again.stdout == "job st run 1 was stopped already: nothing changed\n", again
        await nodes[1].wait_for(lambda n: n.errors, 15, "the end of the run")
        assert isinstance(nodes[1].errors[0], JobEnded) and nodes[1].errors[0].end.outcome == "stopped"
        for n in nodes:
            await n.stop()

    asyncio.run(scenario())
    (record,) = jobs([leader.address], "st")
    assert (record.outcome, record.reason) == ("stopped", "maintenance")


def test_drain_one_node_then_delete_and_retention(coordinators):
    (leader,) = coordinators(1, ["--retain-finished", "3s"])

    async def scenario():
        spec = pb.JobSpec(min_nodes=1, max_nodes=2)
        nodes = [SimulatedNode([leader.address], "d", f"n{i}", slots=1, spec=spec) for i in range(2)]
        for n in nodes:
            await n.join()
            n.start()
        for n in nodes:
            await n.wait_for(lambda x: active(x) and x.assignment().world_size == 2, 10, "a map of both")
        drained = await asyncio.to_thread(cli, "drain", "--coordinator", leader.address, "--job", "d", "--node", "n1")
        assert drained.returncode == 0, drained.stderr
        await nodes[1].wait_for(lambda x: any(d.HasField("drain") and not d.drain.stop for d in x.directives), 5,
                                "the drain")
        await nodes[0].wait_for(lambda x: x.assignment().world_size == 1, 10, "the map without n1")
        refused = await asyncio.to_thread(cli, "delete", "--coordinator", leader.address, "d")
        assert refused.returncode == 1 and "NOT_FOUND" in refused.stderr  # nothing finished yet
        for n in nodes:
            await n.stop()
        await nodes[0].session.leave(finished=True, reason="done")

    asyncio.run(scenario())
    wait_until(lambda: [j for j in jobs([leader.address], "d") if j.outcome == "succeeded"], 10.0, "the run recorded",
               interval_s=0.1)
    # etcd deletes the record once its retention ends (its lease: etcd's shortest TTL is a few seconds)
    wait_until(lambda: not jobs([leader.address], "d"), 15, "the record gone after --retain-finished", interval_s=0.1)


def test_delete_removes_a_record_now_and_operator_verbs_need_an_operator_token(coordinators, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("* operator-token-0123456789\njob-a job-a-token-0123456789\n")
    tokens.chmod(0o600)
    (leader,) = coordinators(1, ["--tokens", str(tokens)])
    env_token = ["--token", "job-a-token-0123456789"]
    operator = ["--token", "operator-token-0123456789"]
    for verb in (["jobs"], ["stop", "job-a"], ["delete", "job-a"], ["drain", "--job", "job-a", "--node", "n"]):
        refused = cli(*verb, "--coordinator", leader.address, *env_token)
        assert refused.returncode == 1 and "PERMISSION_DENIED" in refused.stderr, (verb, refused.stderr)

    async def scenario():
        from muster.security import ClientSecurity

        node = SimulatedNode([leader.address], "job-a", "n0", slots=1, security=ClientSecurity("job-a-token-0123456789"))
        await node.join()
        node.start()
        await node.wait_for(active, 10, "its map")
        node.finished = True
        await node.wait_for(lambda n: n.session.finishing, 5, "the leader heard the rank finish")
        await node.session.leave(finished=True)
        await node.stop()

    asyncio.run(scenario())
    listed = wait_until(lambda: "succeeded" in (out := cli("jobs", "--coordinator", leader.address, *operator)).stdout
                        and out, 10.0, "the finished run listed", interval_s=0.1)
    assert "job-a" in listed.stdout
    deleted = cli("delete", "--coordinator", leader.address, "job-a", *operator)
    assert deleted.returncode == 0 and "deleted 1" in deleted.stdout, deleted.stderr
    assert "job-a" not in cli("jobs", "--coordinator", leader.address, *operator).stdout


def test_a_stale_stream_of_a_finished_run_is_refused_with_its_run_named(coordinators):
    (leader,) = coordinators(1)

    async def scenario():
        node = SimulatedNode([leader.address], "r", "n0", slots=1, spec=pb.JobSpec(min_nodes=1, max_nodes=1))
        await node.join()
        frame = pb.NodeFrame(job="r", node_id="n0", member_id=node.member_id, session_secret=node.session.secret, run=7)
        refused = await session_refusal(leader.address, frame)
        assert refused.code() == grpc.StatusCode.NOT_FOUND
        assert "run 7 of job 'r' has ended" in refused.details()
        await node.session.leave(immediate=True)

    asyncio.run(scenario())


def test_a_node_stream_claiming_its_run_back_after_it_ended_and_was_forgotten_makes_no_new_run(coordinators):
    """A node's stream can come back after its run ended (a leader change near the end), with the
    claim of who it was that lets a replica rebuild a job etcd lost. Its run's record is there: it is
    told how the run ended, and no empty run 2 is made (it never ended: CI run A, the slurm recipe)."""
    (leader,) = coordinators(1)

    async def scenario():
        node = SimulatedNode([leader.address], "s", "n0", slots=1, spec=pb.JobSpec(min_nodes=1, max_nodes=1))
        joined = await node.join()
        node.start()
        await node.wait_for(active, 10, "the first map")
        node.finished = True
        await node.session.leave(finished=True, reason="done")
        await node.stop()
        wait_until(lambda: [j for j in jobs([leader.address], "s") if j.outcome == "succeeded"], 10.0,
                   "run 1 recorded", interval_s=0.1)
        claim = pb.NodeFrame(job="s", node_id="n0", member_id=joined.member_id, session_secret=joined.session_secret,
                             run=joined.run, generation=1, stream_seq=2,
                             rejoin=pb.JoinRequest(job="s", node_id="n0", slots=1, host="127.0.0.1", store_port=29500,
                                                   spec=pb.JobSpec(min_nodes=1, max_nodes=1)))
        refused = await session_refusal(leader.address, claim)
        assert refused.code() == grpc.StatusCode.NOT_FOUND
        assert "run 1 of job 's' has ended (succeeded)" in refused.details()

    asyncio.run(scenario())
    assert [(j.run, j.outcome) for j in jobs([leader.address], "s")] == [(1, "succeeded")]
    assert not leader.find("job_spec_created", job="s")[1:]  # run 1's only
