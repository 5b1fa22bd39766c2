"""Rebuilding a job whose state etcd lost, from the nodes that reconnect (the Rejoin event); the
session secret's hash kept per member; the planned switch step bounded."""

from dataclasses import replace

import pytest

from muster.coordinator.core.machine import MAX_CLAIMED, Context, Join, Leave, NodeLost, Rejoin, Tick, decide
from muster.coordinator.core.policy import MAX_GENERATION, MAX_STEP, JobSpec, Timing
from muster.coordinator.core.state import JobState, NodeKind, Phase, decode, encode
from muster.coordinator.errors import FailedPrecondition, InvalidArgument, NotFound, \
    PermissionDenied, ResourceExhausted, Unavailable

TIMING = Timing(last_call_s=1.0, switch_lead_s=0.5, grace_s=5.0)


def ctx(now=0.0, max_step=0, step_time_s=None, max_members=100):
    return Context(now=now, wall_ms=1_700_000_000_000 + int(now * 1000), term=9, timing=TIMING,
                   max_step=max_step, step_time_s=step_time_s, max_members=max_members)


def rejoin(i, member_id, generation, secret="s", slots=2, spec=None):
    return Rejoin(f"n{i}", member_id, generation, f"hash-{secret}-{i}", f"10.0.0.{i}", 29500 + i, slots,
                  NodeKind.AGENT, spec=spec)


def lost(spec=JobSpec(2, 3, 1), spec_lost=False):
    """What a leader starts from when etcd has no state of the job."""
    return JobState("job", spec, rebuilding=True, spec_lost=spec_lost)


def tickets(*events):
    """The events as requests under tickets 1, 2, ... (as the leader's inbox numbers them)."""
    return [replace(e, ticket=i) for i, e in enumerate(events, 1)]


def rejected(d, ticket=0):
    return d.rejected[ticket]


def test_nodes_are_taken_back_as_they_were_and_one_abort_generation_above_theirs_reforms_them_after_the_grace():
    d = decide(lost(), [rejoin(2, member_id=5, generation=7), rejoin(1, member_id=3, generation=6)], ctx(now=0.0))
    assert d.persist and not d.new_generation and not d.events
    s = d.state
    assert [(m.node_id, m.member_id, m.seq, m.secret_hash) for m in s.members] == \
        [("n2", 5, 1, "hash-s-2"), ("n1", 3, 6, "hash-s-1")], "aged by when they claimed"
    assert (s.generation, s.next_seq, s.rank_map, s.rebuilding) == (7, 7, None, True)
    assert [m.node_id for m in d.joined] == ["n2", "n1"]

    d = decide(s, [Tick()], ctx(now=4.9))  # the nodes run on in their old groups until the grace ends
    assert not d.new_generation and not d.persist and d.state.rank_map is None

    d = decide(d.state, [Tick()], ctx(now=5.0))
    assert d.new_generation and d.persist and not d.state.rebuilding
    rm = d.state.rank_map
    assert (rm.generation, rm.abort_previous, rm.switch_at_step, rm.world_size) == (8, True, 0, 4)
    assert rm.node_ids == ("n2", "n1"), "the first node taken back gets rank 0, whatever member_id it claims"
    assert d.state.phase is Phase.RUNNING
    assert [e.kind for e in d.events] == ["state_rebuilt", "generation"]
    rebuilt = d.events[0]
    assert "rebuilt from the 2 node(s)" in rebuilt.reason and "lost in etcd" in rebuilt.reason
    assert rebuilt.nodes == ("n2", "n1") and all(e.generation == 8 and e.term == 9 for e in d.events)
    assert decode(encode(d.state)) == d.state


def test_a_rebuild_below_min_nodes_publishes_a_waiting_generation():
    s = decide(lost(JobSpec(3, 3, 1)), [rejoin(1, 1, 4), rejoin(2, 2, 4)], ctx()).state
    d = decide(s, [Tick()], ctx(now=5.0))
    assert d.new_generation and d.state.phase is Phase.WAITING and d.state.generation == 5
    assert d.state.rank_map.abort_previous and d.state.rank_map.world_size == 0
    assert [e.kind for e in d.events] == ["state_rebuilt", "waiting"]


def test_outside_a_rebuild_a_node_that_is_no_member_is_refused_and_nothing_changes():
    state = decide(JobState("job", JobSpec(1, 3, 1)), [Join("n1", "10.0.0.1", 29501, 2, secret_hash="h")],
                   ctx()).state
    state = decide(state, [Tick()], ctx(now=2.0)).state
    d = decide(state, [rejoin(2, 1, 3)], ctx(now=3.0))
    assert isinstance(rejected(d), NotFound) and "not a member" in str(rejected(d))
    assert d.state.members == state.members and not d.persist and d.state.generation == state.generation


