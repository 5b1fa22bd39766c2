"""The worker's training-thread contract, without a coordinator: configuration from the
environment, what a step scope counts, and which errors it lets through."""

import types

import pytest
import torch

from muster.local import wait_until
from muster.v1 import muster_pb2 as pb
from muster.worker import Worker, WorkerConfig, WorkerError


def worker(**over) -> Worker:
    return Worker(WorkerConfig(coordinators=("127.0.0.1:1",), job="j", node_id="n", abort_wait_s=0.05, **over))


def test_config_from_env_needs_the_coordinator_and_the_job():
    with pytest.raises(WorkerError, match="MUSTER_COORDINATOR and MUSTER_JOB"):
        WorkerConfig.from_env({})
    c = WorkerConfig.from_env({"MUSTER_COORDINATOR": "a:1, b:2", "MUSTER_JOB": "j", "MUSTER_MIN_NODES": "2",
                               "MUSTER_DIGEST_EVERY": "10", "LOCAL_RANK": "3"})
    assert (c.coordinators, c.min_nodes, c.digest_every, c.local_rank) == (("a:1", "b:2"), 2, 10, 3)
    assert c.backend == ("nccl" if torch.cuda.is_available() else "gloo")


def test_a_completed_step_counts_and_reports_its_duration():
    w = worker()
    with w.step_scope() as step:
        pass
    assert step.completed and w.step == 1
    assert w._progress.now[0] == 1 and w._progress.now[2] == "running"


def test_an_error_without_a_membership_change_is_the_scripts_own_and_propagates():
    w = worker()
    with pytest.raises(ValueError):
        with w.step_scope() as step:
            raise ValueError("a bug in the training step")
    assert not step.completed and w.step == 0


def test_a_failure_of_the_background_link_surfaces_at_the_step_boundary():
    w = worker()
    w._thread.error = WorkerError("lost the coordinator")
    w.link.changed.set()
    with pytest.raises(WorkerError, match="lost the coordinator"):
        with w.step_scope():
            pass


def test_a_planned_switch_waits_for_its_step():
    w = worker()
    w.link.latest = pb.Assignment(generation=2, role=pb.ROLE_ACTIVE, switch_at_step=5)
    w.generation = 1
    w.link.changed.set()
    with w.step_scope():
        pass  # step 1 < 5: no switch yet, and the flag stays up to look again
    assert w.generation == 1 and w.link.changed.is_set()


def test_a_planned_switch_heard_past_its_step_leaves_the_group_at_once():
    """A late map: the others switched at its step and left the group, so this rank's next
    collective would wait for them; it aborts the group instead (and reforms at the failure)."""
    w = worker()
    aborted = []
    w._thread.abort = lambda below, into=None: aborted.append(below)
    w.generation, w.step = 1, 6

    def hear(generation, switch_at):
        w._thread.on_directive(pb.Directive(assignment=pb.Assignment(generation=generation, role=pb.ROLE_ACTIVE,
                                                              switch_at_step=switch_at)))
    hear(2, 9)  # ahead: the step boundary switches
    w.step = 9
    hear(3, 9)  # heard with its step done: the boundary may be behind, the next step's collective begun
    w.step = 10
    hear(4, 9)  # past it
    assert aborted == [3, 4]


def test_long_phase_is_reported_and_ends():
    w = worker()
    with w.long_phase("checkpoint"):
        assert w._progress.now[2:4] == ("long_phase", "checkpoint")
        assert w._reports()[0].state == pb.RANK_STATE_LONG_PHASE
    assert w._progress.now[2:4] == ("running", "")


def test_a_long_phase_named_with_a_control_character_is_refused_where_it_is_declared():
    w = worker()
    before = w._progress.now
    with pytest.raises(ValueError, match="control character"):  # not later, as the node's frames refused
        with w.long_phase("eval\x1b[2J"):
            pass
    assert w._progress.now == before


def test_register_refuses_extras_without_state_dict():
    with pytest.raises(TypeError, match="state_dict"):
        worker().register(loader=object())


