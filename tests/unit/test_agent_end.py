"""How a node agent ends with its job, against a fake NodeSession: the leader's JobEnd and stop
orders give the outcome's exit status, a finishing job is never re-formed, finished ranks are
reported as such."""

import asyncio
import signal
import sys

import pytest

from muster.testing import until
from muster.v1 import muster_pb2 as pb
from muster.worker.agent.agent import NodeAgent
from muster.worker.agent.agent_config import AgentConfig
from muster.worker.node_session import JobEnded
from muster.worker.outcome import EXIT_FAILED, EXIT_STOPPED, EXIT_SUCCEEDED
from muster.worker.agent.slot import CRASH_LOOP_S, outside_crash_loop
from muster.worker.agent.supervisor import RankSupervisor


class FakeSession:
    def __init__(self, *, ends: pb.JobEnd | None = None, joined_run: int = 1):
        self.ends = ends
        self.joined_run = joined_run
        self.finishing = False
        self.term = 1
        self.generation = 0
        self.member_id = 1
        self.exits: list[pb.RankExit] = []
        self.left: list[dict] = []

    async def run(self) -> None:
        raise JobEnded(self.ends)

    async def leave(self, **kwargs):
        self.left.append(kwargs)
        return pb.LeaveResponse()

    def send_now(self) -> None:
        pass


class FakeProcess:
    pid = 4242
    returncode = 0


def agent(session: FakeSession, slots: int = 2) -> NodeAgent:
    a = NodeAgent(AgentConfig(coordinators=("127.0.0.1:1",), job="j", node_id="n", slots=slots,
                              argv=(sys.executable, "train.py")))
    a.session = session
    a._done = asyncio.get_running_loop().create_future()
    return a