@pytest.mark.parametrize("member_id, generation", [(0, 3), (4, 0)])
def test_a_claim_without_a_member_id_or_a_generation_is_refused(member_id, generation):
    d = decide(lost(), [rejoin(1, member_id, generation)], ctx())
    assert isinstance(rejected(d), NotFound) and not d.state.members and not d.persist


def test_claims_beyond_any_real_run_and_past_the_member_limit_are_refused():
    d = decide(lost(), tickets(rejoin(1, 1, MAX_GENERATION + 1), rejoin(2, MAX_GENERATION + 1, 1),
                               rejoin(3, 1, MAX_CLAIMED + 1), rejoin(4, MAX_CLAIMED + 1, 1)), ctx())
    assert all(isinstance(e, InvalidArgument) for e in d.rejected.values()) and sorted(d.rejected) == [1, 2, 3, 4]
    assert f"below {MAX_CLAIMED}" in str(rejected(d, 1)) and not d.state.members
    d = decide(lost(), tickets(rejoin(1, 1, MAX_CLAIMED), rejoin(2, MAX_CLAIMED, 1)), ctx())  # 2^32 itself: refused
    assert {t: type(e) for t, e in d.rejected.items()} == {1: InvalidArgument, 2: InvalidArgument}
    assert not d.state.members
    d = decide(lost(), tickets(rejoin(1, 1, 2), rejoin(2, 2, 2)), ctx(max_members=1))
    assert list(d.rejected) == [2] and isinstance(rejected(d, 2), ResourceExhausted)
    assert [m.node_id for m in d.state.members] == ["n1"]


def test_the_same_member_from_a_second_stream_is_taken_back_once_and_a_stranger_is_refused():
    d = decide(lost(), [rejoin(1, 3, 5), rejoin(1, 3, 5)], ctx())
    assert not d.rejected and len(d.state.members) == 1 and len(d.joined) == 1
    d = decide(d.state, tickets(rejoin(1, 3, 5, secret="forged"), rejoin(1, 4, 5)), ctx(now=1.0))
    assert isinstance(rejected(d, 1), PermissionDenied) and isinstance(rejected(d, 2), FailedPrecondition)
    assert d.state.members[0].secret_hash == "hash-s-1" and not d.persist


def test_a_lost_spec_is_restored_from_the_first_node_taken_back():
    default = JobSpec(1, 100_000, 1)
    d = decide(lost(default, spec_lost=True), [rejoin(1, 1, 2, spec=JobSpec(2, 2, 0)),
                                              rejoin(2, 2, 2, spec=JobSpec(1, 8, 1))], ctx())
    assert d.state.spec == JobSpec(2, 2, 1) and not d.state.spec_lost
    d = decide(lost(default, spec_lost=True), [rejoin(1, 1, 2, spec=JobSpec(3, 2, 1))], ctx())
    assert isinstance(rejected(d), InvalidArgument) and "max_nodes" in str(rejected(d))
    assert d.state.spec_lost and not d.state.members


def test_a_join_while_rebuilding_gets_a_member_id_above_every_claimed_one_and_may_restore_the_spec():
    s = decide(lost(JobSpec(1, 100_000, 1), spec_lost=True), [rejoin(1, 9, 3, spec=JobSpec(1, 2, 0))], ctx()).state
    d = decide(s, [Join("n7", "10.0.0.7", 29507, 1, secret_hash="h7", spec=JobSpec(1, 4, 0))], ctx(now=1.0))
    assert d.state.member("n7").member_id == 10 and d.state.member("n7").secret_hash == "h7"
    assert d.state.spec == JobSpec(1, 2, 1), "the first node taken back restored it already"
    d = decide(d.state, [Tick()], ctx(now=5.0))
    assert d.state.rank_map.node_ids == ("n1", "n7") and d.state.generation == 4
    d = decide(lost(JobSpec(1, 100_000, 1), spec_lost=True),
               [Join("n7", "10.0.0.7", 29507, 1, spec=JobSpec(1, 1, 0))], ctx())
    assert isinstance(rejected(d), Unavailable) and "being rebuilt" in str(rejected(d)), "no Join restores it"
    assert d.state.spec_lost and not d.state.members and not d.new_generation
    d = decide(d.state, [Tick()], ctx(now=5.0))  # nobody claimed it in the grace: a Join restores it
    d = decide(d.state, [Join("n7", "10.0.0.7", 29507, 1, spec=JobSpec(2, 4, 0))], ctx(now=5.1))
    assert d.state.spec == JobSpec(2, 4, 1) and not d.state.spec_lost


