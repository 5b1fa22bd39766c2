"""The `muster` command as users run it: serve (embedded etcd), status, events."""

import asyncio
import json
import re
import signal
import subprocess
import sys

import grpc
import pytest
from muster.local import CoordinatorProcess, SimulatedNode, process_alive, wait_until

from muster import version
from muster.net import free_port
from muster.v1 import muster_pb2 as pb
from muster.names import job_name


def muster(*args, timeout=30):
    return subprocess.run([sys.executable, "-m", "muster.cli", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(90)
def test_status_and_events_report_the_job_from_any_replica_skipping_dead_ones(coordinators):
    replicas = coordinators(2)
    dead = f"127.0.0.1:{free_port()}"

    async def scenario():
        agents = [SimulatedNode([replicas[0].address], "cli", f"n{i}", slots=2, spec=pb.JobSpec(min_nodes=2, max_nodes=2))
                  for i in range(3)]
        for a in agents:
            await a.join()
            a.start()
        for a in agents[:2]:
            await a.wait_for(lambda x: x.assignment().role == pb.ROLE_ACTIVE, 10, "map")
        await agents[0].wait_for(lambda x: x.step > 3, 5, "steps")
        for replica in replicas:
            out = await asyncio.to_thread(
                muster, "status", "--coordinator", f"{dead},{replica.address}", "--job", "cli", "--json")
            assert out.returncode == 0, out.stderr
            doc = json.loads(out.stdout)
            assert doc["leader"] == agents[0].leader and doc["term"] > 0
            (job,) = doc["jobs"]
            assert (job["name"], job["generation"], job["world_size"], job["spares"]) == ("cli", 1, 4, ["n2"])
            assert sorted(r["rank"] for r in job["ranks"]) == [0, 1, 2, 3]
            r0 = next(r for r in job["ranks"] if r["rank"] == 0)
            assert (r0["node"], r0["local_rank"], r0["node_rank"], r0["pid"], r0["host"], r0["state"]) == \
                ("n0", 0, 0, 10000, "127.0.0.1", "running")
            assert r0["step"] > 0
        row, shown = ["0", "0", "n0", "0", "127.0.0.1", "10000"], []

        def table_row() -> subprocess.CompletedProcess | None:
            """The table once it shows rank 0's row (a leader that took over meanwhile, its etcd session
            lost on a loaded host, lists a rank once its node reattached)."""
            shown.append(muster("status", "--coordinator", replicas[1].address))
            return shown[-1] if any(line.split()[:6] == row for line in shown[-1].stdout.splitlines()) else None

        table = await asyncio.to_thread(wait_until, table_row, 15, "rank 0's row in the status table", interval_s=0.5,
                                        diagnose=lambda: shown[-1])
        assert table.returncode == 0 and "job cli" in table.stdout and "spares: n2" in table.stdout
        assert table.stdout.startswith(f"replica {replicas[1].address}  muster {version()}\n")
        events = await asyncio.to_thread(muster, "events", "--coordinator", replicas[1].address, "--job", "cli", "--json")
        kinds = [e["kind"] for e in json.loads(events.stdout)["events"]]
        # (a spare that joins while the job runs may start its ranks first: recovered once they report)
        assert [k for k in kinds if k != "rank_recovered"] == ["node_joined", "node_joined", "formed", "node_joined"]
        text = await asyncio.to_thread(muster, "events", "--coordinator", replicas[0].address, "--job", "cli")
        assert "formed" in text.stdout and "world_size=4 on 2 node(s)" in text.stdout
        # the job named the other way, asked of its leader: the first map's recovery, its timeline in a line
        text = await asyncio.to_thread(muster, "events", "cli", "--coordinator", agents[0].leader)
        assert re.search(r"^recovery g1 planned: \d\.\d{3}s \(detected .* first step \d\.\d{3}s\); slowest: [a-z_]+$",
                         text.stdout, re.M), text.stdout
        for a in agents:
            await a.stop()

    asyncio.run(scenario())


@pytest.mark.timeout(90)
def test_serve_without_etcd_runs_a_private_etcd_only_its_owner_reaches_and_stops_it_on_exit(tmp_path):
    """Security review 4, N6: the embedded etcd listened on loopback without auth, so any local user
    read the secret hashes and rewrote job states. Its auth is on now, root's password in a 0600
    file of the data directory; a second start over the same data uses it."""
    from muster.coordinator.etcd.client import connect

    for start in ("first", "again"):
        serve = CoordinatorProcess([], tmp_path / f"serve-{start}.log", ["--data-dir", str(tmp_path / "data")]).start()
        try:
            etcd = serve.find("embedded_etcd_started")[0]
            assert process_alive(etcd["pid"])
            assert bool(serve.find("embedded_etcd_auth_enabled")) == (start == "first")
            password = tmp_path / "data" / "etcd-root-password"
            assert password.stat().st_mode & 0o777 == 0o600 and len(password.read_text().strip()) >= 32
            with pytest.raises(grpc.RpcError) as refused:
                connect([etcd["endpoint"]]).get("/muster/")  # another local user, without the password
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "user name" in refused.value.details()
            out = muster("status", "--coordinator", serve.address, "--json")
            assert out.returncode == 0 and json.loads(out.stdout)["jobs"] == []
            serve.signal(signal.SIGTERM)
            serve.proc.wait(15)
            assert serve.proc.returncode == 0
            wait_until(lambda: not process_alive(etcd["pid"]), 5, "embedded etcd to stop")
            assert (tmp_path / "data" / "etcd").is_dir()
        finally:
            serve.stop()


@pytest.mark.timeout(60)
def test_an_agent_no_coordinator_accepts_gives_up_after_its_join_timeout():
    out = muster("run", "--coordinator", f"127.0.0.1:{free_port()}", "--job", "$SLURM_JOB_ID", "--join-timeout", "4",
                 "--", sys.executable, "-c", "pass", timeout=50)
    assert out.returncode == 1
    assert "join_waiting" in out.stderr  # said while waiting, not only at the end
    assert "muster run: no coordinator at 127.0.0.1:" in out.stderr and "within 4s (--join-timeout)" in out.stderr
    assert "job 'slurm_job_id-" in out.stderr


@pytest.mark.timeout(60)
def test_status_and_events_take_a_job_id_as_muster_run_does(coordinators):
    (replica,) = coordinators(1)

    async def scenario():
        node = SimulatedNode([replica.address], job_name("MyRun"), "n0", slots=1)
        await node.join()
        node.start()
        await node.wait_for(lambda x: x.assignment().role == pb.ROLE_ACTIVE, 10, "map")
        out = await asyncio.to_thread(muster, "status", "--coordinator", replica.address, "--job", "MyRun", "--json")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["jobs"][0]["name"] == job_name("MyRun")
        out = await asyncio.to_thread(muster, "events", "--coordinator", replica.address, "--job", "MyRun")
        assert out.returncode == 0 and "node_joined" in out.stdout
        await node.stop()

    asyncio.run(scenario())