def test_a_drain_ends_training_as_the_step_after_the_agreed_one_begins():
    from muster.worker import Drained

    w = worker()
    w.link.drain_after = 1
    w.link.changed.set()
    with w.step_scope() as step:
        pass
    assert step.completed and w.step == 1  # the agreed step completes and counts
    with pytest.raises(Drained):
        with w.step_scope():
            pass


def test_the_group_to_form_is_an_unformed_abort_before_the_planned_switch_that_follows_it():
    from muster.worker.library.reform import to_form

    def gen(g, slots=(0, 1), *, abort=False, switch_at=0):
        return pb.Assignment(generation=g, role=pb.ROLE_ACTIVE, local_ranks=list(slots), abort_previous=abort,
                             switch_at_step=switch_at)
    aborted, planned = gen(3, abort=True), gen(4, switch_at=50)
    assert to_form(planned, aborted, 0, after=2) == aborted  # train in the abort's group up to the switch
    assert to_form(planned, aborted, 0, after=3) == planned  # formed it: the switch is next
    assert to_form(planned, gen(3, slots=(1,), abort=True), 0, after=2) == planned  # no place in it: skip
    assert to_form(gen(5, abort=True), planned, 0, after=2).generation == 5  # a newer abort wins at once
    assert to_form(gen(5, slots=(1,)), None, 0, after=2) is None  # no place for this rank
    assert to_form(gen(2), None, 0, after=2) is None  # nothing newer


def test_a_step_boundary_reforms_for_an_abort_or_a_switch_due_and_looks_again_for_one_ahead():
    from muster.worker.library.reform import at_boundary

    def gen(g, *, slots=(0,), abort=False, switch_at=0):
        return pb.Assignment(generation=g, role=pb.ROLE_ACTIVE, local_ranks=list(slots), abort_previous=abort,
                             switch_at_step=switch_at)
    assert at_boundary(None, None, None, 0, 1, 5, 0) == "nothing"
    assert at_boundary(None, gen(1), gen(1), 0, 1, 5, 0) == "nothing"  # nothing newer than this generation
    assert at_boundary(None, gen(2, abort=True), gen(2, abort=True), 0, 1, 5, 0) == "reform"
    assert at_boundary(None, gen(2), gen(2), 0, 1, 5, 0) == "reform"  # a rebuild, formed at once
    assert at_boundary(None, gen(2, switch_at=9), None, 9, 1, 5, 0) == "again"  # a planned switch ahead
    assert at_boundary(None, gen(2, switch_at=9), None, 9, 1, 9, 0) == "reform"  # ...due at its step
    # A later map superseded the switch before its step: the step heard first holds (peers leave there)
    assert at_boundary(None, gen(3, switch_at=12), None, 9, 1, 9, 0) == "reform"
    assert at_boundary(None, gen(3, switch_at=9), gen(2, abort=True), 9, 1, 5, 0) == "reform"  # the abort's group first
    assert at_boundary(None, gen(3, switch_at=9), gen(2, slots=(1,), abort=True), 9, 1, 5, 0) == "again"  # no place
    assert at_boundary(7, gen(2, abort=True), None, 0, 1, 7, 0) == "again"  # drained: Drained as the next step begins
    assert at_boundary(9, None, None, 0, 1, 7, 0) == "again"  # the drain's step is ahead