def test_members_lost_or_leaving_during_a_rebuild_are_not_rebuilt():
    s = decide(lost(JobSpec(1, 3, 1)), [rejoin(1, 1, 2), rejoin(2, 2, 2), rejoin(3, 3, 2)], ctx()).state
    d = decide(s, [NodeLost("n2", "node_silent", "no frame"), Leave("n3", immediate=False, reason="drain")],
               ctx(now=1.0))
    assert d.evicted == (("n2", 2),) and not d.new_generation
    d = decide(d.state, [Tick()], ctx(now=5.0))
    assert d.state.rank_map.node_ids == ("n1",) and "from the 1 node(s)" in d.events[0].reason


def test_a_new_job_nobody_claims_forms_as_usual_and_is_no_longer_rebuilt():
    d = decide(lost(JobSpec(1, 2, 1)), [Join("n1", "10.0.0.1", 29501, 1), Join("n2", "10.0.0.2", 29502, 1)], ctx())
    assert d.new_generation and [e.kind for e in d.events] == ["node_joined", "node_joined", "formed"]
    assert not d.state.rebuilding and d.state.generation == 1
    d = decide(d.state, [rejoin(3, 1, 1)], ctx(now=0.1))
    assert isinstance(rejected(d), NotFound)


def test_a_rebuild_nobody_claims_ends_with_the_grace_and_writes_nothing():
    d = decide(lost(), [Tick()], ctx(now=0.0))
    assert d.state.rebuilding and not d.persist
    d = decide(d.state, [Tick()], ctx(now=5.0))
    assert not d.state.rebuilding and not d.persist and not d.new_generation
    assert isinstance(rejected(decide(d.state, [rejoin(1, 1, 1)], ctx(now=5.1))), NotFound)


def test_a_state_written_mid_rebuild_is_rebuilt_on_by_the_next_leader():
    s = decide(lost(), [rejoin(1, 1, 3)], ctx(now=0.0)).state
    loaded = decode(encode(s))
    assert loaded.rebuilding and loaded.rebuild_deadline is None and loaded.members == s.members
    d = decide(loaded, [rejoin(2, 2, 4)], ctx(now=100.0))  # a new leader's clock: a new grace
    assert not d.new_generation and d.state.rebuild_deadline == 105.0
    assert decide(d.state, [Tick()], ctx(now=105.0)).state.generation == 5


def test_old_states_read_without_secrets_and_admit_any_secret():
    s = decide(JobState("job", JobSpec(1, 3, 1)), [Join("n1", "10.0.0.1", 29501, 2, secret_hash="ab")], ctx()).state
    assert decode(encode(s)).members[0].secret_hash == "ab"
    old = encode(s).replace(b',"secret_hash":"ab"', b"").replace(b',"rebuilding":false', b"")
    assert b"secret_hash" not in old and b"rebuilding" not in old
    member = decode(old).members[0]
    assert member.secret_hash == "" and member.admits("anything") and not decode(old).rebuilding
    assert s.members[0].admits("ab") and not s.members[0].admits("ac") and not s.members[0].admits("")


def test_the_planned_switch_step_stays_below_max_step():
    state = decide(JobState("job", JobSpec(1, 3, 1)), [Join("n1", "10.0.0.1", 29501, 1)], ctx()).state
    state = decide(state, [Tick()], ctx(now=2.0)).state
    d = decide(state, [Join("n2", "10.0.0.2", 29502, 1)], ctx(now=3.0, max_step=MAX_STEP, step_time_s=1e-9))
    assert d.new_generation and d.state.rank_map.switch_at_step == MAX_STEP


def test_a_forged_claim_takes_neither_rank_0_nor_the_job_past_its_generations():
    """Security review 3, F4: a claim of member 1 and generation 2^48 after a real node's claim."""
    d = decide(lost(), [rejoin(5, member_id=5, generation=7)], ctx(now=0.0))
    evil = Rejoin("evil", 1, 2**48, "hash-evil", "10.6.6.6", 29500, 2, NodeKind.AGENT)
    d = decide(d.state, [evil], ctx(now=0.5))
    assert isinstance(rejected(d), InvalidArgument) and d.state.member("evil") is None
    d = decide(d.state, [Rejoin("evil", 1, 8, "hash-evil", "10.6.6.6", 29500, 2, NodeKind.AGENT)], ctx(now=1.0))
    assert not d.rejected and d.state.generation == 8
    d = decide(d.state, [Tick()], ctx(now=5.0))
    rm = d.state.rank_map
    assert rm.generation == 9 and rm.node_ids == ("n5", "evil"), "rank 0 stays with the node taken back first"
    assert rm.store_address == "10.0.0.5:29505"


