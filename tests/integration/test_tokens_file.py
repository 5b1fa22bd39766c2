"""The tokens file of a running `muster serve` (issue 44, part 4): rotated without a restart, on
SIGHUP or as it changes; refused when group or others may read it, at start in one line and on a
reload (the tokens stay as they were)."""

import os
import signal
import subprocess
import sys

import grpc
import pytest

from muster.local import wait_until
from muster.v1 import muster_pb2 as pb
from muster.v1 import muster_pb2_grpc as pb_grpc

FIRST, SECOND, THIRD = "1" * 24, "2" * 24, "3" * 24


def write(path, text: str, mode: int = 0o600) -> None:
    """As an editor or a mounted Secret does: a new file put in place."""
    fresh = path.with_suffix(".new")
    fresh.write_text(text)
    fresh.chmod(mode)
    fresh.replace(path)


def code(address: str, token: str, job: str = "job-a") -> grpc.StatusCode:
    with grpc.insecure_channel(address) as channel:
        try:
            pb_grpc.CoordinatorStub(channel).Status(pb.StatusRequest(job=job, brief=True), timeout=5,
                                                    metadata=(("authorization", f"Bearer {token}"),))
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.timeout(60)
def test_tokens_rotate_on_sighup_and_as_the_file_changes_and_a_readable_file_is_not_taken(coordinators, tmp_path):
    path = tmp_path / "tokens"
    write(path, f"job-a {FIRST}\n")
    (replica,) = coordinators(1, ["--tokens", str(path)])
    known = grpc.StatusCode.NOT_FOUND  # the token covers the job, which does not exist yet
    assert code(replica.address, FIRST) == known and code(replica.address, SECOND) == grpc.StatusCode.UNAUTHENTICATED

    write(path, f"job-a {SECOND}\n")
    os.kill(replica.proc.pid, signal.SIGHUP)
    wait_until(lambda: code(replica.address, SECOND) == known, 5, "the rotated token on SIGHUP")
    assert code(replica.address, FIRST) == grpc.StatusCode.UNAUTHENTICATED

    write(path, f"job-a {SECOND}\njob-b {THIRD}\n")  # no signal: the file changed
    wait_until(lambda: code(replica.address, THIRD, "job-b") == known, 10, "the new token once the file changed")

    write(path, f"job-a {FIRST}\n", mode=0o644)
    os.kill(replica.proc.pid, signal.SIGHUP)
    refused = wait_until(lambda: replica.find("tokens_not_reloaded"), 5, "the refused reload")
    assert "lets group or others read it" in refused[0]["error"]
    assert code(replica.address, SECOND) == known and code(replica.address, FIRST) == grpc.StatusCode.UNAUTHENTICATED
    assert [r["entries"] for r in replica.find("tokens_reloaded")] == [1, 2]


def test_serve_refuses_a_tokens_file_others_may_read_in_one_line_before_anything_starts(tmp_path):
    path = tmp_path / "tokens"
    write(path, f"job-a {FIRST}\n", mode=0o644)
    out = subprocess.run([sys.executable, "-m", "muster.cli", "serve", "--data-dir", str(tmp_path / "data"),
                          "--tokens", str(path)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr == f"muster serve: {path}: mode 0644 lets group or others read it; chmod 600 {path}\n"
    assert not (tmp_path / "data").exists(), "no etcd started"
