"""The straggler watch (pure): named after min_steps above the factor, cleared with hysteresis,
a whole node named as the node, noise and too few ranks name nobody."""

import random

import pytest

from muster.coordinator.core.live_records import NodeLive, RankLive
from muster.coordinator.core.state import Placement
from muster.coordinator.core.stragglers import Look, StragglerPolicy, StragglerWatch, lower_median

POLICY = StragglerPolicy(factor=1.5, min_steps=10)


def job(nodes: int = 4, slots: int = 2):
    placements = [Placement(f"n{i}", i, i * slots, tuple(range(slots))) for i in range(nodes)]
    live = {p.node_id: NodeLive(0.0, ranks={s: RankLive(state="running") for s in p.slots}) for p in placements}
    return placements, live


def steps(placements, live, watch, computes: dict[tuple[str, int], float], n: int, base: float = 0.1):
    """`n` steps of every rank, each reporting `base` compute or its entry in `computes`; what was
    named and cleared over them."""
    named, cleared = [], []
    for _ in range(n):
        for node_id, node in live.items():
            for slot, r in node.ranks.items():
                r.step += 1
                r.compute_s = computes.get((node_id, slot), base)
        found, gone = watch.assess(placements, live, step_time_s=0.3)
        named += found
        cleared += gone
    return named, cleared


def test_a_slow_rank_is_named_after_min_steps_with_its_factor_and_the_loss():
    placements, live = job()
    watch = StragglerWatch(POLICY)
    named, _ = steps(placements, live, watch, {("n2", 1): 0.2}, 10)
    assert named == []  # 10 steps seen above, the first one sets the start: not yet
    named, _ = steps(placements, live, watch, {("n2", 1): 0.2}, 1)
    assert [(s.node_id, s.local_ranks, s.factor, s.whole_node) for s in named] == [("n2", (1,), 2.0, False)]
    assert named[0].loss == pytest.approx(0.1 / 0.3, abs=0.01)  # its excess compute over the step time
    assert named[0].median_ms == 100.0  # what its factor is over: the job's median compute
    assert live["n2"].ranks[1].straggler_factor == 2.0 and live["n2"].ranks[0].straggler_factor == 0
    assert "local rank(s) [1]" in named[0].describe()
    named, _ = steps(placements, live, watch, {("n2", 1): 0.2}, 30)
    assert named == []  # named once


def test_every_rank_of_a_node_slow_names_the_node_and_hysteresis_clears_it_only_below_half_the_margin():
    placements, live = job()
    watch = StragglerWatch(POLICY)
    slow = {("n1", 0): 0.3, ("n1", 1): 0.3}
    named, _ = steps(placements, live, watch, slow, 12)
    assert [(s.node_id, s.whole_node) for s in named] == [("n1", True)]
    assert "node 'n1' computes 3.00x" in named[0].describe()
    _, cleared = steps(placements, live, watch, {("n1", 0): 0.13, ("n1", 1): 0.13}, 5)  # 1.3x: above 1.25
    assert cleared == [] and len(watch.named) == 2
    _, cleared = steps(placements, live, watch, {}, 1)
    assert cleared == ["n1"] and watch.named == {}
    assert live["n1"].ranks[0].straggler_factor == 0


def test_a_rank_that_dips_under_the_factor_starts_its_count_again():
    placements, live = job()
    watch = StragglerWatch(POLICY)
    steps(placements, live, watch, {("n0", 0): 0.2}, 8)
    steps(placements, live, watch, {}, 1)
    named, _ = steps(placements, live, watch, {("n0", 0): 0.2}, 10)
    assert named == []
    named, _ = steps(placements, live, watch, {("n0", 0): 0.2}, 1)
    assert [s.node_id for s in named] == ["n0"]


def test_noise_around_the_median_names_nobody():
    placements, live = job(nodes=16, slots=8)
    watch = StragglerWatch(POLICY)
    rng = random.Random(5)
    for _ in range(300):  # every rank's window median jitters by up to 20%
        named, _ = steps(placements, live, watch, {(p.node_id, s): 0.1 * rng.uniform(0.85, 1.2)
                                                   for p in placements for s in p.slots}, 1)
        assert named == []