def test_a_member_id_taken_back_already_is_refused_to_another_node_which_joins_again_rather_than_exits():
    d = decide(lost(), tickets(rejoin(1, member_id=4, generation=3), rejoin(2, member_id=4, generation=3)), ctx())
    assert list(d.rejected) == [2] and isinstance(rejected(d, 2), FailedPrecondition)
    assert "node 'n1'" in str(rejected(d, 2))
    assert [m.node_id for m in d.state.members] == ["n1"]
    d = decide(d.state, [rejoin(3, member_id=4, generation=3)], ctx(now=1.0))  # in a later tally too
    assert isinstance(rejected(d), FailedPrecondition) and not d.persist


STARTED_MS = 1_600_000_000_000  # the run the proven nodes ran, long before the leader's clock


def proven(i, member_id, generation, slots=2, started_ms=STARTED_MS):
    return replace(rejoin(i, member_id, generation, slots=slots), run_started_ms=started_ms)


def test_proven_claims_keep_their_age_and_displace_whoever_took_their_node_or_member_id_unproven():
    """Security review 4, N1: what reached the leader first (an unproven claim of member 1, a Join
    under a real node's id) neither keeps the ids nor takes rank 0 and the store from the real nodes."""
    forged = Rejoin("evil", 1, 9, "hash-evil", "10.6.6.6", 29500, 4, NodeKind.AGENT)
    squat = Join("n2", "10.6.6.7", 29500, 4, secret_hash="hash-squat")
    d = decide(lost(), [forged, squat], ctx(now=0.0))
    assert {m.node_id for m in d.state.members} == {"evil", "n2"}
    d = decide(d.state, [proven(2, member_id=2, generation=7), proven(1, member_id=1, generation=7)], ctx(now=1.0))
    assert not d.rejected and sorted(d.evicted) == [("evil", 1), ("n2", 2)]
    assert [e.kind for e in d.events] == ["member_displaced", "member_displaced"]
    members = {m.node_id: m for m in d.state.members}
    assert set(members) == {"n1", "n2"} and members["n2"].secret_hash == "hash-s-2"
    assert [(members[n].member_id, members[n].seq, members[n].proven) for n in ("n1", "n2")] == [(1, 1, True),
                                                                                                  (2, 2, True)]
    assert d.state.generation == 9, "the unproven claim raised it before it was displaced"
    again = decode(encode(d.state))  # a leader taking over mid-rebuild keeps who proved what
    assert again.members == d.state.members
    d = decide(again, [Join("n9", "10.6.6.9", 29500, 4, secret_hash="h9")], ctx(now=2.0))
    d = decide(d.state, [Tick()], ctx(now=7.0))  # the grace of the leader that took over
    rm = d.state.rank_map
    assert rm.node_ids == ("n1", "n2", "n9") and rm.store_address == "10.0.0.1:29501"
    assert not any(m.proven for m in d.state.members) and b'"proven"' not in encode(d.state)


def test_unproven_members_age_after_every_proven_one_whatever_their_ids():
    s = decide(lost(JobSpec(1, 3, 1)), [Join("early", "10.6.6.6", 29500, 1, secret_hash="he"),
                                        proven(5, member_id=5, generation=3)], ctx()).state
    assert s.member("early").member_id == 1 and s.member("n5").seq == 5
    d = decide(s, [Tick()], ctx(now=5.0))
    assert d.state.rank_map.node_ids == ("n5", "early") and d.state.rank_map.store_address == "10.0.0.5:29505"
    assert d.state.member("early").seq > d.state.member("n5").seq


def test_a_proven_member_is_not_displaced_by_another_claim():
    s = decide(lost(), [proven(1, member_id=3, generation=4)], ctx()).state
    assert s.started_ms == STARTED_MS, "the run it ran"
    d = decide(s, tickets(proven(2, member_id=3, generation=4), rejoin(1, 3, 4, secret="other"),
                          proven(1, member_id=2, generation=4), proven(4, member_id=4, generation=4, started_ms=5)),
               ctx(now=1.0))
    assert {t: type(e) for t, e in d.rejected.items()} == {1: FailedPrecondition, 2: PermissionDenied,
                                                           3: FailedPrecondition, 4: FailedPrecondition}
    assert "ran another run" in str(rejected(d, 4))
    assert [(m.node_id, m.member_id) for m in d.state.members] == [("n1", 3)] and not d.evicted


