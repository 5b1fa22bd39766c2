"""The whole-cluster faults the compound chaos sequences inject into etcd, checked on etcd alone
(so a compound failure is the product's, not the harness's): a total outage by SIGKILL comes back
with its data, one by SIGSTOP comes back as it was, and a wipe comes back as an empty cluster at
the same endpoints. No process is left behind."""

import pytest

from muster.coordinator.etcd.client import connect
from muster.coordinator.etcd.server import EtcdCluster
from muster.local import process_alive

pytestmark = pytest.mark.timeout(90)


def _get(cluster: EtcdCluster, key: str) -> bytes | None:
    client = connect(cluster.endpoints, timeout_s=5)
    try:
        return client.get(key)[0]
    finally:
        client.close()


def _put(cluster: EtcdCluster, key: str, value: str) -> None:
    client = connect(cluster.endpoints, timeout_s=5)
    try:
        client.put(key, value)
    finally:
        client.close()


def test_total_outages_keep_the_data_and_a_wipe_starts_an_empty_cluster_at_the_same_endpoints(tmp_path):
    cluster = EtcdCluster(tmp_path, 3)
    pids = set()
    try:
        cluster.start()
        endpoints = cluster.endpoints
        pids.update(m.pid for m in cluster.members)
        _put(cluster, "/chaos/k", "v")

        cluster.kill_all()
        assert not any(m.running() for m in cluster.members)
        assert not cluster.healthy()
        cluster.restart()
        pids.update(m.pid for m in cluster.members)
        assert cluster.healthy() and cluster.endpoints == endpoints
        assert _get(cluster, "/chaos/k") == b"v", "a restart after SIGKILL must keep the data"

        before = [m.pid for m in cluster.members]
        cluster.freeze_all()
        assert all(m.frozen for m in cluster.members) and not cluster.healthy()
        cluster.thaw_all()
        pids.update(m.pid for m in cluster.members)
        assert [m.pid for m in cluster.members] == before
        assert _get(cluster, "/chaos/k") == b"v"

        with pytest.raises(RuntimeError, match="stop it before wiping"):
            cluster.members[0].wipe()
        cluster.kill_all()
        cluster.wipe()
        assert not any(m.member_dir.exists() for m in cluster.members)
        cluster.restart()
        pids.update(m.pid for m in cluster.members)
        assert cluster.healthy() and cluster.endpoints == endpoints
        assert _get(cluster, "/chaos/k") is None, "a wiped cluster starts empty"

        cluster.freeze_all()  # stop() must end frozen members too
    finally:
        cluster.stop(timeout_s=5)
    assert not [pid for pid in pids if process_alive(pid)]
