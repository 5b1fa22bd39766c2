"""Abuse on a node: a process of the same user speaking for a slot on the agent's socket, and keys
planted on a generation's TCPStore ahead of time. Real agents, real coordinator and etcd, real
gloo ranks; each attack must change nothing for the job."""

import glob
import os
import tempfile

import grpc
import pytest

from muster.local import wait_until
from muster.v1 import muster_pb2 as pb
from muster.v1 import muster_pb2_grpc as pb_grpc
from muster.worker.rank_link import SLOT_SECRET_ENV, SLOT_SECRET_METADATA


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


@pytest.mark.timeout(120)
def test_a_process_of_the_same_user_cannot_speak_for_a_slot_on_the_agents_socket(coordinators, agents):
    (leader,) = coordinators(1)
    (node,) = agents([leader.address], "socket-abuse", ["a"], nodes="1:1", steps=100_000)
    wait_until(lambda: all(node.steps(s) and node.steps(s)[-1]["step"] >= 5 for s in (0, 1)), 60, "both ranks stepping")
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


@pytest.mark.timeout(120)
def test_ranks_inherit_neither_the_agents_token_nor_an_etcd_password(coordinators, agents, tmp_path, monkeypatch):
    token = "t" * 24
    (tmp_path / "tokens").write_text(f"ranks-env {token}\n")
    (tmp_path / "token").write_text(token + "\n")
    (leader,) = coordinators(1, extra=["--tokens", str(tmp_path / "tokens")])
    # The environment the agent starts in holds secrets (a wrong token: --token-file wins).
    monkeypatch.setenv("MUSTER_TOKEN", "w" * 24)
    monkeypatch.setenv("MUSTER_ETCD_PASSWORD", "p" * 24)
    (node,) = agents([leader.address], "ranks-env", ["a"], nodes="1:1", steps=100_000,
                     extra=["--token-file", str(tmp_path / "token")])
    wait_until(lambda: all(node.steps(s) for s in (0, 1)), 60, "both ranks stepping")
    for s in (0, 1):
        env = environ_of(node.rank_pids(s)[-1])
        assert env["LOCAL_RANK"] == str(s) and len(env[SLOT_SECRET_ENV]) == 32
        assert "MUSTER_TOKEN" not in env and "MUSTER_ETCD_PASSWORD" not in env
    assert environ_of(node.rank_pids(0)[-1])[SLOT_SECRET_ENV] != environ_of(node.rank_pids(1)[-1])[SLOT_SECRET_ENV]