def test_a_run_made_anew_by_a_join_since_etcd_lost_the_job_gives_way_to_its_real_nodes():
    """What a Join can do before the real nodes come back where every replica forgot the job: make
    the run anew, rank 0 and the store its own. A proven claim of the run as it ran before, within
    the grace, makes it a rebuild again: the new members give way, the real ones are taken back."""
    d = decide(JobState("job", JobSpec(1, 3, 1)), [Join("evil", "10.6.6.6", 29500, 4, secret_hash="he")], ctx())
    d = decide(d.state, [Tick()], ctx(now=1.0))
    assert d.state.rank_map.node_ids == ("evil",) and not d.state.rebuilding
    d = decide(d.state, [replace(proven(1, member_id=1, generation=6, slots=1), spec=JobSpec(2, 2, 1)),
                         proven(2, member_id=2, generation=6)], ctx(now=2.0))
    assert not d.rejected and d.evicted == (("evil", 1),) and d.state.rebuilding
    assert d.state.spec == JobSpec(2, 2, 1) and not d.state.spec_lost, "the real nodes' spec, not the Join's"
    assert [e.kind for e in d.events] == ["state_made_anew"] and d.state.started_ms == STARTED_MS
    assert [(m.node_id, m.member_id, m.proven) for m in d.state.members] == [("n1", 1, True), ("n2", 2, True)]
    d = decide(d.state, [Tick()], ctx(now=7.0))
    rm = d.state.rank_map
    assert rm.node_ids == ("n1", "n2") and rm.store_address == "10.0.0.1:29501" and rm.generation == 7


def test_no_claim_makes_anew_a_run_it_ran_or_one_past_the_grace():
    s = decide(lost(), [proven(1, member_id=1, generation=3)], ctx()).state
    s = decide(s, [Tick()], ctx(now=5.0)).state
    assert not s.rebuilding and s.started_ms == STARTED_MS
    d = decide(s, [proven(2, member_id=2, generation=3)], ctx(now=6.0))  # a member of it, gone since
    assert isinstance(rejected(d), NotFound) and not d.persist
    young = decide(JobState("job", JobSpec(1, 3, 1)), [Join("n9", "10.0.0.9", 29509, 1)], ctx()).state
    d = decide(young, [proven(2, member_id=2, generation=3)], ctx(now=5.1))  # past the grace (5 s)
    assert isinstance(rejected(d), NotFound) and not d.evicted


def claim(i, member_id, generation, world_size, local_world_size):
    return replace(rejoin(i, member_id, generation), world_size=world_size, local_world_size=local_world_size)


def test_a_rebuild_whose_nodes_all_ran_one_generation_whole_keeps_it_with_a_planned_switch():
    s = decide(lost(), [claim(1, 1, 7, 4, 2), claim(2, 2, 7, 4, 2)], ctx()).state
    d = decide(s, [Tick()], ctx(now=5.0, max_step=40, step_time_s=0.1))
    rm = d.state.rank_map
    assert d.new_generation and (rm.generation, rm.abort_previous, rm.world_size) == (8, False, 4)
    assert rm.switch_at_step > 40, "ahead of the steps the group trains on meanwhile"
    (generation,) = [e for e in d.events if e.kind == "generation"]
    assert generation.reason.startswith(f"switch after step {rm.switch_at_step} (every node taken back ran "
                                        "generation 7, whole)")


@pytest.mark.parametrize("claims", [
    [claim(1, 1, 7, 6, 2), claim(2, 2, 7, 6, 2)],  # a node of generation 7 did not come back
    [claim(1, 1, 7, 4, 2), claim(2, 2, 6, 4, 2)],  # they ran different generations
    [claim(1, 1, 7, 4, 2), rejoin(2, 2, 7)],  # a node that did not say (an older agent)
    [claim(1, 1, 7, 4, 3), claim(2, 2, 7, 4, 1)],  # more ranks than its slots
])
def test_a_rebuild_of_a_group_not_known_whole_aborts_it(claims):
    s = decide(lost(), claims, ctx()).state
    d = decide(s, [Tick()], ctx(now=5.0, max_step=40, step_time_s=0.1))
    assert d.new_generation and d.state.rank_map.abort_previous and d.state.rank_map.switch_at_step == 0


def test_a_node_joining_during_the_rebuild_makes_it_abort():
    s = decide(lost(), [claim(1, 1, 7, 4, 2), claim(2, 2, 7, 4, 2)], ctx()).state
    s = decide(s, [Join("n3", "10.0.0.3", 29503, 2)], ctx(now=1.0)).state
    d = decide(s, [Tick()], ctx(now=5.0, max_step=40, step_time_s=0.1))
    assert d.state.rank_map.abort_previous
