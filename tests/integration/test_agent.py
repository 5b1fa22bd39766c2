"""`muster run` node agents over a real coordinator and etcd, running examples/train_ddp.py with
gloo: ranks and agents are killed or drained, the rest keep training."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_metrics import scrape

from muster.local import json_lines, process_alive, progress_gap, record_time, wait_until

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"  # the repository's (the package holds train_ddp.py only)
SCRIPTS = Path(__file__).parent / "scripts"

PRODUCTION_TIMEOUT = ["--heartbeat-timeout", "2.0"]


def stepping(agents, at_least=10):
    wait_until(lambda: all(a.steps(s) and a.steps(s)[-1]["step"] >= at_least for a in agents for s in (0, 1)),
               90, f"every rank past step {at_least}")


def digests_by_step(runs, after_generation):
    by_step = {}
    for steps in runs:
        for r in steps:
            if r["generation"] > after_generation:
                by_step.setdefault(r["step"], set()).add(r["digest"])
    return by_step


@pytest.mark.timeout(150)
def test_a_killed_rank_is_replaced_and_rejoins_while_the_others_keep_their_pids(coordinators, agents):
    (leader,) = coordinators(1, extra=PRODUCTION_TIMEOUT)
    a, b = agents([leader.address], "agents", ["a", "b"], steps=300)
    stepping([a, b])
    pids = {(n, s): n.rank_pids(s) for n in (a, b) for s in (0, 1)}
    generation = b.steps(0)[-1]["generation"]
    os.kill(pids[(b, 0)][-1], signal.SIGKILL)
    wait_until(lambda: len(b.rank_pids(0)) == len(pids[(b, 0)]) + 1, 20, "the agent starts a replacement")

    def timelines():  # the recoveries as `events --json` gives them, each with the ranks' phases
        out = subprocess.run([sys.executable, "-m", "muster.cli", "events", "agents", "--coordinator", leader.address,
                              "--json"], capture_output=True, text=True, timeout=30)
        return [r for r in json.loads(out.stdout)["recoveries"] if r["generation"] > generation]

    # the kill's (survivors abort and re-form as 3), then the replacement's (it receives the state)
    wait_until(lambda: len(timelines()) >= 2, 60, "both recoveries measured",
               diagnose=lambda: f"recoveries: {timelines()}\nb/0's last steps: {b.steps(0, start=-1)[-3:]}\n"
                                f"a/0's last step: {a.steps(0)[-1:]}\n{b.log_path.read_text()[-3000:]}")
    killed, rejoined = timelines()[:2]
    # (a replacement back before the survivors' re-form was over cut the kill's recovery short: kept, superseded)
    assert killed["superseded_by"] in (None, rejoined["generation"]), killed
    assert not killed["planned"] and killed["detection_s"] > 0 and (killed["delivered_s"] > 0 or killed["superseded_by"])
    recovery = lambda: next((r for r in timelines() if r["generation"] == killed["generation"]), {})  # noqa: E731
    killed = wait_until(lambda: (k := recovery()).get("abort_s", 0) > 0 and k.get("form_s", 0) > 0 and k, 10,
                        "the survivors' phases", diagnose=lambda: f"recoveries: {timelines()}")
    assert killed["slowest"]
    assert rejoined["planned"] and rejoined["bytes_moved"] > 0 and rejoined["transfer_s"] > 0
    # where each one's state came from: the survivors' own, in memory, nothing lost
    assert (killed["tier"], killed["steps_lost"]) == ("replica", 0) and killed["step"] >= 10, killed
    assert rejoined["tier"] == "replica" and rejoined["step"] >= killed["step"], rejoined
    for n in (a, b):
        assert n.wait(120) == 0, n.log_path.read_text()[-3000:]
    for (n, slot), before in pids.items():
        if (n, slot) != (b, 0):
            assert n.rank_pids(slot) == before, f"{n.node_id}/{slot} was restarted"
            assert n.steps(slot)[-1]["step"] == 300, f"{n.node_id}/{slot} did not train to the end"
            assert not progress_gap(n.rank_records(slot)), f"{n.node_id}/{slot}"
    replacement = b.steps(0, start=-1)
    assert replacement[0]["step"] > 1 and replacement[0]["world_size"] == 4 and replacement[-1]["step"] == 300
    final = digests_by_step([a.steps(0), a.steps(1), b.steps(1), replacement], replacement[0]["generation"] - 1)
    assert all(len(d) == 1 for d in final.values()), "ranks differ after the rejoin"
    assert len({d for ds in final.values() for d in ds}) == len(final)
    assert generation < replacement[0]["generation"]
    kinds = [r["kind"] for r in leader.find("membership_changed")]
    assert "rank_exited" in kinds and "rank_recovered" in kinds


@pytest.mark.timeout(150)
def test_a_killed_big_ranks_death_is_reported_as_it_begins_not_once_its_memory_is_freed(coordinators, agents):
    """A rank holding 2 GiB is SIGKILLed: the kernel frees its memory before its sockets close and it
    can be reaped (~0.1 s here; a GPU rank's driver teardown comes first too). Its agent reads the
    kill under way from /proc and reports the exit then, once; the slot restarts after the reap."""
    (leader,) = coordinators(1, extra=PRODUCTION_TIMEOUT)
    # (steps enough for the replacement to join before the others end, on a loaded machine too)
    command = [sys.executable, str(SCRIPTS / "ballast.py"), "b", "2048", "--steps", "240", "--step-sleep", "0.05"]
    a, b = agents([leader.address], "dying", ["a", "b"], command=command)
    stepping([a, b])
    # (a node that joined after the job formed without it restarted the first one's ranks once)
    starts = {(n, slot): len(n.rank_pids(slot)) for n in (a, b) for slot in (0, 1)}
    victim = b.rank_pids(0)[-1]
    os.kill(victim, signal.SIGKILL)
    for n in (a, b):
        assert n.wait(120) == 0, n.log_path.read_text()[-3000:]
    (dying,) = [r for r in b.records("rank_dying") if r["pid"] == victim]
    (reaped,) = [r for r in b.records("rank_exited") if r["pid"] == victim]
    assert dying["signal"] == signal.SIGKILL and record_time(dying) <= record_time(reaped), (dying, reaped)
    exits = [r for r in leader.find("membership_changed") if r["kind"] == "rank_exited" and r["nodes"] == ["b"]]
    assert len(exits) == 1, exits  # reported once, as it began to die
    assert {(n, s): len(n.rank_pids(s)) for n, s in starts} == {**starts, (b, 0): starts[b, 0] + 1}
    print(f"\n2 GiB rank killed: reported {record_time(reaped) - record_time(dying):.3f} s before it was reaped")


@pytest.mark.timeout(120)
def test_a_killed_agent_takes_its_ranks_along_and_the_other_node_continues(coordinators, agents):
    (leader,) = coordinators(1, extra=PRODUCTION_TIMEOUT)
    a, b = agents([leader.address], "agentkill", ["a", "b"], steps=200)
    stepping([a, b])
    rank_pids = [a.rank_pids(0)[0], a.rank_pids(1)[0]]
    a.signal(signal.SIGKILL)
    killed = time.monotonic()
    wait_until(lambda: not any(process_alive(p) for p in rank_pids), 1.0, "the agent's ranks to exit")
    assert time.monotonic() - killed < 1.0
    assert b.wait(90) == 0, b.log_path.read_text()[-3000:]
    for slot in (0, 1):
        steps = b.steps(slot)
        assert steps[-1]["step"] == 200 and steps[-1]["world_size"] == 2
        gap = progress_gap(b.rank_records(slot))
        assert not gap, f"b/{slot} {gap}"
    assert [r["kind"] for r in leader.find("membership_changed") if r["nodes"] == ["a"]][-1] == "node_silent"


@pytest.mark.timeout(120)
def test_sigterm_drains_an_agent_at_a_step_boundary_without_aborting_a_step(coordinators, agents):
    (leader,) = coordinators(1, extra=PRODUCTION_TIMEOUT)
    a, b = agents([leader.address], "drain", ["a", "b"], steps=200)
    stepping([a, b])
    a.signal(signal.SIGTERM)
    assert a.wait(60) == 128 + signal.SIGTERM, a.log_path.read_text()[-3000:]  # drained, not done: non-zero
    planned = a.records("drain_planned")[0]["after_step"]
    for slot in (0, 1):
        assert a.steps(slot)[-1]["step"] == planned  # it stopped exactly at the agreed step
    assert b.wait(90) == 0
    for slot in (0, 1):
        log = b.rank_logs(slot)[0].read_text()
        assert "step_discarded" not in log, "a planned leave aborts nothing"
        steps = b.steps(slot)
        assert steps[-1]["step"] == 200 and steps[-1]["world_size"] == 2
        after = [r for r in steps if r["step"] == planned + 1]
        assert after and after[0]["world_size"] == 2


@pytest.mark.timeout(150)
def test_a_plain_script_survives_a_killed_rank_by_restart(coordinators, agents, tmp_path):
    (leader,) = coordinators(1, extra=[*PRODUCTION_TIMEOUT, "--metrics-listen", "127.0.0.1:0"])
    plain = [sys.executable, str(EXAMPLES / "train_plain.py"), "--steps", "150", "--step-sleep", "0.05",
             "--checkpoint-dir", str(tmp_path / "checkpoint")]
    (a,) = agents([leader.address], "plain", ["a"], command=plain)
    # node b without the step probe (as a shell wrapper or another interpreter runs): its ranks' steps unmeasured
    (b,) = agents([leader.address], "plain", ["b"], command=plain, extra=["--no-step-probe"])
    stepping([a, b])
    before = leader.find("membership_changed")[-1]["generation"]
    # (a node that joined after the job formed without it restarted the first one's ranks once)
    starts = {(n, slot): len(n.rank_pids(slot)) for n in (a, b) for slot in (0, 1)}
    os.kill(b.rank_pids(1)[-1], signal.SIGKILL)
    # Its recovery is measured (the decision until every rank steps in a process of the new
    # generation, from the step probe; b's once they run one), in Status and the metric, like a
    # library job's.
    metrics = leader.find("coordinator_serving")[0]["metrics"]
    job = (("job", "plain"),)

    def measured():  # (the first map's recovery is measured too, before the kill: wait for the kill's)
        out = subprocess.run([sys.executable, "-m", "muster.cli", "status", "plain", "--coordinator", leader.address,
                              "--json"], capture_output=True, text=True, timeout=30).stdout
        (js,) = json.loads(out)["jobs"]
        assert js["health"], f"the run ended ({js['outcome']}) with the kill's recovery never measured"
        found = js["health"]["recent_recoveries"]
        return js if found and found[-1]["generation"] > before else None

    shown = wait_until(measured, 60, "the kill's recovery measured")
    recovery = shown["health"]["recent_recoveries"][-1]
    assert 0 < recovery["recovery_s"] == shown["health"]["last_recovery_s"]
    assert scrape(metrics)[("muster_recovery_seconds_count", job)] >= 2
    assert {r["state"] for r in shown["ranks"]} == {"script"}
    for n in (a, b):
        assert n.wait(120) == 0, n.log_path.read_text()[-3000:]
    # One fault, one change: the killed rank is restarted in its place and the job re-forms once,
    # with it (never a world of 3 first); every rank starts exactly once more.
    changes = [r for r in leader.find("membership_changed") if r["generation"] > before]
    kinds = [r["kind"] for r in changes if r["kind"] not in ("generation", "node_finished", "finishing")]
    assert kinds == ["rank_restarted", "succeeded"]
    assert [r["generation"] for r in changes if r["kind"] == "generation"] == [before + 1], changes
    for n in (a, b):
        for slot in (0, 1):
            assert len(n.rank_pids(slot)) == starts[(n, slot)] + 1, "one process start per rank for the fault"
            final = n.steps(slot, start=-1)
            assert final[-1]["step"] == 150 and final[-1]["world_size"] == 4
            assert final[0]["resumed_from"] > 0, "the restarted ranks resumed from the checkpoint"
            assert {r["world_size"] for r in final} == {4}
            # torchrun's environment: 0 on the first run, one more per restart of the slot, and a
            # MASTER_PORT of the new generation's own (never the store of an older one)
            # (a run restarted before its first step logged none)
            runs = [json_lines(log, "step") for log in n.rank_logs(slot)]
            assert [r[0]["restart_count"] for r in runs if r] == [k for k, r in enumerate(runs) if r]
            before_fault = [r for r in runs[:-1] if r][-1]
            assert final[0]["master"] != before_fault[0]["master"]


@pytest.mark.timeout(150)
def test_a_plain_job_waiting_for_a_lost_node_spends_no_restart_and_forms_again(coordinators, agents):
    """A node lost while the job needs both: the survivor's ranks start again only with a place in
    a map (never without RANK), their restarts for the others' change are not charged, and the
    job forms again, whole, when a node comes back."""
    (leader,) = coordinators(1, extra=PRODUCTION_TIMEOUT)
    # ranks that die at once when their peer goes (a DDP rank may hang in teardown until stopped)
    plain = [sys.executable, str(SCRIPTS / "plain_allreduce.py"), "--steps", "150"]
    extra = ["--max-restarts", "1", "--wait-report", "1"]  # the crash when b went spends it
    a, b = agents([leader.address], "waitfree", ["a", "b"], nodes="2:2", command=plain, extra=extra)
    stepping([a, b])
    b.signal(signal.SIGKILL)  # its ranks die with it
    # a waits below the job's minimum for a few reports: long enough for a rank started without a
    # place to have crashed through the budget (it did so in 4.7 s, at a 1 s backoff)
    wait_until(lambda: len([r for r in a.records("waiting") if "more node" in r.get("message", "")]) >= 3, 60,
               "a saying three times that it waits for a node")
    (c,) = agents([leader.address], "waitfree", ["c"], nodes="2:2", command=plain, extra=extra)
    for n in (a, c):
        assert n.wait(120) == 0, n.log_path.read_text()[-3000:]
    assert not a.records("slot_given_up")
    assert all(r["rank"] is not None for r in a.records("rank_started")), "a rank started without a place"
    for slot in (0, 1):
        final = a.steps(slot, start=-1)
        assert final[-1]["step"] == 150 and {r["world_size"] for r in final} == {4}


@pytest.mark.timeout(60)
def test_a_crash_looping_slot_is_given_up_after_its_restart_budget(coordinators, agents):
    (leader,) = coordinators(1)
    crash = [sys.executable, "-c", "import sys; print('bad value for --lr', file=sys.stderr); sys.exit(7)"]
    (node,) = agents([leader.address], "crashloop", ["c"], slots=1, nodes="1:1", command=crash,
                     extra=["--max-restarts", "2"])
    assert node.wait(40) == 1  # not a success: the operator must see it
    assert len(node.rank_pids(0)) == 3  # the first run and two restarts, whatever restarted it
    (given_up,) = node.records("slot_given_up")
    assert given_up["restarts"] == 2 and given_up["last_code"] == 7
    report = node.log_path.read_text()
    assert "muster run: slot 0 of node 'c' in job 'crashloop' is given up" in report
    assert "exit code 7" in report and "bad value for --lr" in report  # the last lines of its log
    # the leader's log may trail the agent's exit on a loaded machine: waited for, not assumed
    exits = wait_until(lambda: [r for r in leader.find("membership_changed") if r["kind"] == "rank_exited"], 10,
                       "the leader's decision on the crash")
    assert "exit code 7" in exits[0]["reason"]
    # and the run is recorded as failed, not as drained by an operator
    ended = wait_until(lambda: [r for r in leader.find("run_ended") if "outcome" in r], 10, "the run's end")
    assert [r["outcome"] for r in ended] == ["failed"], ended


def muster_run(coordinator: str, job: str, node_id: str, out_dir, *args: str, command=(), env=None):
    """`muster run` as a user starts it (no --log-dir): its stdout and stderr to files."""
    stdout, stderr = open(out_dir / f"{node_id}.out", "wb"), open(out_dir / f"{node_id}.err", "wb")
    with stdout, stderr:
        return subprocess.Popen([sys.executable, "-m", "muster.cli", "--log-json", "run", "--coordinator", coordinator,
                                 "--job", job, "--node-id", node_id, *args, "--", *command], stdout=stdout,
                                stderr=stderr, env={**os.environ, **(env or {})}, start_new_session=True)


@pytest.fixture
def started():
    procs = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()  # its ranks follow it (PR_SET_PDEATHSIG)
            p.wait(5)


@pytest.mark.timeout(90)
def test_a_script_failing_at_start_on_every_rank_ends_with_a_report_on_every_node(coordinators, started, tmp_path):
    """The crash loop of a bad argument ends, on every node, with the failing rank, its exit code and
    the last lines of its stderr (no --log-dir). Only a slot's own crashes spend its budget: the
    restarts that the other slots' crashes force (a new map each) are not charged."""
    (leader,) = coordinators(1)
    # One write for the error line: print() writes its text and its newline apart, and unbuffered
    # (PYTHONUNBUFFERED=1, as CI sets it) an agent record written between them tore the line.
    script = ("import os, sys, time; print('restart', os.environ['TORCHELASTIC_RESTART_COUNT'], flush=True); "
              "time.sleep(0.3); sys.stderr.write('train.py: error: argument --lr: invalid float value\\n'); "
              "sys.exit(2)")
    for node in ("a", "b"):
        started.append(muster_run(leader.address, "BadArg", node, tmp_path, "--nodes", "1:2", "--slots", "2",
                                  "--max-restarts", "2", "--restart-backoff", "0.2",
                                  command=[sys.executable, "-c", script]))
    for p in started:
        assert p.wait(60) == 1
    errs = {node: (tmp_path / f"{node}.err").read_text() for node in ("a", "b")}
    for node, err in errs.items():
        assert "muster run: job id 'BadArg' is job 'badarg-" in err  # mapped onto the coordinator's names
        # The ranks share the agent's stderr, in whole lines (test_stderr_tail): every record is a line.
        starts = [json.loads(line) for line in err.splitlines() if '"rank_started"' in line]
        given_up = {r["slot"]: r for r in (json.loads(line) for line in err.splitlines() if '"slot_given_up"' in line)}
        for slot in (0, 1):
            assert given_up[slot]["restarts"] == 2, "given up after --max-restarts restarts for its own crashes"
            assert [r["restart_count"] for r in starts if r["slot"] == slot] == list(range(len(
                [r for r in starts if r["slot"] == slot])))
            assert f"muster run: slot {slot} of node '{node}' in job 'badarg-" in err
        assert f"muster run: node '{node}' of job 'badarg-" in err and "gives up" in err
    root = "".join(errs.values())
    assert "last crash: exit code 2" in root and "muster run:     train.py: error: argument --lr: invalid float" in root
    assert "restart 0" in (tmp_path / "a.out").read_text() + (tmp_path / "b.out").read_text()  # stdout: the agent's


@pytest.mark.timeout(60)
def test_a_lone_agent_says_what_it_waits_for_and_gives_up_after_the_form_timeout(coordinators, started, tmp_path):
    (leader,) = coordinators(1)
    started.append(muster_run(leader.address, "Lone", "n0", tmp_path, "--nodes", "2", "--form-timeout", "4",
                              "--wait-report", "1", command=[sys.executable, "-c", "pass"]))
    assert started[0].wait(60) == 1
    err = (tmp_path / "n0.err").read_text()
    waiting = [json.loads(line) for line in err.splitlines() if '"event": "waiting"' in line]
    assert len(waiting) >= 2, err  # at start and periodically
    assert all("waiting for 1 more node (1 joined, min 2" in w["message"] for w in waiting)
    # it gave up 4 s after it began to wait (on its own clock: a loaded machine's slow start-up is not counted)
    (gave_up,) = [json.loads(line) for line in err.splitlines() if '"event": "form_timeout"' in line]
    assert 3 < record_time(gave_up) - record_time(waiting[0]) + 1.0 < 4 + 5, (waiting[0], gave_up)
    assert "muster run: no place in job 'lone-" in err and "within 4s (--form-timeout)" in err
    assert "rank_started" not in err


@pytest.mark.timeout(60)
def test_ctrl_c_drains_the_node_and_exits_130(coordinators, started, tmp_path):
    (leader,) = coordinators(1)
    started.append(muster_run(leader.address, "sigint", "n0", tmp_path,
                              command=[sys.executable, "-c", "import time; time.sleep(60)"]))
    wait_until(lambda: "rank_started" in (tmp_path / "n0.err").read_text(), 30, "the rank")
    started[0].send_signal(signal.SIGINT)
    assert started[0].wait(30) == 130
    assert "muster run: SIGINT: draining node 'n0'" in (tmp_path / "n0.err").read_text()


@pytest.mark.timeout(150)
def test_ranks_waiting_for_the_zygote_start_with_the_map_of_a_node_that_joined_meanwhile(coordinators, agents, tmp_path):
    """Node a forms generation 1 alone while its zygote still imports; b joins before a's ranks
    start. They start once, in generation 2: before, they forked with generation 1's environment and
    were restarted at once (a CI run saw it as a slot started twice)."""
    (tmp_path / "slow_import.py").write_text("import time\ntime.sleep(4)\n")
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    preload = ["--preload", "torch,torch.distributed,slow_import"]
    (leader,) = coordinators(1)
    (a,) = agents([leader.address], "late", ["a"], steps=20, extra=preload, env=env)
    wait_until(lambda: leader.find("membership_changed", kind="formed"), 30, "node a formed generation 1 alone")
    assert not a.records("rank_started"), "the zygote was ready before b joined: the test proves nothing"
    (b,) = agents([leader.address], "late", ["b"], steps=20)
    assert a.wait(120) == 0 and b.wait(120) == 0, a.log_path.read_text()[-3000:]
    started = a.records("rank_started")
    assert sorted(r["slot"] for r in started) == [0, 1] and {r["generation"] for r in started} == {2}, started
