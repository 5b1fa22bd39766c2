"""The checked-in stubs are what `make protos` generates from protos/muster/v1/muster.proto."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ("muster_pb2.py", "muster_pb2.pyi", "muster_pb2_grpc.py")


def test_generated_stubs_are_fresh(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I", str(ROOT / "protos"), f"--python_out={tmp_path}",
         f"--grpc_python_out={tmp_path}", f"--pyi_out={tmp_path}", str(ROOT / "protos/muster/v1/muster.proto")],
        check=True,
    )
    for name in GENERATED:
        fresh = (tmp_path / "muster/v1" / name).read_text()
        checked_in = (ROOT / "src/muster/v1" / name).read_text()
        assert fresh == checked_in, f"src/muster/v1/{name} is stale: run `make protos`"
