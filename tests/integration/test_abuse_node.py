"""Abuse on a node: a process of the same user speaking for a slot on the agent's socket, and keys
planted on a generation's TCPStore ahead of time. Real agents, real coordinator and etcd, real
gloo ranks; each attack must change nothing for the job."""

import asyncio
import glob
import os
import sys
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from types import SimpleNamespace

import grpc
import pytest
import structlog
import torch.distributed as dist

from muster.coordinator.core.policy import JobSpec
from muster.coordinator.core.state import JobState, Phase, Placement, RankMap
from muster.coordinator.wire import Assignments
from muster.local import wait_until
from muster.v1 import muster_pb2 as pb
from muster.v1 import muster_pb2_grpc as pb_grpc
from muster.worker.agent.agent import NodeAgent
from muster.worker.agent.agent_config import AgentConfig
from muster.worker.library.comm import Comm, GroupSpec
from muster.worker.store import StoreKeyTaken
from muster.worker.outcome import EXIT_FAILED
from muster.worker.rank_link import SLOT_SECRET_ENV, SLOT_SECRET_METADATA
from muster.worker.torchrun.rendezvous import MusterRendezvousHandler

PREDICTABLE = "muster/j/g2"  # generation 2's store prefix, as it was before prefixes had an unguessable part
NOT_BEFORE_S = 0.5  # a reader that returns sooner took a planted key: the real one is not published yet


