"""The coordinator's Prometheus endpoint and health probes, and the same figures in `muster status`:
two replicas on a real etcd, simulated nodes over real gRPC, one of them going silent."""

import asyncio
import json
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from muster.local import SimulatedNode
from muster.v1 import muster_pb2 as pb


def scrape(address: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def get(address: str, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://{address}{path}", timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def cli(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "muster.cli", *args], capture_output=True, text=True,
                          timeout=30).stdout


@pytest.mark.timeout(90)
def test_metrics_and_probes_follow_a_job_through_a_silent_node(coordinators):
    replicas = coordinators(2, extra=["--metrics-listen", "127.0.0.1:0"])
    metrics = {r.address: r.find("coordinator_serving")[0]["metrics"] for r in replicas}
    job = (("job", "observed"),)

    async def scenario():
        spec = pb.JobSpec(min_nodes=2, max_nodes=3)
        nodes = [SimulatedNode([r.address for r in replicas], "observed", f"n{i}", slots=2, spec=spec)
                 for i in range(3)]
        try:
            for n in nodes:
                await n.join()
                n.start()
            for n in nodes:
                await n.wait_for(lambda x: x.assignment().role == pb.ROLE_ACTIVE, 10, "first map")
            g = nodes[0].assignment().generation
            # every labelled series from the job's start, at zero until its first event (no "No data")
            before = await asyncio.to_thread(scrape, metrics[nodes[0].leader])
            silent = (("job", "observed"), ("reason", "node_silent"))
            assert (before[("muster_recovery_seconds_count", job)], before[("muster_detection_seconds_count", job)],
                    before[("muster_evictions_total", silent)]) == (0, 0, 0)
            assert before[("muster_runs_ended_total", (("outcome", "failed"),))] == 0
            nodes[2].silent = True
            await nodes[0].wait_for(lambda x: x.assignment().generation > g, 10, "next generation")
            leader = nodes[0].leader
            standby = next(a for a in metrics if a != leader)
            # the survivors report steps in it: the recovery completes, and is measured
            deadline = asyncio.get_running_loop().time() + 10
            while (await asyncio.to_thread(scrape, metrics[leader])).get(("muster_recovery_seconds_count", job), 0) < 1:
                assert asyncio.get_running_loop().time() < deadline, "the recovery was not measured in 10 s"
                await asyncio.sleep(0.1)
            # off the loop: the simulated nodes keep streaming meanwhile
            at_leader, at_standby = await asyncio.gather(asyncio.to_thread(scrape, metrics[leader]),
                                                         asyncio.to_thread(scrape, metrics[standby]))
            probes = await asyncio.to_thread(lambda: {a: [get(a, p) for p in ("/healthz", "/readyz", "/nope")]
                                                      for a in metrics.values()})
            shown = await asyncio.to_thread(cli, "status", "--coordinator", standby, "--job", "observed", "--json")
            table = await asyncio.to_thread(cli, "status", "--coordinator", leader, "--job", "observed")
            return at_leader, at_standby, probes, shown, table
        finally:
            for n in nodes:
                await n.stop()

    at_leader, at_standby, probes, shown, table = asyncio.run(scenario())
    assert at_leader[("muster_leader", job)] == 1 and at_standby[("muster_leader", job)] == 0
    assert at_leader[("muster_world_size", job)] == 4 and at_leader[("muster_live_ranks", job)] == 4
    assert at_leader[("muster_generation", job)] >= 2 and at_leader[("muster_term", job)] > 0
    assert at_leader[("muster_frames_total", job)] > 10
    assert at_leader[("muster_steps_per_second", job)] == 20  # its nodes report 50 ms steps
    assert at_leader[("muster_evictions_total", (("job", "observed"), ("reason", "node_silent")))] == 1
    assert at_leader[("muster_detection_seconds_count", job)] >= 1
    assert at_leader[("muster_recovery_seconds_count", job)] >= 1
    assert at_leader[("muster_etcd_write_seconds_count", ())] >= 3
    assert at_leader[("muster_ready", ())] == 1 and at_standby[("muster_ready", ())] == 1
    assert all(codes == [200, 200, 404] for codes in probes.values()), probes
    health = next(j for j in json.loads(shown)["jobs"] if j["name"] == "observed")["health"]
    assert health["live_ranks"] == 4 and int(health["evictions"]) == 1 and health["frames_per_second"] > 0
    assert 1.0 < health["last_detection_s"] < 5.0  # silence: about the heartbeat timeout
    assert "live ranks 4" in table and "evictions 1" in table
