"""What a leader keeps of a job for the page: the job over time in a bounded ring, and each
recovery's timeline with its slowest phase."""

import pytest

from muster.coordinator.core.liveness import Liveness
from muster.coordinator.job.leader_stats import HISTORY_SAMPLES, LeaderStats, timeline
from muster.coordinator.metrics import Metrics
from muster.v1 import muster_pb2 as pb

from test_liveness import TIMING, job, report


@pytest.mark.timeout(60)
def test_the_history_keeps_the_whole_life_in_a_bounded_ring():
    state, live = job(), Liveness(TIMING, now=0)
    stats = LeaderStats("job", Metrics(), now=0)
    for second in range(20_000):  # five and a half hours, a tally a second
        live.observe("n0", 1, report(second + 1), second)
        stats.measure(second, live.assess(state, second))
    assert HISTORY_SAMPLES // 2 <= len(stats.history) <= HISTORY_SAMPLES  # never more, whatever the age
    assert stats._sample_every == 128  # the spacing doubled as the ring filled (1 s at first)
    # (the first sample came before any step was timed; then 50 ms steps)
    assert {(s.world_size, s.steps_per_second) for s in stats.history[1:]} == {(2, 20.0)}


def test_a_timeline_names_its_slowest_phase_and_the_first_step_is_what_the_rest_leave():
    def record():
        return pb.RecoveryRecord(detection_s=0.1, delivered_s=0.05, abort_s=0.02, form_s=0.3, sync_s=0.1)

    slow_start = timeline(record(), 1.0, 4 << 20)
    assert (slow_start.first_step_s, slow_start.slowest, slow_start.bytes_moved) == (0.53, "first_step", 4 << 20)
    quick = timeline(record(), 0.4, 0)  # the ranks' phases are their own clocks': never a negative rest
    assert (quick.recovery_s, quick.first_step_s, quick.slowest) == (0.4, 0.0, "formed")


def frame(generation, *reforms):
    """A node's frame whose ranks report these reforms."""
    return pb.NodeFrame(generation=generation, ranks=[pb.RankReport(local_rank=i, reform=r) for i, r in enumerate(reforms)])


def test_a_recovery_says_the_deepest_tier_its_ranks_restored_from_and_the_steps_the_job_lost():
    from muster.coordinator.core.machine import Context, NodeLost, decide
    from muster.coordinator.core.kinds import FailureKind

    from test_liveness import TIMING

    stats = LeaderStats("job", Metrics(), now=0)
    state = job(3)
    stats.adopted(decide(state, [], Context(now=1, wall_ms=1000, term=1, timing=TIMING)), 1, 40)  # no new map: counted
    d = decide(state, [NodeLost("n2", FailureKind.PROCESS_EXITED, "killed")], Context(now=2, wall_ms=2000, term=1,
                                                                                       timing=TIMING))
    assert d.new_generation
    stats.adopted(d, 2, 41)  # the job had reached step 41
    g = d.state.generation
    m = stats._measuring.record
    stats.reported("n0", frame(g, pb.ReformPhases(generation=g, tier="replica", step=36, steps_lost=5)), 3)
    assert (m.tier, m.step, m.steps_lost) == ("replica", 36, 5)
    # a rank that came back from the checkpoint is the deeper tier; an unknown word and an older generation's are not
    stats.reported("n1", frame(g, pb.ReformPhases(generation=g, tier="checkpoint", step=36),
                               pb.ReformPhases(generation=g, tier="tape", step=99),
                               pb.ReformPhases(generation=g - 1, tier="none", step=0)), 3)
    assert (m.tier, m.step, m.steps_lost) == ("checkpoint", 36, 5)


