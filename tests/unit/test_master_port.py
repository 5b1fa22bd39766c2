"""MasterPorts: a node placed in a running library job, whose ranks have not started yet (so its
agent cannot know they use the library), still finds the generation's master port: rank 0's node
publishes it even though its own library ranks need none (it waited for good before)."""

import asyncio
from datetime import timedelta

import pytest

from muster.v1 import muster_pb2 as pb
from muster.worker.agent.master_port import MasterPorts
from muster.worker.store import serve_soon


@pytest.mark.timeout(60)
def test_a_new_node_finds_the_master_port_of_a_library_job():
    port, store = serve_soon("127.0.0.1", timedelta(seconds=10))  # as an agent makes its node's
    address = f"127.0.0.1:{port}"
    first = pb.Assignment(generation=3, role=pb.ROLE_ACTIVE, node_rank=0, rank_offset=0, store_address=address,
                          store_prefix="muster/j/g3", master_address="127.0.0.1:29555")
    joiner = pb.Assignment(generation=3, role=pb.ROLE_ACTIVE, node_rank=1, rank_offset=2, store_address=address,
                           store_prefix="muster/j/g3", master_address="127.0.0.1:29555")

    def ports(assignment, library):
        masters = MasterPorts("127.0.0.1", library=lambda: library, assignment=lambda: assignment,
                              ended=lambda: False, planted=lambda generation, exc: None)
        masters.store = store
        return masters

    async def scenario():
        rank0 = await ports(first, library=True).of(first)  # its ranks are connected library ranks
        new = await asyncio.wait_for(ports(joiner, library=False).of(joiner), 20)
        return rank0, new

    assert asyncio.run(scenario()) == (("127.0.0.1", "29555"), ("127.0.0.1", "29555"))