def test_fewer_than_two_measured_ranks_or_ranks_not_running_are_not_judged():
    placements, live = job(nodes=2, slots=1)
    watch = StragglerWatch(POLICY)
    live["n1"].ranks[0].state = "forming"
    named, _ = steps(placements, live, watch, {("n0", 0): 1.0}, 30)
    assert named == []
    live["n1"].ranks[0].state = "running"
    named, _ = steps(placements, live, watch, {("n0", 0): 1.0}, 11)
    assert [s.node_id for s in named] == ["n0"]  # of two ranks, the slower is judged against the faster


def test_a_reform_neither_clears_a_named_rank_nor_names_it_again():
    placements, live = job()
    watch = StragglerWatch(POLICY)
    named, _ = steps(placements, live, watch, {("n3", 0): 0.5}, 11)
    assert [s.node_id for s in named] == ["n3"]
    for node in live.values():  # every rank forming the next group: nothing measured
        for r in node.ranks.values():
            r.state = "forming"
    assert watch.assess(placements, live, 0.3) == ([], [])
    for node in live.values():
        for r in node.ranks.values():
            r.state = "running"
    named, cleared = steps(placements, live, watch, {("n3", 0): 0.5}, 30)
    assert named == [] and cleared == [] and ("n3", 0) in watch.named


def test_a_named_rank_that_leaves_the_map_is_cleared():
    placements, live = job()
    watch = StragglerWatch(POLICY)
    steps(placements, live, watch, {("n3", 0): 0.5}, 11)
    assert watch.named
    found, cleared = watch.assess(placements[:3], live, 0.3)
    assert found == [] and cleared == ["n3"] and watch.named == {}


@pytest.mark.parametrize("kwargs", [{"action": "evict"}, {"action": ""}, {"factor": 1.0}, {"factor": 101.0},
                                    {"factor": float("nan")}, {"min_steps": 0}, {"replace_window_s": 0}])
def test_a_bad_policy_is_refused(kwargs):
    with pytest.raises(ValueError):
        StragglerPolicy(**kwargs)


@pytest.mark.parametrize("flags,message", [
    (["--straggler-action", "evict"], "straggler_action must be one of off, report, replace, got 'evict'"),
    (["--straggler-factor", "0.9"], "straggler_factor must be in (1, 100], got 0.9"),
    (["--straggler-min-steps", "0"], "straggler_min_steps must be in 1..1000000, got 0"),
    (["--straggler-window", "soon"], "'soon' is no duration"),
])
def test_muster_serve_refuses_a_bad_straggler_policy_with_a_clear_message(flags, message, capsys):
    from muster.cli import parser
    from muster.cli.serve import command as _serve

    assert _serve(parser().parse_args(["serve", *flags])) == 2
    assert message in capsys.readouterr().err


def test_a_job_s_spec_sets_its_own_policy_over_the_deployment_s_and_is_kept_as_older_replicas_read_it():
    from muster.coordinator.core.policy import InvalidPolicy, JobSpec
    from muster.coordinator.core.state import decode_spec, encode_spec

    deployment = StragglerPolicy(action="report", factor=1.5, min_steps=20)
    own = JobSpec(2, 4, 1, straggler_action="replace", straggler_min_steps=50).validate()
    assert deployment.for_job(own) == StragglerPolicy(action="replace", factor=1.5, min_steps=50)
    assert deployment.for_job(JobSpec()) == deployment
    assert decode_spec(encode_spec(own, 3)) == (own, 3)
    assert b"straggler" not in encode_spec(JobSpec(2, 4, 1), 1)  # no policy of its own: as before
    for bad in ({"straggler_action": "evict"}, {"straggler_factor": 0.5}, {"straggler_factor": float("nan")},
                {"straggler_min_steps": -1}):
        with pytest.raises(InvalidPolicy, match=next(iter(bad))):
            JobSpec(**bad).validate()


