"""What differs between backends, decided without a GPU: which errors are the group's (the rank
holds and reforms) and which are the script's (raised), the watchdog settings an NCCL rank runs
with, and the device each rank uses. The error texts are torch's and NCCL's own, as a rank sees
them (ProcessGroupNCCL.cpp, NCCLUtils.cpp/.hpp, NCCL's ncclGetErrorString, distributed_c10d.py):
if torch rewords one, these tests say which."""

import pytest
import torch
import torch.distributed as dist

from muster.worker.library.backends import NCCL_DUMP_WAIT, NCCL_ENV, Gloo, Nccl, NcclTwin, backend_named

V = "NCCL version 2.27.3"
# A peer died, hung or the communicator was aborted: the group's failure.
NCCL_GROUP_FAILURES = [
    dist.DistBackendError("NCCL communicator was aborted on rank 3. "),
    dist.DistBackendError("NCCL communicator was aborted on rank 1.  Original reason for failure was: [Rank 1] "
                          "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=12, OpType=ALLREDUCE, "
                          "NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600043 milliseconds before timing out."),
    dist.DistBackendError("NCCL communicator encountered error set by ProcessGroupNCCL: NCCL error: remote process "
                          f"exited or there was a network error, {V}"),
    dist.DistBackendError(f"NCCL error: remote process exited or there was a network error, {V}\nncclRemoteError: A call "
                          "failed possibly due to a network error or a remote process exiting prematurely.\nLast error:\n"
                          "socketProgress: Connection closed by remote peer"),
    dist.DistBackendError(f"NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, unhandled "
                          f"system error (run with NCCL_DEBUG=INFO for details), {V}\nncclSystemError: System call (e.g. "
                          "socket, malloc) or external library call failed or device error. "),
    dist.DistBackendError("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=BROADCAST, "
                          "NumelIn=8, NumelOut=8, Timeout(ms)=30000) ran for 30012 milliseconds before timing out."),
    dist.DistBackendError("NCCL timeout in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:212"),
    # the abort cleared torch's registry before the training thread's next collective
    ValueError("Default process group has not been initialized, please make sure to call init_process_group."),
]
# The script's (or the GPU's, which no reform repairs): raised to the script, never held on.
NCCL_NOT_GROUP = [
    dist.DistBackendError(f"NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, invalid "
                          f"usage (run with NCCL_DEBUG=WARN for details), {V}\nncclInvalidUsage: This usually reflects "
                          "invalid usage of NCCL library."),
    dist.DistBackendError(f"NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.hpp:268, invalid argument "
                          f"(run with NCCL_DEBUG=WARN for details), {V}\nncclInvalidArgument: Invalid value for an "
                          "argument."),
    dist.DistBackendError(f"NCCL error: unhandled cuda error (run with NCCL_DEBUG=INFO for details), {V}\n"
                          "ncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\nCuda failure 'an illegal "
                          "memory access was encountered'"),
    ValueError("Tensors must be CUDA and dense"),
    TypeError("Input tensor data type is not supported for NCCL process group: ComplexDouble"),
    RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x3)"),
    ValueError("Invalid process group specified"),
]
GLOO_GROUP_FAILURES = [
    RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                 "[127.0.0.1]:8073. This is typically caused by a remote worker crashing."),
    RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 30000ms for recv "
                 "operation to complete"),
    RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:43210: "
                 "Connection reset by peer"),
    dist.DistNetworkError("failed to recv, got 0 bytes"),
]
GLOO_NOT_GROUP = [RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x3)"),
                  ValueError("Default process group has not been initialized, please make sure to call "
                             "init_process_group."),  # gloo's abort never clears it: the script called too soon
                  RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")]


@pytest.mark.parametrize("backend", [Nccl(), NcclTwin()], ids=["nccl", "nccl-twin"])
def test_nccl_errors_of_the_group_are_held_on_and_the_scripts_are_raised(backend):
    assert [backend.is_transport_failure(e) for e in NCCL_GROUP_FAILURES] == [True] * len(NCCL_GROUP_FAILURES)
    assert [backend.is_transport_failure(e) for e in NCCL_NOT_GROUP] == [False] * len(NCCL_NOT_GROUP)


def test_gloo_errors_of_the_group_are_held_on_and_the_scripts_are_raised():
    assert [Gloo().is_transport_failure(e) for e in GLOO_GROUP_FAILURES] == [True] * len(GLOO_GROUP_FAILURES)
    assert [Gloo().is_transport_failure(e) for e in GLOO_NOT_GROUP] == [False] * len(GLOO_NOT_GROUP)
    # the twin runs over gloo: gloo's transport errors are the group's there too
    assert all(NcclTwin().is_transport_failure(e) for e in GLOO_GROUP_FAILURES)


def test_an_nccl_rank_runs_with_the_watchdog_that_never_ends_a_survivor():
    env = {}
    Nccl().prepare(env)
    assert env == {**NCCL_ENV, NCCL_DUMP_WAIT: "0"} and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"
    # the watchdog's sleep after a failed collective (4x this) would hold the reform: forced off
    env = {NCCL_DUMP_WAIT: "15000"}
    Nccl().prepare(env)
    assert env[NCCL_DUMP_WAIT] == "0"
    # torchrun's default (passed on by `muster run`) and torch's own tear the process down: off
    for tears_down in ("1", "3"):
        env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": tears_down}
        Nccl().prepare(env)
        assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"
    # a user's own choice that keeps the process is kept, and so are the other settings they made
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_FR_BUFFER_SIZE": "2000"}
    Nccl().prepare(env)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2" and env["TORCH_FR_BUFFER_SIZE"] == "2000"
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    Gloo().prepare(env)
    assert env == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}  # not gloo's business


def test_devices_and_names(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    # ranks share the visible GPUs round-robin (8 ranks on one GPU in the GPU check)
    assert [Nccl().device(r).index for r in range(5)] == [0, 1, 0, 1, 0]
    assert Nccl().init_options(torch.device("cuda", 1)) == {"device_id": torch.device("cuda", 1)}
    assert NcclTwin().device(3) == torch.device("cpu") and NcclTwin().init_options(torch.device("cpu")) == {}
    assert (Gloo().torch_backend, Nccl().torch_backend, NcclTwin().torch_backend) == ("gloo", "nccl", "gloo")
    assert isinstance(backend_named("nccl-twin"), NcclTwin)
    with pytest.raises(ValueError, match="unknown backend 'mpi': one of gloo, nccl, nccl-twin"):
        backend_named("mpi")


def test_every_backend_keeps_the_backend_protocol():
    """The contract Comm relies on: each backend (the twin included) has every member of `Backend`."""
    from muster.worker.library.backends import BACKENDS, Backend

    for name in BACKENDS:
        backend = backend_named(name)
        assert isinstance(backend, Backend), name
        assert backend.name == name and backend.torch_backend in ("gloo", "nccl")