def test_the_mailbox_keeps_the_first_switch_heard_away_from_the_running_generation():
    """Generation 6 said "switch after step 4", generation 7 (0.15 s later) "after step 7": a rank
    that heard both leaves its group after step 4, where the peers that heard only 6 leave it."""
    from muster.worker.link import Link

    link = Link("test")
    link.session = types.SimpleNamespace(generation=5)

    def hear(g, switch_at=0, abort=False):
        link._deliver(pb.Directive(assignment=pb.Assignment(generation=g, role=pb.ROLE_ACTIVE, local_ranks=[0],
                                                            switch_at_step=switch_at, abort_previous=abort)))
    assert link.switch_after(5) == 0
    hear(6, switch_at=4)
    hear(7, switch_at=7)
    assert link.latest.generation == 7 and link.switch_after(5) == 4
    link._running(7)  # formed 7 (the reform's link.running, on the link's loop)
    assert link.switch_after(7) == 0 and link.switches == {}
    hear(8, switch_at=20)
    hear(9, abort=True)  # an abort: formed at once, no planned step
    assert link.switch_after(7) == 20 and link.switches == {8: 20}
    link._running(9)
    hear(10, switch_at=30)  # (what the rank left behind is dropped as the next arrives: it stays a handful)
    assert link.switches == {10: 30}


def test_an_abort_watches_a_group_formed_but_not_yet_adopted():
    """A chaos run aborted a group while the rank synced the state in it (formed, its generation
    not yet the rank's): the abort watched the rank's older generation, which it had left, so
    nothing bounded the sync stuck in the aborted group. The watch is for the formed group's."""
    w = worker()

    class Formed:
        spec = type("Spec", (), {"generation": 12})()
        left = []

        def abort(self, below):
            self.left.append(below)

    w.comm, w.generation = Formed(), 11
    watched = []
    w._unwinding.watch = lambda generation, aborted_by: watched.append((generation, aborted_by))
    w._thread.abort(13)
    wait_until(lambda: watched, 5, "the abort thread's watch")
    assert Formed.left == [13] and watched == [(12, 13)]
    w.comm.spec = None  # torn down: the training thread is between groups, past the one it stepped in
    w._thread.abort(14)
    wait_until(lambda: len(watched) == 2, 5, "the second abort's watch")
    assert watched == [(12, 13), (11, 14)]


class Group:
    """A formed group whose abort thread may have aborted it (`cut`)."""
    formed, cut = True, False

    def aborted(self):
        return self.cut


def guards(generation=3, device="cpu"):
    from muster.worker.library.step_guards import StepGuards

    group, at = Group(), {"generation": generation}
    return StepGuards(lambda: at["generation"], lambda: 7, lambda: group, lambda: False,
                      torch.device(device)), group, at