def test_every_rank_lost_counts_the_steps_from_the_jobs_highest_step_not_the_new_ranks_own():
    from muster.coordinator.core.machine import Context, NodeLost, decide
    from muster.coordinator.core.kinds import FailureKind

    from test_liveness import TIMING

    stats = LeaderStats("job", Metrics(), now=0)
    state = job(2)
    stats.adopted(decide(state, [], Context(now=1, wall_ms=1000, term=1, timing=TIMING)), 1, 29)
    d = decide(state, [NodeLost("n1", FailureKind.PROCESS_EXITED, "killed")], Context(now=2, wall_ms=2000, term=1,
                                                                                       timing=TIMING))
    stats.adopted(d, 2, 0)  # the map's ranks now report nothing: the new processes' steps
    g = d.state.generation
    stats.reported("n0", frame(g, pb.ReformPhases(generation=g, tier="checkpoint", step=24, steps_lost=0)), 3)
    m = stats._measuring.record
    assert (m.tier, m.step, m.steps_lost) == ("checkpoint", 24, 5)


def test_a_state_begun_again_at_step_0_is_the_tier_none_with_every_step_lost():
    from muster.coordinator.core.kinds import FailureKind
    from muster.coordinator.core.machine import (STATE_LOST, STATE_LOST_EVENT, Context, Join, NodeLost, SlotDown, Tick,
                                                 Verdict, decide)
    from muster.coordinator.core.policy import JobSpec
    from muster.coordinator.core.state import JobState

    from test_liveness import TIMING

    c = lambda now: Context(now=now, wall_ms=int(now * 1000), term=1, timing=TIMING)  # noqa: E731
    state = decide(JobState("job", JobSpec(1, 3, 1, on_state_lost="restart")),
                   [Join(f"n{i}", "h", 1, 1) for i in range(3)], c(0)).state
    state = decide(state, [Tick()], c(2)).state
    stats = LeaderStats("job", Metrics(), now=0)
    d = decide(state, [SlotDown("n2", 0, "rank_exited", "ShardLost"), Verdict("n2", "ShardLost", STATE_LOST)], c(3))
    assert [e.kind for e in d.events if e.kind == STATE_LOST_EVENT]
    stats.adopted(d, 3, 57)
    if not d.new_generation:  # (the map the restarted ranks form comes with the next decision)
        d = decide(d.state, [NodeLost("n1", FailureKind.PROCESS_EXITED, "gone")], c(4))
        stats.adopted(d, 4, 0)
    g = d.state.generation
    began = frame(g, pb.ReformPhases(generation=g, tier="", step=0, begun_at=g))  # nothing restored
    assert stats.reported("n0", began, 5) == 0  # (the state-lost verdict said it: not a second loss)
    m = stats._measuring.record
    assert (m.generation, m.tier, m.step, m.steps_lost) == (g, "none", 0, 57)


def test_a_recovery_the_next_map_cuts_short_is_kept_superseded_and_its_late_phases_still_count():
    """A killed rank's replacement can be back before the survivors' re-form is over: the new map
    supersedes that recovery, which `events` still shows, to the next decision, without a first step."""
    from muster.coordinator.core.kinds import FailureKind
    from muster.coordinator.core.machine import Context, Join, NodeLost, Tick, decide

    from test_liveness import TIMING

    c = lambda now: Context(now=now, wall_ms=int(now * 1000), term=1, timing=TIMING)  # noqa: E731
    stats = LeaderStats("job", Metrics(), now=0)
    stats.signalled(1.9)
    lost = decide(job(3), [NodeLost("n2", FailureKind.PROCESS_EXITED, "killed")], c(2))
    stats.adopted(lost, 2, 40)
    g = lost.state.generation
    stats.reported("n0", frame(g, pb.ReformPhases(generation=g, abort_s=0.01, form_s=0.2, tier="replica", step=40)), 2.3)
    back = decide(lost.state, [Join("n2", "h", 1, 1)], c(2.5))
    if not back.new_generation:
        back = decide(back.state, [Tick()], c(2.5))
    assert back.new_generation
    stats.adopted(back, 2.5, 40)
    (cut,) = stats.recoveries
    assert (cut.generation, cut.superseded_by, cut.recovery_s, cut.first_step_s) == (g, back.state.generation, 0.5, 0.0)
    assert (cut.detection_s, cut.form_s, cut.slowest, cut.tier) == (0.1, 0.2, "formed", "replica")
    # the other survivor's phases of the cut-short generation come with its next frame: they still count
    stats.reported("n1", frame(g, pb.ReformPhases(generation=g, abort_s=0.02, form_s=0.35)), 2.6)
    assert (cut.abort_s, cut.form_s, cut.slowest) == (0.02, 0.35, "formed")
    assert stats._measuring.record.generation == back.state.generation and not stats._measuring.record.superseded_by


