"""The progress rule the chaos harness and the integration tests check a rank's log against."""

from muster.local import progress_gap


def steps(*numbers):
    return [{"event": "step", "step": n} for n in numbers]


def formed(step):
    return [{"event": "group_formed", "step": step}]


def test_steps_one_after_another_are_progress():
    assert progress_gap(steps(1, 2, 3)) is None
    assert progress_gap([]) is None


def test_a_reform_may_bring_a_rank_forward_to_a_step_a_peer_completed():
    # its own step 11 failed while a peer's completed: the sync adopts the peer's step 11
    assert progress_gap(steps(9, 10) + formed(11) + steps(12, 13)) is None


def test_a_planned_switch_forms_the_group_inside_the_steps_end():
    assert progress_gap(steps(9) + formed(10) + steps(10, 11)) is None


def test_a_step_missing_without_a_reform_is_a_gap():
    assert progress_gap(steps(9, 10, 12)) == "completed step 12 after step 10"
    assert progress_gap(steps(9, 10) + formed(10) + steps(12)) == "completed step 12 after step 10"


def test_a_step_done_twice_or_a_reform_going_back_is_a_gap():
    assert progress_gap(steps(9, 10, 10)) == "completed step 10 after step 10"
    assert progress_gap(steps(9, 10) + formed(8)) == "went back from step 10 to 8"


def test_a_record_sharing_its_line_with_another_threads_output_is_still_read(tmp_path):
    """A script prints its record and the newline in two writes: the library's console log line
    (its structlog unconfigured: stdout) landed before it, or between the two (a CI run lost step 105
    so, and the test took a survivor for one that skipped a step)."""
    from muster.local import json_lines

    log = tmp_path / "rank.log"
    log.write_text('{"event": "step", "step": 104}\n'
                   '2026-12-02 12:17:27 [info ] assignment_received generation=3{"event": "step", "step": 105}\n'
                   '{"event": "step", "step": 106}2026-12-02 12:17:28 [info ] group_formed\n'
                   '\n'
                   'note {"not": "a record"} and {broken\n'
                   '{"event": "step", "step": 107}\n')
    assert [r["step"] for r in json_lines(log, "step")] == [104, 105, 106, 107]
    assert len(json_lines(log)) == 4