def test_on_cuda_an_optimizer_step_after_an_abort_is_refused_and_the_state_kept(monkeypatch):
    """NCCL's all-reduce finishes on the GPU after the host moved on; cut short by an abort, its
    partial sums must not reach the parameters (the step is discarded and redone instead)."""
    from muster.worker.library.backends import Nccl

    synced = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type(
        "Stream", (), {"synchronize": lambda self: synced.append(device)})())
    g, group, _ = guards(device="cuda")
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    g.install(None, opt)
    model(torch.ones(1, 2)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()  # not aborted: the step applies, after waiting for the GPU
    assert synced and not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    kept = [p.detach().clone() for p in model.parameters()]
    group.cut = True
    with pytest.raises(RuntimeError) as refused:
        opt.step()
    assert Nccl().is_transport_failure(refused.value), "the step scope discards it as a failure outside the rank"
    assert "step 8" in str(refused.value)
    assert all(torch.equal(a, b) for a, b in zip(kept, model.parameters()))


def test_a_step_in_flight_when_its_group_is_aborted_stops_at_its_next_module_or_gradient():
    from muster.worker.library.comm import StepCut

    g, _, at = guards(generation=3)
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
    g.install(model, torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.ones(1, 2)).sum().backward()  # its group stands: nothing stops it
    g.aborted(4)  # the abort thread aborted generation 3
    with pytest.raises(StepCut, match="generation 3 was aborted"):
        model(torch.ones(1, 2))
    at["generation"] = 4  # formed anew: steps run again
    loss = model(torch.ones(1, 2)).sum()
    g.aborted(5)  # aborted between the forward and the backward
    with pytest.raises(StepCut):
        loss.backward()


def test_a_worker_guards_what_it_registers():
    w = worker()
    model = torch.nn.Linear(2, 1)
    w.register(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    w.generation = 2
    w._guards.aborted(3)
    with pytest.raises(Exception, match="the step in flight is cut short"):
        model(torch.ones(1, 2))


def test_an_aborted_groups_ddp_wrapper_stops_before_ddps_own_collectives():
    """In a new group's first steps DDP's forward begins with collectives of its own (the bucket
    rebuild's broadcasts), which on an aborted NCCL group wait for the abort: the wrapper's check
    comes first."""
    import torch.distributed as dist

    from muster.worker.library.comm import StepCut

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        w = worker()
        model = torch.nn.Linear(2, 1)
        w.register(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        w.generation = 2
        ddp = w.ddp(model)
        entered = []
        ddp._pre_forward = lambda *a, **k: entered.append(a)  # DDP's bucket rebuild and buffer sync
        w._guards.aborted(3)
        with pytest.raises(StepCut):
            ddp(torch.ones(1, 2))
        assert not entered
    finally:
        dist.destroy_process_group()


class Position:
    def __init__(self):
        self.epoch = 0

    def state_dict(self):
        return {"epoch": self.epoch}

    def load_state_dict(self, state):
        self.epoch = state["epoch"]


@pytest.mark.parametrize("inside", [True, False])
def test_extras_updated_after_the_step_scope_are_named_at_the_first_step(inside):
    """Issue 55: a reform or peer snapshot at a boundary takes the extras as the scope left them, so
    an update after it reaches a replacement or a rollback a step stale (a samples counter ended at
    312 of 320). The rule, update them inside the scope, is checked once, at a process's first step."""
    from structlog.testing import capture_logs

    data = Position()
    w = worker().register(model=torch.nn.Linear(2, 2), data=data)
    with capture_logs() as lines:
        for _ in range(3):
            with w.step_scope():
                if inside:
                    data.epoch = w.step + 1
            if not inside:
                data.epoch = w.step
    warned = [line for line in lines if line["event"] == "extras_updated_after_step"]
    assert len(warned) == (0 if inside else 1), warned
    assert all((line["step"], line["extras"]) == (1, ["data"]) for line in warned)


def test_a_rank_says_the_generation_its_state_began_from_nothing_in_while_that_state_is_its_own():
    """The leader's state-lost verdict rests on this word, said in every reform (a word of one reform
    was lost where the rank re-formed before its agent's next frame): a rank that trains on from step
    0 with nothing restored begins its state there; its own state going on keeps the word; a state
    taken from another rank or a tier is not its own (0). A rank of a replica group benched out of the
    mesh (a replacement at step 0 beside a survivor, waiting to be placed) restored nothing for another
    reason."""
    from muster.worker.library.reform_record import begun_at
    from muster.worker.library.state import Bench
    from muster.worker.library.state import SyncResult
    from muster.worker.library.transfer import Card, SyncPlan

    def sync(role, bench=None):
        return SyncResult(0, SyncPlan(Card(0, "f", "l"), (0,), (), ()), role, bench=bench)

    assert begun_at(4, "", sync("source"), 0) == 4  # a first formation, or every rank lost: the leader tells
    assert begun_at(5, "replica", sync("source"), 4) == 4  # (a lone restarted rank trained on, then a switch)
    assert begun_at(5, "replica", sync("receiver"), 4) == 0
    assert begun_at(6, "checkpoint", sync("source"), 4) == 0
    assert begun_at(5, "", sync("benched", Bench("replica group out of the mesh", others_train=False)), 0) == 0


def test_a_collective_between_steps_is_never_started_on_an_aborted_group():
    """The integrations ask before a trainer's own collective outside a step (Lightning's SIGTERM
    broadcast before every batch): on a group just aborted it would wait for a peer that is gone."""
    from muster.worker.library.comm import StepCut

    w = worker()
    w.generation = 2
    w.check_group()  # its group stands
    w._guards.aborted(3)  # (what the abort thread does first)
    with pytest.raises(StepCut, match="generation 2 was aborted"):
        w.check_group()

