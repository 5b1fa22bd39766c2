"""The chaos sequence: one cluster, one fault after another. After each the job must recover and
the invariants hold (survivors keep their PIDs, contiguous steps, identical state, the events
explain every change); no process is left behind at the end. Recovery times go to the report."""

import pytest

pytestmark = pytest.mark.timeout(150)

SEQUENCE = [
    "rank",  # SIGKILL a rank: the agent restarts it, it rejoins and receives the state
    "rank0",  # SIGKILL rank 0: the store moves
    "hang",  # SIGSTOP a rank: evicted; resumed, it finds itself fenced out and is replaced
    "agent",  # SIGKILL a node's agent (its ranks die with it): the node is lost, then rejoins
    "leader",  # SIGKILL the coordinator leader: a standby takes over, no generation change
    "etcd_member",  # SIGKILL an etcd follower: nothing changes
    "etcd_leader",  # SIGKILL the etcd leader: nothing changes
    "rank_and_leader",  # two at once: the exit report dies with the leader
    "during_reform",  # a second rank killed as the first one's new generation is published
    "slow_rank",  # a rank throttled from outside: its node named a straggler, nobody else; nothing changes
]


@pytest.mark.parametrize("name", SEQUENCE)
def test_fault(chaos, name):
    chaos.scenario(name)