def test_a_node_asking_another_straggler_policy_than_the_job_s_is_refused():
    from muster.coordinator.core.policy import JobSpec
    from muster.coordinator.core.state import JobState
    from muster.coordinator.errors import FailedPrecondition
    from muster.coordinator.job.frames import check_joinable

    state = JobState("j", JobSpec(1, 4, 1, straggler_action="replace"))
    check_joinable(state, JobSpec(0, 0, 0))  # asking nothing: the job's
    check_joinable(state, JobSpec(0, 0, 0, straggler_action="replace"))
    with pytest.raises(FailedPrecondition, match="straggler_action=replace; this node asks for report"):
        check_joinable(state, JobSpec(0, 0, 0, straggler_action="report"))


def test_muster_run_refuses_a_bad_straggler_policy_naming_the_field(capsys):
    from muster.cli import parser
    from muster.cli.run import command as _run  # not main(): it would point structlog at the captured stderr

    assert _run(parser().parse_args(["run", "--coordinator", "127.0.0.1:1", "--job", "j", "--straggler-factor",
                                     "0.5", "--", "python", "x.py"])) == 2
    assert "straggler_factor must be in (1, 100], got 0.5" in capsys.readouterr().err


def test_a_scripts_ranks_are_judged_and_a_restarted_process_counts_its_steps_anew():
    """Ranks of a script without the library (state `script`, measured by the step probe) are judged
    as library ranks are; a slot's new process counts its steps from 0 again, and its straggling
    is counted from its own steps, not from its predecessor's."""
    placements, live = job()
    for node in live.values():
        for r in node.ranks.values():
            r.state = "script"
    watch = StragglerWatch(POLICY)
    steps(placements, live, watch, {}, 20)
    steps(placements, live, watch, {("n3", 0): 0.2}, 2)  # straggling since its step 21
    live["n3"].ranks[0].step = 0  # restarted: its probe starts over
    named, _ = steps(placements, live, watch, {("n3", 0): 0.2}, 10)
    assert named == []
    named, _ = steps(placements, live, watch, {("n3", 0): 0.2}, 1)  # its 11th step straggling: named
    assert [(s.node_id, s.local_ranks) for s in named] == [("n3", (0,))]
    live["n3"].ranks[1].state = "restarting"  # between processes: not measured, and not named
    named, _ = steps(placements, live, watch, {("n3", 1): 0.5}, 20)
    assert named == [] and live["n3"].ranks[1].straggler_factor == 0


def test_the_lower_median_of_sorted_runs_is_the_sorted_unions():
    rng = random.Random(7)
    for _ in range(300):
        runs = [sorted(rng.choice([0.1, 0.2, 0.3]) if rng.random() < 0.3 else rng.uniform(1e-4, 2.0)
                       for _ in range(rng.randint(0, 9))) for _ in range(rng.randint(1, 6))]
        union = sorted(x for r in runs for x in r)
        if union:
            assert lower_median(runs) == union[(len(union) - 1) // 2]


def test_a_look_taken_a_node_at_a_time_finds_what_one_in_one_piece_does():
    """The leader takes a large map's look in slices between its frames: the same names, the same
    clears and factors, whatever the slice."""
    def run(slice_nodes):
        placements, live = job(nodes=9, slots=3)
        watch = StragglerWatch(POLICY)
        seen = []
        for n in range(40):
            for node_id, node in live.items():
                for slot, r in node.ranks.items():
                    r.step += 1
                    r.compute_s = 0.3 if (node_id, slot) in {("n4", 0), ("n4", 1), ("n4", 2)} and n < 25 \
                        else 0.25 if (node_id, slot) == ("n7", 2) else 0.1 + 0.001 * slot
            look, slices = Look(watch, placements, live), 0
            while (result := look.step(slice_nodes, 0.3)) is None:
                slices += 1
            seen.append((result, {k: r.straggler_factor for k, node in live.items() for k, r in
                                  ((f"{k}/{s}", r) for s, r in node.ranks.items())}))
        return seen, slices

    whole, _ = run(100)
    for slice_nodes in (1, 2, 4):
        sliced, slices = run(slice_nodes)
        assert sliced == whole and slices >= 9 // slice_nodes
    named = [s.node_id for (found, _), _ in whole for s in found]
    cleared = [n for (_, gone), _ in whole for n in gone]
    assert named == ["n4", "n7"] and cleared == ["n4"]
