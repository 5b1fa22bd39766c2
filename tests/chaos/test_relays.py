"""The chaos sequence with relays on: every node streams through the replica its id hashes to
(three replicas, so two of them relay). A relaying replica killed is a stream loss for its nodes,
never an eviction; a leader killed is followed by the relays; a rank's exit through a relay is
decided as a direct one is. The same invariants as test_faults."""

import pytest

from harness import Chaos, started

pytestmark = pytest.mark.timeout(150)

SEQUENCE = [
    "relay",  # SIGKILL a relaying replica: its nodes reconnect elsewhere, no generation change
    "leader",  # SIGKILL the leader: a standby leads, the other relays to it, no generation change
    "rank",  # SIGKILL a rank: its exit, relayed or not, makes the new generation
]


@pytest.fixture(scope="module")
def relay_chaos(tmp_path_factory, request):
    yield from started(Chaos(tmp_path_factory.mktemp("chaos-relays"), replicas=3, relay_min_nodes=1), request)


@pytest.mark.parametrize("name", SEQUENCE)
def test_fault_with_relays(relay_chaos, name):
    relay_chaos.scenario(name)