def test_ranks_begun_again_at_step_0_with_nothing_restored_after_the_job_trained_are_said_lost_once():
    """A replicated job whose every rank was lost (no checkpoint): the restarted ranks form at step 0,
    restoring nothing. Only the leader knows the job had trained: `reported` says so once (the frame
    reader makes it the state-lost verdict), the recovery shows tier none with every step lost, and
    the job's steps count from 0 again. A first formation at step 0 is no loss."""
    from muster.coordinator.core.kinds import FailureKind
    from muster.coordinator.core.machine import Context, NodeLost, decide

    from test_liveness import TIMING

    stats = LeaderStats("job", Metrics(), now=0)
    state = job(3)
    first = decide(state, [NodeLost("n2", FailureKind.PROCESS_EXITED, "killed")], Context(now=1, wall_ms=1000, term=1,
                                                                                           timing=TIMING))
    stats.adopted(first, 1, 0)  # (decided before any step: as a first formation)
    g = first.state.generation
    assert stats.reported("n0", frame(g, pb.ReformPhases(generation=g, begun_at=g)), 1.5) == 0
    assert stats._measuring.record.tier == ""
    again = decide(first.state, [NodeLost("n1", FailureKind.PROCESS_EXITED, "killed")],
                   Context(now=2, wall_ms=2000, term=1, timing=TIMING))
    stats.adopted(again, 2, 41)  # the job had reached step 41
    g = again.state.generation
    began = frame(g, pb.ReformPhases(generation=g, begun_at=g))
    assert stats.reported("n0", frame(g, pb.ReformPhases(generation=g)), 3) == 0  # (an older rank's word says neither)
    assert stats.reported("n0", began, 3) == 41
    assert stats.reported("n1", began, 3) == 0  # said once
    m = stats._measuring.record
    assert (m.tier, m.step, m.steps_lost) == ("none", 0, 41) and stats.high_step == 0


def test_a_lone_restarted_ranks_word_after_the_next_map_superseded_its_generation_is_still_said_lost():
    """Every rank killed: the first restarted rank forms alone at step 0 and the others, restarted a
    moment later, join it at the next map; under load its report of the first generation's reform
    came after that map (a CI run: the job retrained and ended "succeeded"). The superseded
    generation's word is the verdict's as much as the current one's."""
    from muster.coordinator.core.kinds import FailureKind
    from muster.coordinator.core.machine import Context, NodeLost, decide

    from test_liveness import TIMING

    stats = LeaderStats("job", Metrics(), now=0)
    lone = decide(job(3), [NodeLost("n2", FailureKind.PROCESS_EXITED, "killed"),
                           NodeLost("n1", FailureKind.PROCESS_EXITED, "killed")],
                  Context(now=1, wall_ms=1000, term=1, timing=TIMING))
    stats.adopted(lone, 1, 41)  # the job had reached step 41
    g = lone.state.generation
    nxt = decide(lone.state, [NodeLost("n0", FailureKind.PROCESS_EXITED, "killed")],
                 Context(now=1.2, wall_ms=1200, term=1, timing=TIMING))
    stats.adopted(nxt, 1.2, 0)
    (cut,) = stats.recoveries
    assert cut.superseded_by == nxt.state.generation
    began = frame(g, pb.ReformPhases(generation=g, begun_at=g))
    assert stats.reported("n0", began, 1.5) == 41
    assert stats.reported("n0", began, 1.6) == 0  # said once
    assert (cut.tier, cut.steps_lost) == ("none", 41) and stats.high_step == 0