def environ_of(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(e.decode().split("=", 1) for e in f.read().split(b"\0") if b"=" in e)


def speak(socket_path: str, reports: list[pb.RankReport], secret: str | None) -> grpc.RpcError:
    """A RankSession on the agent's socket sending `reports`, read until the agent ends it (a stream
    it accepts gets directives until the deadline)."""
    metadata = ((SLOT_SECRET_METADATA, secret),) if secret is not None else ()
    with grpc.insecure_channel(f"unix:{socket_path}") as channel:
        call = pb_grpc.NodeAgentStub(channel).RankSession(iter(reports), metadata=metadata, timeout=5)
        with pytest.raises(grpc.RpcError) as err:
            for _ in call:
                pass
    return err.value


@pytest.mark.timeout(180)
def test_a_process_of_the_same_user_cannot_speak_for_a_slot_on_the_agents_socket(coordinators, agents):
    (leader,) = coordinators(1)
    # Cold starts: a forked rank's /proc/PID/environ is its zygote's, not the environment it runs with.
    (node,) = agents([leader.address], "socket-abuse", ["a"], nodes="1:1", steps=100_000, extra=["--no-warm-start"])
    # (two cold torch imports: over 60 s once, at a load of 10 on 2 cores)
    wait_until(lambda: all(node.steps(s) and node.steps(s)[-1]["step"] >= 5 for s in (0, 1)), 120,
               "both ranks stepping")
    (socket_path,) = glob.glob(os.path.join(tempfile.gettempdir(), f"muster-agent-{node.proc.pid}-*", "ranks.sock"))
    pids = [node.rank_pids(s)[-1] for s in (0, 1)]
    secrets = [environ_of(pid)[SLOT_SECRET_ENV] for pid in pids]
    generation = node.steps(0)[-1]["generation"]
    exited = pb.RankReport(local_rank=0, pid=pids[0], state=pb.RANK_STATE_EXITED)

    # Slot 0 claimed by its pid alone, or with another slot's secret: refused before anything is read.
    for secret in (None, "0" * 32, secrets[1]):
        refused = speak(socket_path, [exited], secret)
        assert refused.code() == grpc.StatusCode.PERMISSION_DENIED, refused
        assert SLOT_SECRET_METADATA in refused.details() and "slot 0" in refused.details()
    # Even the slot's own secret speaks for its slot and process only: a report for another slot is refused.
    running = pb.RankReport(local_rank=0, pid=pids[0], state=pb.RANK_STATE_RUNNING, step=node.steps(0)[-1]["step"])
    other = pb.RankReport(local_rank=1, pid=pids[1], state=pb.RANK_STATE_EXITED)
    refused = speak(socket_path, [running, other], secrets[0])
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT, refused
    assert refused.details() == f"a report for local_rank 1 pid {pids[1]} on the stream of local_rank 0 pid {pids[0]}"

    # Nothing changed: the same processes train on in the same generation.
    at = [node.steps(s)[-1]["step"] for s in (0, 1)]
    wait_until(lambda: all(node.steps(s)[-1]["step"] >= at[s] + 20 for s in (0, 1)), 30, "both ranks stepping on")
    assert [node.rank_pids(s)[-1] for s in (0, 1)] == pids and len(node.rank_pids(0)) == 1
    assert {node.steps(s)[-1]["generation"] for s in (0, 1)} == {generation}
    assert not [r for r in leader.find("membership_changed") if r["generation"] > generation]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_ranks_inherit_neither_the_agents_token_nor_an_etcd_password(coordinators, agents, tmp_path, monkeypatch,
                                                                     warm):
    token = "t" * 24
    (tmp_path / "tokens").write_text(f"ranks-env {token}\n")
    (tmp_path / "tokens").chmod(0o600)
    (tmp_path / "token").write_text(token + "\n")
    (leader,) = coordinators(1, extra=["--tokens", str(tmp_path / "tokens")])
    # The environment the agent starts in holds secrets (a wrong token: --token-file wins).
    monkeypatch.setenv("MUSTER_TOKEN", "w" * 24)
    monkeypatch.setenv("MUSTER_ETCD_PASSWORD", "p" * 24)
    (node,) = agents([leader.address], "ranks-env", ["a"], nodes="1:1", steps=100_000,
                     extra=["--token-file", str(tmp_path / "token"), "--warm-start" if warm else "--no-warm-start"])
    # (bounded generously: cold, two ranks importing torch on a loaded 2-core host)
    wait_until(lambda: all(node.steps(s) for s in (0, 1)), 120, "both ranks stepping")
    if warm:  # /proc/PID/environ of a forked rank is its zygote's: no secret of any kind in it either
        for s in (0, 1):
            env = environ_of(node.rank_pids(s)[-1])
            assert not {"MUSTER_TOKEN", "MUSTER_ETCD_PASSWORD", SLOT_SECRET_ENV} & set(env), sorted(env)
        return
    for s in (0, 1):
        env = environ_of(node.rank_pids(s)[-1])
        assert env["LOCAL_RANK"] == str(s) and len(env[SLOT_SECRET_ENV]) == 32
        assert "MUSTER_TOKEN" not in env and "MUSTER_ETCD_PASSWORD" not in env
    assert environ_of(node.rank_pids(0)[-1])[SLOT_SECRET_ENV] != environ_of(node.rank_pids(1)[-1])[SLOT_SECRET_ENV]


def store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def served(store: dist.TCPStore) -> Future:
    """`store` as an agent holds its node's (`serve_soon`: made on a thread)."""
    made = Future()
    made.set_result(store)
    return made


def generation_2(store_port: int) -> dict[str, pb.Assignment]:
    """Each node's part of generation 2 of job j, as the leader sends it (rank 0 on node a)."""
    rm = RankMap(2, 4, (Placement("a", 0, 0, (0, 1)), Placement("b", 1, 2, (0, 1))), f"127.0.0.1:{store_port}",
                 True, 0, master_address="127.0.0.1:29400")
    maps = Assignments(JobState("j", JobSpec(), generation=2, phase=Phase.RUNNING, rank_map=rm), "test")
    return {n: maps.directive(n).assignment for n in ("a", "b")}


def node_agent(node_id: str, assignment: pb.Assignment) -> NodeAgent:
    agent = NodeAgent(AgentConfig(coordinators=("127.0.0.1:1",), job="j", node_id=node_id, slots=2,
                                  argv=(sys.executable, "train.py")))
    agent.assignment = assignment
    agent._done = asyncio.get_running_loop().create_future()
    return agent


@pytest.mark.timeout(60)
def test_a_master_port_planted_at_a_predictable_prefix_is_never_read_by_the_other_node():
    async def scenario():
        rank0_store = store()
        rank0_store.set(f"{PREDICTABLE}/muster-agent/master-port", "1")  # ahead of time, on the unauthenticated store
        maps = generation_2(rank0_store.port)
        assert maps["a"].store_prefix != PREDICTABLE
        a, b = node_agent("a", maps["a"]), node_agent("b", maps["b"])
        a.masters.store = served(rank0_store)
        reading = asyncio.ensure_future(b.masters.of(maps["b"]))  # the other node asks before rank 0 publishes
        done, _ = await asyncio.wait([reading], timeout=NOT_BEFORE_S)
        assert not done, f"node b took a planted master port: {reading.result()}"
        published = await a.masters.of(maps["a"])
        assert published[1] != "1" and await asyncio.wait_for(reading, 10) == published
    asyncio.run(scenario())


@pytest.mark.timeout(60)
def test_a_master_port_planted_at_the_generations_own_prefix_stops_rank_0s_node(capsys):
    async def scenario():
        rank0_store = store()
        maps = generation_2(rank0_store.port)
        rank0_store.set(f"{maps['a'].store_prefix}/muster-agent/master-port", "1")  # by someone who heard the leader
        a = node_agent("a", maps["a"])
        a.masters.store = served(rank0_store)
        with structlog.testing.capture_logs() as logs:
            assert await a.masters.of(maps["a"]) is None
        assert a._done.result() == EXIT_FAILED
        (planted,) = [e for e in logs if e["event"] == "store_key_planted"]
        return planted
    planted = asyncio.run(scenario())
    assert planted["generation"] == 2 and "muster-agent/master-port" in planted["error"] and "b'1'" in planted["error"]
    assert "generation 2: store key" in capsys.readouterr().err


def rendezvous_node(node_rank: int, assignment: pb.Assignment, server: dist.TCPStore) -> MusterRendezvousHandler:
    """The torchrun backend of one node, its coordinator link faked: it has `assignment`, not yet a round."""
    h = MusterRendezvousHandler.__new__(MusterRendezvousHandler)
    assignment.node_rank = node_rank
    h._link = SimpleNamespace(session=SimpleNamespace(finishing=False), ended=None, changed=threading.Event(),
                              latest=assignment)
    h._job, h._host, h._server = "j", "127.0.0.1", server
    h._closed, h._rounds, h._generation, h._workers_ended, h._restarting_in = False, 0, 0, False, 0
    h._master_port = None
    h._rejoin_after_s = h._join_timeout_s = 10.0
    return h


@pytest.mark.timeout(60)
def test_torchruns_master_addr_and_port_planted_at_a_predictable_prefix_never_reach_a_node():
    rank0_store = store()
    planted = dist.PrefixStore(PREDICTABLE + "/", rank0_store)
    planted.set("MASTER_ADDR", "10.9.9.9")
    planted.set("MASTER_PORT", "1")
    maps = generation_2(rank0_store.port)
    node0, node1 = rendezvous_node(0, maps["a"], rank0_store), rendezvous_node(1, maps["b"], store())
    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(node1.next_rendezvous)  # the other node's round starts first
        with pytest.raises(TimeoutError):
            bootstrap = other.result(NOT_BEFORE_S).bootstrap_store_info
            pytest.fail(f"node 1 took a planted master address: {bootstrap.master_addr}:{bootstrap.master_port}")
        own = node0.next_rendezvous().bootstrap_store_info
        theirs = other.result(10).bootstrap_store_info
    assert own.master_addr == "127.0.0.1" and own.master_port != 1
    assert (theirs.master_addr, theirs.master_port) == (own.master_addr, own.master_port)


@pytest.mark.timeout(60)
def test_torchruns_rank_0_refuses_a_master_addr_already_at_its_generations_prefix():
    rank0_store = store()
    maps = generation_2(rank0_store.port)
    dist.PrefixStore(maps["a"].store_prefix + "/", rank0_store).set("MASTER_ADDR", "10.9.9.9")
    with pytest.raises(StoreKeyTaken) as err:
        rendezvous_node(0, maps["a"], rank0_store).next_rendezvous()
    assert str(err.value).startswith("store key 'MASTER_ADDR' held b'10.9.9.9' before this process published it")


@pytest.mark.timeout(60)
def test_a_library_rank_refuses_an_arrival_planted_under_its_name():
    comm = Comm("gloo")
    maps = generation_2(comm.store_port)
    spec = GroupSpec(2, 0, 1, 0, f"127.0.0.1:{comm.store_port}", maps["a"].store_prefix)
    dist.PrefixStore(spec.store_prefix + "/", comm.server).add("arrived/0", 1)  # the barrier would pass without it
    with pytest.raises(StoreKeyTaken, match="store key arrived/0 was set before rank 0 arrived"):
        comm.form(spec, abandoned=lambda: False)
    assert not comm.formed
