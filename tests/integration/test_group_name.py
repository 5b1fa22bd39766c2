"""Every rank names a generation's group alike. torch names a default group from a counter that
init_process_group raises before it connects, and gloo's store keys carry the name: a rank whose
init failed (its peer died as the group connected) had a counter one ahead of the others', and in
every later generation it waited for keys published under another name, as they did for its own.
Found by the chaos suite (a rank killed during a reform, another as the next map went out): four
generations in a row failed with "wait timeout ... keys: …/1//cpu//0/0" against "…/0//cpu//0/2"."""

from datetime import timedelta

import pytest
import torch.distributed as dist

from muster.worker.library.comm import Comm, GroupSpec


@pytest.mark.timeout(60)
def test_a_failed_init_leaves_the_next_generations_group_named_as_a_fresh_process_names_it():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    address = f"127.0.0.1:{server.port}"
    comm = Comm("gloo", host_store=False, timeout_s=10)
    try:
        # Rank 1 arrives at generation 1's barrier and dies before connecting: rank 0's init fails.
        dist.PrefixStore("generation-1/", server).add("arrived/1", 1)
        with pytest.raises(RuntimeError, match="timeout"):
            comm.form(GroupSpec(1, 0, 2, 0, address, "generation-1"), abandoned=lambda: False)
        comm.destroy()
        comm.form(GroupSpec(2, 0, 1, 0, address, "generation-2"), abandoned=lambda: False)
        assert dist.distributed_c10d._get_process_group_name(dist.group.WORLD) == "0"
    finally:
        comm.destroy()