def test_a_state_begun_from_nothing_is_judged_from_any_later_reform_however_many_maps_came_between():
    """CI: every rank killed; the first restarted rank formed alone at step 0 and trained, two more maps
    placed the others beside it within 0.2 s, and its agent's frames carried only its newest reform (a
    source at step 5): the word of the first was never heard, and the job retrained and 'succeeded'. The
    rank says the generation its state began from nothing in with every reform while the state is its
    own, and the leader judges it against the job's step when that generation was decided, once."""
    from muster.coordinator.core.kinds import FailureKind
    from muster.coordinator.core.machine import Context, NodeLost, decide

    from test_liveness import TIMING

    c = lambda now: Context(now=now, wall_ms=int(now * 1000), term=1, timing=TIMING)  # noqa: E731
    stats = LeaderStats("job", Metrics(), now=0)
    first = decide(job(3), [NodeLost("n2", FailureKind.PROCESS_EXITED, "killed")], c(1))
    stats.adopted(first, 1, 0)  # decided before any step: a first formation
    assert stats.reported("n0", frame(first.state.generation, pb.ReformPhases(
        generation=first.state.generation, begun_at=first.state.generation)), 1.1) == 0
    lone = decide(first.state, [NodeLost("n1", FailureKind.PROCESS_EXITED, "killed")], c(2))
    stats.adopted(lone, 2, 41)  # the job had reached step 41
    g = lone.state.generation
    state, now = lone.state, 2.0
    for later in range(2):  # two more maps before the lone rank's agent frames
        now += 0.1
        d = decide(state, [NodeLost(f"n{later}", FailureKind.PROCESS_EXITED, "killed")], c(now))
        stats.adopted(d, now, 5)
        state = d.state
    newest = frame(state.generation, pb.ReformPhases(generation=state.generation, tier="replica", step=5, begun_at=g))
    assert stats.reported("n0", newest, now + 0.1) == 41
    assert stats.reported("n0", newest, now + 0.2) == 0  # said once
    (cut,) = [r for r in stats.recoveries if r.generation == g]
    assert (cut.tier, cut.step, cut.steps_lost) == ("none", 0, 41) and stats.high_step == 0
    # a state begun from nothing in a generation decided before that word is the same loss's
    assert stats.reported("n1", frame(state.generation, pb.ReformPhases(
        generation=state.generation, begun_at=state.generation)), now + 0.3) == 0


def test_the_step_a_job_reached_between_two_decisions_is_what_a_state_lost_then_cost():
    """Every rank of a job killed at step 10, with no decision since its first formation at step 0:
    at the next decision their agents already report the restarted ranks at step 0 (a CI run: no
    verdict, the job retrained and ended "succeeded"). The step the job reached is kept from its
    frames, so the restarted ranks' word is judged against 10."""
    from muster.coordinator.core.kinds import FailureKind
    from muster.coordinator.core.machine import Context, NodeLost, decide

    from test_liveness import TIMING

    stats = LeaderStats("job", Metrics(), now=0)
    formed = decide(job(3), [NodeLost("n2", FailureKind.PROCESS_EXITED, "killed")],
                    Context(now=1, wall_ms=1000, term=1, timing=TIMING))
    stats.adopted(formed, 1, 0)
    for step in range(1, 11):
        stats.stepped(step)  # the frames of its training
    lost = decide(formed.state, [NodeLost("n1", FailureKind.PROCESS_EXITED, "killed")],
                  Context(now=2, wall_ms=2000, term=1, timing=TIMING))
    stats.adopted(lost, 2, 0)  # every rank restarted: step 0 as reported now
    g = lost.state.generation
    assert stats.reported("n0", frame(g, pb.ReformPhases(generation=g, begun_at=g)), 3) == 10
    assert stats.high_step == 0
