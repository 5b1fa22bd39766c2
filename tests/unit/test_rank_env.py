"""A rank's environment under `muster run`: torchrun's variables from the current map only, never
the agent's own (an agent started inside another job's environment, or holding its token)."""

import sys

from muster.v1 import muster_pb2 as pb
from muster.worker.agent.agent_config import AgentConfig
from muster.worker.agent.rank_env import rank_env
from muster.worker.agent.slot import Slot

CONFIG = AgentConfig(coordinators=("127.0.0.1:1",), job="j", node_id="n", slots=2, argv=(sys.executable, "t.py"),
                     env={"MY_FLAG": "1"})


def env_of(slot: int, a: pb.Assignment, monkeypatch, master=("10.0.0.1", "29501")) -> dict[str, str]:
    for name, value in {"RANK": "7", "MASTER_PORT": "1", "WORLD_SIZE": "64", "MUSTER_TOKEN": "secret",
                        "PATH": "/usr/bin"}.items():
        monkeypatch.setenv(name, value)  # what the agent itself runs with
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    return rank_env(CONFIG, a, Slot(slot, restarts=1, secret="s3"), master, library=True, socket_path="/run/a.sock",
                    files="/run/files")


def test_a_placed_rank_gets_its_rank_and_master_from_the_map_and_nothing_of_the_agents_own(monkeypatch):
    a = pb.Assignment(generation=4, role=pb.ROLE_ACTIVE, local_ranks=[1, 0], rank_offset=6, world_size=8,
                      local_world_size=2, num_nodes=4, node_rank=3)
    env = env_of(0, a, monkeypatch)
    assert (env["RANK"], env["GROUP_RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("7", "3", "8", "0")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.1", "29501")
    assert (env["MUSTER_GENERATION"], env["TORCHELASTIC_RESTART_COUNT"], env["TORCHELASTIC_USE_AGENT_STORE"]) == \
        ("4", "1", "False")
    assert "MUSTER_TOKEN" not in env and env["PATH"] == "/usr/bin" and env["MY_FLAG"] == "1"
    assert env["OMP_NUM_THREADS"] == "1"


def test_a_rank_without_a_place_gets_no_rank_nor_master(monkeypatch):
    a = pb.Assignment(generation=5, role=pb.ROLE_ACTIVE, local_ranks=[1], down_local_ranks=[0], world_size=3)
    env = env_of(0, a, monkeypatch)
    assert not {"RANK", "ROLE_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"} & set(env)
    assert env["WORLD_SIZE"] == "3" and env["LOCAL_RANK"] == "0"
