"""Chaos: a network partition. One node runs in its own network namespace behind a veth pair;
its link is cut (packets dropped, connections left open, nobody told). The others replace it
within the heartbeat timeout; while cut off its ranks complete no step; when the network heals
the node finds itself evicted and joins again as a new member, its ranks held, and the job re-forms.
Needs root (network namespaces); skipped with the reason otherwise."""

import pytest

from harness import Chaos, NetNamespace

pytestmark = pytest.mark.timeout(180)


def test_a_partitioned_node_is_replaced_and_fenced_when_the_network_heals(tmp_path):
    why = NetNamespace.unavailable()
    if why:
        pytest.skip(why)
    ns = NetNamespace("part").create()
    chaos = Chaos(tmp_path, etcd_members=1, job="partition", host=ns.host_ip, netns={"node2": ns})
    try:
        chaos.start()
        fault = chaos.scenario("partition")
        assert fault.detected_s is not None and fault.recovered_s < 15
    finally:
        chaos.report()
        leftovers = chaos.stop()
        ns.delete()
    assert not leftovers, f"processes left behind: {leftovers}"
