"""Chaos: the coordinators run against a 3-member etcd cluster while two agents train; the etcd
leader is SIGKILLed. etcd elects a new leader, the coordinators' sessions fail over to the
remaining members, and training goes on: every rank reaches the end with contiguous steps and
no rank is evicted."""

import pytest

from muster.coordinator.etcd_backend import connect
from muster.coordinator.etcd_server import EtcdCluster
from muster.testing import AgentProcess, CoordinatorProcess, wait_until

STEPS = 300
EVICTIONS = {"node_silent", "rank_exited", "rank_silent", "rank_stalled", "process_exited"}


def etcd_leader_index(cluster: EtcdCluster) -> int:
    client = connect(cluster.endpoints)
    try:
        leader = client.status().leader
    finally:
        client.close()
    return next(i for i, m in enumerate(cluster.members) if m.client_url in leader.client_urls)


@pytest.mark.timeout(180)
def test_training_goes_on_when_the_etcd_leader_is_killed(tmp_path):
    cluster = EtcdCluster(tmp_path / "etcd", 3).start()
    replicas, agents = [], []
    try:
        replicas = [CoordinatorProcess(cluster.endpoints, tmp_path / f"coordinator-{i}.log",
                                       ["--heartbeat-timeout", "2.0", "--session-ttl", "3"]).start() for i in range(2)]
        addresses = [r.address for r in replicas]
        agents = [AgentProcess(addresses, "etcdchaos", node, tmp_path / "ranks", steps=STEPS).start()
                  for node in ("a", "b")]
        wait_until(lambda: all(a.steps(s) and a.steps(s)[-1]["step"] > 20 and a.steps(s)[-1]["world_size"] == 4
                               for a in agents for s in (0, 1)), 90, "both nodes training together")
        cluster.kill_member(etcd_leader_index(cluster))
        for a in agents:
            assert a.wait(120) == 0, a.log_path.read_text()[-3000:]
        for a in agents:
            for slot in (0, 1):
                steps = [r["step"] for r in a.steps(slot)]
                assert steps[-1] == STEPS and steps == list(range(steps[0], steps[0] + len(steps)))
        changes = [r for rep in replicas for r in rep.find("membership_changed")]
        assert not [r for r in changes if r["kind"] in EVICTIONS], "nobody is evicted for an etcd fault"
    finally:
        for a in agents:
            a.stop()
        for r in replicas:
            r.stop()
        cluster.stop()