def within(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def script_node(tmp_path, script: str, assignment: pb.Assignment, *, library: bool = False) -> NodeAgent:
    """A 2-slot agent over a FakeSession (`.session`) whose slots run `script` as real processes, with
    its supervisor, under `assignment` (not started: the caller starts its slots)."""
    path = tmp_path / "train.py"
    path.write_text(script)
    a = NodeAgent(AgentConfig(coordinators=("127.0.0.1:1",), job="j", node_id="n", slots=2,
                              argv=(sys.executable, str(path))))
    a.session, a._done, a.library = FakeSession(), asyncio.get_running_loop().create_future(), library
    a.ranks = RankSupervisor(a, str(tmp_path), str(tmp_path / "ranks.sock"))
    a.assignment = assignment
    return a


async def start_all(a: NodeAgent) -> None:
    for slot in a.slots:
        await a.ranks.start(slot)


def said(slot, report: pb.RankReport) -> None:
    """`report` as the last word of the slot's current process over the agent's socket."""
    slot.report = pb.RankReport()
    slot.report.CopyFrom(report)
    slot.report.pid = slot.proc.pid


@pytest.mark.parametrize("outcome, code", [("succeeded", EXIT_SUCCEEDED), ("failed", EXIT_FAILED),
                                           ("stopped", EXIT_STOPPED), ("from-a-newer-coordinator", EXIT_FAILED)])
def test_the_end_of_the_run_exits_with_its_outcomes_code(outcome, code, capsys):
    async def scenario():
        a = agent(FakeSession(ends=pb.JobEnd(outcome=outcome, reason="by the book", run=2)))
        a._on_directive(pb.Directive(term=1, end=pb.JobEnd(outcome=outcome, run=2)))  # no map: nothing changes
        assert a.assignment is None
        await a._stream()
        return a._done.result()

    assert within(scenario()) == code
    said = capsys.readouterr().err
    assert said.count(f"muster run: job 'j' (run 2) ended: {outcome} (by the book); node 'n' exits {code}") == 1


def test_an_operators_stop_drains_the_node_and_exits_3(capsys):
    async def scenario():
        session = FakeSession()
        a = agent(session)
        a._on_directive(pb.Directive(term=1, drain=pb.Drain(after_step=7, reason="budget spent", stop=True)))
        code = await a._done
        return code, session.left

    code, left = within(scenario())
    assert code == EXIT_STOPPED
    assert left == []  # the coordinator planned the leave itself
    assert "muster run: node 'n' of job 'j' stopped by an operator: budget spent (after step 7)" in capsys.readouterr().err


def test_a_finishing_job_is_never_reformed_and_its_finished_ranks_say_so():
    async def scenario():
        session = FakeSession()
        a = agent(session)
        a.slots[0].finished, a.slots[0].proc = True, FakeProcess()
        assert a.finishing()
        reports = a.hub.reports()
        tasks = asyncio.all_tasks()
        a._on_directive(pb.Directive(term=1, generation=3, assignment=pb.Assignment(
            generation=3, role=pb.ROLE_ACTIVE, local_ranks=[0, 1], world_size=2)))
        assert asyncio.all_tasks() == tasks  # no reconcile (nor port publication) was even begun
        older = FakeSession(joined_run=0)  # a coordinator that predates runs refuses the state
        a.session = older
        return reports, a.slots[1].starts, a.hub.reports()

    reports, starts, to_older = within(scenario())
    assert [(r.local_rank, r.pid, r.state) for r in reports] == [(0, 4242, pb.RANK_STATE_FINISHED)]
    assert starts == 0
    assert to_older == []


def test_the_leaders_finishing_flag_alone_stops_restarts():
    async def scenario():
        session = FakeSession()
        a = agent(session)
        assert not a.finishing()
        session.finishing = True
        return a.finishing()

    assert within(scenario())


def test_a_rank_ending_without_completing_once_another_finished_is_not_restarted_and_fails_the_node(
        tmp_path, capsys):
    async def scenario():
        a = script_node(tmp_path, "import os, sys, time\nif os.environ['LOCAL_RANK'] == '1':\n    time.sleep(1)\n"
                                  "    sys.exit(5)\n",
                        pb.Assignment(generation=1, role=pb.ROLE_ACTIVE, local_ranks=[0, 1], world_size=2))
        await start_all(a)
        return await a._done, a.session, a.slots

    code, session, slots = within(scenario())
    assert code == EXIT_FAILED
    assert [s.starts for s in slots] == [1, 1] and slots[0].finished and slots[1].failed
    assert [(e.local_rank, e.exit_code, e.restarting) for e in session.exits] == [(1, 5, False)]
    assert [left["finished"] for left in session.left] == [True]  # the leader records the failure from the exit
    assert ("muster run: node 'n' of job 'j' failed: rank 1 (slot 1) ended (exit code 5) without completing its "
            "script as the job was finishing") in capsys.readouterr().err


def test_a_rank_started_as_a_newer_map_arrives_keeps_the_generation_of_its_environment(tmp_path):
    """Its env (RANK, MASTER_PORT) is the map's current when its start began; a map arriving while
    the process starts must find it stale, or it waits for good on the older MASTER_PORT (seen
    under warm_stress: a rank logged in generation 16 with generation 15's port)."""
    from muster.worker.rank.runner import Program
    from muster.worker.rank.zygote import WarmProcess

    async def scenario():
        a = agent(FakeSession(), slots=1)
        a.ranks = RankSupervisor(a, str(tmp_path), str(tmp_path / "ranks.sock"))
        a.assignment = pb.Assignment(generation=15, role=pb.ROLE_ACTIVE, local_ranks=[0], world_size=1)
        seen = {}

        class ForkingAsTheMapChanges:
            async def spawn(self, program: Program, env: dict, stdio) -> WarmProcess:
                seen.update(env)
                a.assignment = pb.Assignment(generation=16, role=pb.ROLE_ACTIVE, local_ranks=[0], world_size=1)
                return WarmProcess(4242)

            def close(self) -> None:
                pass

        a.ranks.warm = ForkingAsTheMapChanges()
        await a.ranks.start(a.slots[0], ("127.0.0.1", "1500"))
        return seen, a.slots[0]

    env, slot = within(scenario())
    assert env["MUSTER_GENERATION"] == "15" and env["MASTER_PORT"] == "1500"
    assert slot.generation == 15


def test_a_sigkill_starts_no_crash_loop_however_soon_it_came():
    """Killed from outside (the OOM killer, an operator, a fault injector): restarted at once; a
    script's own quick crash continues the loop and backs off."""
    assert outside_crash_loop(-signal.SIGKILL, 1.0)
    assert not outside_crash_loop(1, 1.0) and not outside_crash_loop(-signal.SIGSEGV, 1.0)
    assert outside_crash_loop(1, CRASH_LOOP_S + 1)


# Slot 0 down (its replacement has no place yet), slot 1 placed
REPLACING = pb.Assignment(generation=3, role=pb.ROLE_ACTIVE, local_ranks=[1], down_local_ranks=[0], world_size=2)


@pytest.mark.parametrize("report, ended", [
    (pb.RankReport(local_rank=0, state=pb.RANK_STATE_HOLDING, step=0), True),
    (pb.RankReport(local_rank=0, state=pb.RANK_STATE_STARTING, step=0), True),
    (pb.RankReport(local_rank=0, state=pb.RANK_STATE_FORMING, step=12), False),  # it received the state: it trains
    (pb.RankReport(local_rank=0, state=pb.RANK_STATE_RUNNING, step=13), False),
])
def test_a_replacement_with_no_place_as_the_job_finishes_is_ended_and_its_slot_counts_as_finished(
        tmp_path, report, ended):
    """Slot 0's replacement waits for a place at a planned switch after the job's last step; slot 1
    completes its script. A finishing job re-forms nothing: the replacement is ended at once and the
    node leaves finished (before: it held --hold-timeout, 300 s, then exited 3 and failed the run)."""
    async def scenario():
        a = script_node(tmp_path, "import os, sys, time\nif os.environ['LOCAL_RANK'] == '1':\n    time.sleep(0.5)\n"
                                  "    sys.exit(0)\ntime.sleep(60)\n", REPLACING, library=True)
        await start_all(a)
        replacement = a.slots[0]
        replacement.restarts, replacement.connected = 1, True
        said(replacement, report)
        watch = asyncio.create_task(a.ranks.watch_library_ranks())
        try:
            if ended:
                code = await asyncio.wait_for(asyncio.shield(a._done), 6)
            else:
                code = None
                # (waited for, not slept on: a busy host starts slot 1's process late, CI's run D)
                await until(a.finishing, "slot 1's script completed: the job finishing", 6)
                await asyncio.sleep(0.5)  # the watch's 20 ms looks at a finishing job: none ends it
            alive = replacement.alive
            if alive:
                await a.ranks.stop(replacement)
            return code, alive, a.session, a.slots
        finally:
            watch.cancel()

    code, alive, session, slots = within(scenario())
    assert slots[1].finished
    assert slots[0].outrun is ended and alive is not ended
    assert session.exits == []  # nothing failed: no exit is reported for it
    if ended:
        assert code == EXIT_SUCCEEDED
        (left,) = session.left
        assert left["finished"] and "replacement with no place yet as the job finished (slot(s) 0)" in left["reason"]


def test_a_library_rank_crashed_before_the_job_began_finishing_is_not_restarted_after_it_nor_a_failure(tmp_path):
    """The crash is reported (the survivors re-form without it); the job begins finishing before its
    replacement would start: the replacement would never get a place, so none is started, and the
    slot counts as finished. (A script without the library still fails the node: restart semantics
    were to re-form the job with that slot.)"""
    async def scenario():
        a = script_node(tmp_path, "import os, sys, time\nif os.environ['LOCAL_RANK'] == '0':\n    sys.exit(5)\n"
                                  "time.sleep(0.5)\n",
                        pb.Assignment(generation=1, role=pb.ROLE_ACTIVE, local_ranks=[0, 1], world_size=2),
                        library=True)

        async def finishing_meanwhile(slot, cause):  # another rank completed the job as the crash was handled
            a.session.finishing = True
            return True

        a.ranks.restart_allowed = finishing_meanwhile
        await start_all(a)
        return await a._done, a.session, a.slots

    code, session, slots = within(scenario())
    assert code == EXIT_SUCCEEDED
    assert [s.starts for s in slots] == [1, 1] and slots[0].outrun and not slots[0].failed and slots[1].finished
    assert [(e.local_rank, e.exit_code) for e in session.exits] == [(0, 5)]  # reported as it crashed
    (left,) = session.left
    assert left["finished"], left


@pytest.mark.parametrize("report, outrun", [(None, True),
                                            (pb.RankReport(local_rank=0, state=pb.RANK_STATE_RUNNING, step=9), False)])
def test_a_replacement_ending_as_the_job_finishes_fails_the_node_only_if_it_had_trained(tmp_path, report, outrun):
    """Slot 1 completes; then slot 0's replacement ends on its own (exit 5). One that never trained
    (nothing said yet, e.g. still importing) had nothing to complete: its slot counts as finished. One
    that trained ended without completing its script: the node fails, the leader hears of the exit."""
    async def scenario():
        a = script_node(tmp_path, "import os, sys, time\nif os.environ['LOCAL_RANK'] == '0':\n    time.sleep(1.0)\n"
                                  "    sys.exit(5)\n", REPLACING, library=True)
        await start_all(a)
        a.slots[0].restarts = 1  # a replacement
        if report is not None:
            said(a.slots[0], report)
        return await a._done, a.session, a.slots

    code, session, slots = within(scenario())
    assert slots[1].finished and slots[0].outrun is outrun and slots[0].failed is not outrun
    assert code == (EXIT_SUCCEEDED if outrun else EXIT_FAILED)
    assert [(e.local_rank, e.exit_code) for e in session.exits] == ([] if outrun else [(0, 5)])


@pytest.mark.parametrize("answer", ["a map after the crash", "the run's end"])
def test_a_library_rank_in_a_crash_loop_starts_again_only_once_the_leader_answered_its_crash(tmp_path, answer):
    """Stop 74's fresh-clone run X: a script raising at the same step after every restart. Its slot's
    second crash backed off 0.2 s; the leader's verdict (a fault that repeats) came later on the loaded
    host, and a third process started, only to be stopped with the run. A crash loop's next process
    now waits (bounded) for the leader's answer: a map after the crash starts it, the run's end not."""
    from dataclasses import replace

    async def scenario():
        a = script_node(tmp_path, "import sys\nsys.exit(5)\n",
                        pb.Assignment(generation=1, role=pb.ROLE_ACTIVE, local_ranks=[0, 1], world_size=2),
                        library=True)
        a.config = replace(a.config, restart_backoff_s=0.05)
        slot = a.slots[0]
        await a.ranks.start(slot)
        await until(lambda: len(a.session.exits) == 2, "the slot's second crash, in a crash loop", 8)
        await asyncio.sleep(0.5)  # ten times its backoff: no answer yet, so no third process
        assert slot.starts == 2 and slot.crashes == 2
        if answer == "the run's end":
            a.finish(EXIT_FAILED)
            await asyncio.sleep(0.3)
        else:
            a.assignment = pb.Assignment(generation=2, role=pb.ROLE_ACTIVE, local_ranks=[1], down_local_ranks=[0],
                                         world_size=1)
            await until(lambda: slot.starts == 3, "the replacement started into the map after the crash", 5)
            a.finish(EXIT_FAILED)
        return slot.starts

    assert within(scenario()) == (2 if answer == "the run's end" else 3)
