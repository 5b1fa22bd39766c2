"""A fault that repeats gets a verdict (issue 55 item 4): a slot whose next process dies of the same
error in the same step ends the run failed, naming both; a reform that fails with the same error of
the rank's own on consecutive tries ends the rank (ReformFailed) instead of holding in a loop; state
sharded after register() is refused by name; the runner writes what a rank died of, and where."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from muster.coordinator.core.exits import ExitBook, error_digest
from muster.coordinator.core.machine import Context, Join, SlotDown, Tick, Verdict, decide
from muster.coordinator.core.policy import JobSpec, Timing
from muster.coordinator.core.state import JobState, Outcome, decode, encode
from muster.worker import ShardedStateRefused, Worker, WorkerConfig
from muster.worker.agent.slot import Slot, error_of, exit_of
from muster.worker.errors import ReformFailed
from muster.worker.library.reform import REFORM_REPEATS, RepeatedFailure

TIMING = Timing(last_call_s=1.0, switch_lead_s=0.5)


def ctx(now=0.0):
    return Context(now=now, wall_ms=1_700_000_000_000 + int(now * 1000), term=3, timing=TIMING, step_time_s=0.1)


def running():
    state = decide(JobState("job", JobSpec(1, 2, 1)), [Join(f"n{i}", "10.0.0.1", 29500 + i, 2) for i in (1, 2)], ctx())
    return decide(state.state, [Tick()], ctx(now=2.0)).state


def test_an_error_every_rank_of_the_map_dies_of_at_the_jobs_start_is_known_without_a_restart():
    rm = running().rank_map  # 2 nodes x 2 slots
    book = ExitBook()
    assert book.all_at_start("n1", 0, "OSError: no data", 1, rm, False) is None
    assert book.all_at_start("n1", 1, "OSError: no data", 0, rm, False) is None  # (at register(): no step)
    assert book.all_at_start("n2", 0, "", 1, rm, False) is None, "a kill by a signal is no fault of the script"
    assert book.all_at_start("n2", 1, "OSError: no data", 1, rm, False) is None
    assert book.all_at_start("n2", 0, "OSError: no data", 1, rm, False) == (rm.generation, 4)
    assert book.all_at_start("n2", 0, "OSError: other", 1, rm, False) is None, "another error: no verdict"
    book.all_at_start("n1", 0, "OSError: no data", 7, rm, False)  # past the start: the count starts again
    assert book.all_at_start("n2", 0, "OSError: no data", 1, rm, True) is None and not book.at_start


BOOM = error_digest("RuntimeError: boom")


def test_a_slot_whose_next_process_dies_the_same_way_is_a_repeat():
    book = ExitBook()
    assert not book.repeated("n1", 0, 100, BOOM, 6)
    assert not book.repeated("n1", 0, 100, BOOM, 6), "the same process told again (a new leader)"
    assert book.repeated("n1", 0, 101, BOOM, 6)
    assert not book.repeated("n1", 1, 102, BOOM, 6), "another slot's first"
    assert not book.repeated("n1", 1, 103, BOOM, 7), "another step"
    assert not book.repeated("n1", 1, 104, "", 0) and not book.repeated("n1", 1, 105, BOOM, 7), \
        "a death with no error known (a SIGKILL) breaks the streak"
    book.forget("n1", (0, 1))
    assert not book.repeated("n1", 0, 106, BOOM, 6), "a node gone and back starts afresh"


def test_a_verdict_ends_the_run_failed_at_once_with_its_reason_and_publishes_nothing():
    state = running()
    d = decide(state, [SlotDown("n2", 1, "rank_exited", "pid 9 exit code 1: RuntimeError: boom"),
                       Verdict("n2", "rank 3 (node 'n2', local rank 1) failed again in step 6 with the same error "
                                     "after a restart: RuntimeError: boom")], ctx(now=3.0))
    assert d.ended and not d.new_generation and d.state.generation == state.generation
    assert d.state.outcome is Outcome.FAILED
    assert d.state.outcome_reason.startswith("a fault that repeats: rank 3 (node 'n2', local rank 1)")
    assert "RuntimeError: boom" in d.state.outcome_reason and d.events[-1].kind == "failed"
    assert decode(encode(d.state)) == d.state
    again = decide(d.state, [Verdict("n1", "another")], ctx(now=4.0))
    assert not again.ended and again.state.outcome_reason == d.state.outcome_reason, "a run ends once"


def test_a_reform_failing_with_the_same_error_of_its_own_on_consecutive_tries_ends_the_rank():
    transport = RuntimeError("Connection closed by peer [127.0.0.1]:4000")
    repeats = RepeatedFailure(lambda exc: exc is transport)
    own = RuntimeError(".numpy() is not supported for tensor subclasses.")
    for generation in range(2, 2 + REFORM_REPEATS - 1):
        repeats.failed(own, generation)
    repeats.failed(transport, 9)  # a peer's or the network's failure breaks the streak
    repeats.failed(RuntimeError("another"), 10)
    for generation in range(11, 11 + REFORM_REPEATS - 1):
        repeats.failed(own, generation)
    with pytest.raises(ReformFailed, match=r"3 times in a row with the same error: RuntimeError: \.numpy\(\)") as e:
        repeats.failed(own, 20)
    assert "20" not in str(e.value), "no generation in its text: the next process's failure reads the same"


@pytest.fixture
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_model_sharded_after_register_is_refused_by_name(group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    w = Worker(WorkerConfig(coordinators=("127.0.0.1:1",), job="j", node_id="n"))
    w.register(model=model, optimizer=torch.optim.Adam(model.parameters()))
    w.state.still_replicated("at a reform")  # replicated: taken
    fully_shard(model[0], mesh=init_device_mesh("cpu", (1,)))
    with pytest.raises(ShardedStateRefused, match=r"module '0' is sharded by FSDP at a reform, but register\(\) "
                                                  r"took the state as replicated"):
        w.state.still_replicated("at a reform")
    w._unchecked = True  # as after a reform: the first step looks
    with pytest.raises(ShardedStateRefused, match="at its first step") as refused:
        with w.step_scope():
            pass
    assert refused.value.muster_step == 1


def test_the_runner_writes_what_the_program_died_of_and_the_step_the_library_said(tmp_path):
    (tmp_path / "prog.py").write_text("e = RuntimeError('boom at the sixth')\ne.muster_step = 6\nraise e\n")
    error_file = tmp_path / "error.json"
    done = subprocess.run([sys.executable, "-m", "muster.worker.rank.runner", "prog.py"], cwd=tmp_path, timeout=30,
                          capture_output=True, text=True, env={**os.environ, "TORCHELASTIC_ERROR_FILE": str(error_file)})
    assert done.returncode == 1 and "RuntimeError: boom at the sixth" in done.stderr
    assert error_of(str(error_file)) == ("RuntimeError: boom at the sixth", 6)
    assert json.loads(error_file.read_text())["message"]["extraInfo"]["py_callstack"]
    slot = Slot(0, error_file=str(error_file))
    e = exit_of(slot, 42, 1, False)
    assert (e.error, e.step, e.pid, e.exit_code) == ("RuntimeError: boom at the sixth", 6, 42, 1)
    error_file.write_text(json.dumps({"message": {"message": "OSError: \x1b[31mdisk\nfull" + "x" * 300}}))
    e = exit_of(slot, 43, 1, True)
    assert e.error == "OSError: ?[31mdisk" and e.step == 0 and e.restarting, "one line, no control characters"


def test_state_lost_ends_the_run_failed_unless_the_job_allows_a_restart_which_its_events_and_outcome_say():
    from muster.coordinator.core.machine import STATE_LOST, STATE_LOST_EVENT, Leave

    lost = Verdict("n2", "rank 3 (node 'n2', local rank 1) in step 9: ShardLost: shard 1 lost in every replica", STATE_LOST)
    down = SlotDown("n2", 1, "rank_exited", "pid 9 exit code 3: ShardLost: shard 1 lost in every replica")
    d = decide(running(), [down, lost], ctx(now=3.0))
    assert d.ended and d.state.outcome is Outcome.FAILED and d.state.outcome_reason.startswith(STATE_LOST)

    state = decide(JobState("job", JobSpec(1, 2, 1, on_state_lost="restart")),
                   [Join(f"n{i}", "10.0.0.1", 29500 + i, 2) for i in (1, 2)], ctx()).state
    state = decide(state, [Tick()], ctx(now=2.0)).state
    d = decide(state, [down, lost, Verdict("n1", "rank 0 ... ShardLost: shard 1", STATE_LOST)], ctx(now=3.0))
    assert not d.ended and d.state.outcome is not Outcome.FAILED
    (said,) = [e for e in d.events if e.kind == STATE_LOST_EVENT]  # once for the generation, however many ranks
    assert "begin again at step 0" in said.reason and "shard 1 lost" in said.reason
    assert decode(encode(d.state)) == d.state
    again = decide(d.state, [Verdict("n1", "rank 1 too", STATE_LOST)], ctx(now=3.5))
    assert not [e for e in again.events if e.kind == STATE_LOST_EVENT], "said already for this generation"
    end = decide(again.state, [Leave(n, False, "done", finished=True) for n in ("n1", "n2")], ctx(now=9.0))
    assert end.state.outcome is Outcome.SUCCEEDED and "begun again from step 0" in end.state.outcome_reason, \
        end.state.outcome_reason
    with pytest.raises(ValueError, match="on_state_lost"):
        JobSpec(on_state_lost="retry").validate()
