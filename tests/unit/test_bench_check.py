"""bench/check.py's verdicts on figures given here (no timing is measured)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import check  # noqa: E402


def run(calibration_ms=100.0, spread=0.05, wall_over_cpu=1.0, **figures):
    return {"calibration_cpu_ms": calibration_ms, "noise": {"cpu_spread": spread, "wall_over_cpu": wall_over_cpu},
            "figures": {name: {"median": v} for name, v in figures.items()}}


def verdicts(now, baseline):
    status, found = check.judge(now, baseline)
    return status, {v["figure"]: v["verdict"] for v in found}


def test_a_figure_within_its_tolerance_passes_and_one_past_it_fails():
    baseline = run(leader_change_ms=100.0, frame_latency_p99_ms=4.0)
    assert verdicts(run(leader_change_ms=110.0, frame_latency_p99_ms=9.0), baseline) == (
        0, {"leader_change_ms": "ok", "frame_latency_p99_ms": "ok"})
    # 100 * (1 + 0.20) + 5 ms slack = 125 allowed
    assert verdicts(run(leader_change_ms=125.0), baseline)[0] == 0
    assert verdicts(run(leader_change_ms=126.0), baseline) == (1, {"leader_change_ms": "worse"})


def test_cpu_figures_are_scaled_by_the_machines_speed_and_latencies_are_not():
    baseline = run(leader_change_ms=100.0, frame_latency_p99_ms=4.0)
    slower_host = run(calibration_ms=150.0, leader_change_ms=150.0, frame_latency_p99_ms=20.0)
    assert verdicts(slower_host, baseline) == (1, {"leader_change_ms": "ok", "frame_latency_p99_ms": "worse"})


def test_a_figure_past_its_tolerance_on_a_noisy_machine_is_inconclusive():
    baseline = run(leader_change_ms=100.0)
    assert verdicts(run(wall_over_cpu=2.0, leader_change_ms=200.0), baseline) == (
        2, {"leader_change_ms": "inconclusive"})
    assert verdicts(run(spread=0.4, leader_change_ms=200.0), baseline)[0] == 2
    # a figure within its tolerance passes however noisy the machine
    assert verdicts(run(spread=0.4, wall_over_cpu=3.0, leader_change_ms=100.0), baseline)[0] == 0


def test_a_figure_not_measured_is_not_judged_and_one_the_baseline_lacks_is_held_to_its_bound_alone():
    """The committed baseline predates reform_excess_s: its bound (the target) is judged all the same.
    Before, a figure missing from the baseline was dropped, and the reform's bound with it."""
    assert verdicts(run(leader_change_ms=100.0), run(tick_ms=0.01)) == (0, {"leader_change_ms": "no baseline"})
    assert verdicts(run(), run(tick_ms=0.01)) == (0, {})
    assert verdicts(run(reform_excess_s=0.12), run()) == (0, {"reform_excess_s": "no baseline"})
    assert verdicts(run(reform_excess_s=0.28), run()) == (1, {"reform_excess_s": "worse"})


def test_a_latency_past_its_absolute_bound_is_worse_however_noisy_the_host_or_slow_the_baseline():
    slow_baseline = run(frame_latency_p99_ms=9.0)  # allowed by it alone: 9 * 2 + 5 = 23 ms
    assert verdicts(run(frame_latency_p99_ms=12.0), slow_baseline) == (1, {"frame_latency_p99_ms": "worse"})
    assert verdicts(run(wall_over_cpu=3.0, spread=0.5, frame_latency_p99_ms=12.0), slow_baseline) == (
        1, {"frame_latency_p99_ms": "worse"})
    assert verdicts(run(frame_latency_p50_ms=5.5), run(frame_latency_p50_ms=4.0)) == (
        1, {"frame_latency_p50_ms": "worse"})
    # within the bound, the baseline's tolerance: a noisy host's figure past it is inconclusive
    fast_baseline = run(frame_latency_p99_ms=1.0)  # allowed: 1 * 2 + 5 = 7 ms
    assert verdicts(run(frame_latency_p99_ms=8.0), fast_baseline) == (1, {"frame_latency_p99_ms": "worse"})
    assert verdicts(run(wall_over_cpu=2.0, frame_latency_p99_ms=8.0), fast_baseline) == (
        2, {"frame_latency_p99_ms": "inconclusive"})
    assert verdicts(run(wall_over_cpu=2.0, frame_latency_p99_ms=6.9), fast_baseline)[0] == 0


def test_cpu_figures_have_no_absolute_bound():
    """A CPU figure is judged against the baseline only (scaled): the bound is a latency's promise."""
    assert all(f.bound is None for f in check.FIGURES if f.cpu)
    assert {f.name: f.bound for f in check.FIGURES if not f.cpu} == {
        "frame_latency_p50_ms": 5.0, "frame_latency_p99_ms": 10.0, "reform_excess_s": 0.15}


def test_the_sized_reforms_excess_over_the_tiny_one_is_held_to_the_target():
    """reform_excess_s (50M kill -> stepping less 1.5x tiny's): 0.1 s over the baseline's, never past 0.15 s."""
    baseline = run(reform_excess_s=-0.05)
    assert verdicts(run(reform_excess_s=0.04), baseline)[0] == 0
    assert verdicts(run(reform_excess_s=0.06), baseline) == (1, {"reform_excess_s": "worse"})
    assert verdicts(run(wall_over_cpu=2.0, reform_excess_s=0.06), baseline)[0] == 2
    assert verdicts(run(wall_over_cpu=2.0, reform_excess_s=0.2), run(reform_excess_s=0.12)) == (
        1, {"reform_excess_s": "worse"})


def test_a_network_point_that_could_not_run_fails_every_network_figure_and_the_rest_is_still_judged():
    """1,000 nodes not all streaming in time (their Joins timing out on a slow host): the leader kept up
    with none of it, so each network figure is `unmeasured`, a failure with the point's error; the
    in-process figures keep their own verdicts."""
    baseline = run(leader_change_ms=100.0, frame_latency_p99_ms=4.0, leader_loop_us_per_node_frame=30.0)
    now = {**run(leader_change_ms=100.0), "network_errors": ["1000 nodes not all stepping within 40.0s"]}
    status, found = check.judge(now, baseline)
    assert status == 1
    assert {v["figure"]: v["verdict"] for v in found} == {
        "leader_change_ms": "ok", "frame_latency_p99_ms": "unmeasured", "leader_loop_us_per_node_frame": "unmeasured"}
    assert all(v["error"] == "1000 nodes not all stepping within 40.0s" for v in found if v["verdict"] == "unmeasured")
