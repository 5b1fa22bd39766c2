"""The generation state machine under random sequences of membership events (hypothesis): every
decision keeps the core's invariants, and the persisted form reads back to the same state."""

from hypothesis import given, settings
from hypothesis import strategies as st

from muster.coordinator.core.exits import HOLD_OUT_FAILURES
from muster.coordinator.core.machine import (Context, Finishing, Join, Leave, NodeFault, NodeLost, Rejoin, SlotDown,
                                             SlotError, SlotsUp, Stop, Tick, decide)
from muster.coordinator.core.policy import JobSpec, Timing
from muster.coordinator.core.state import JobState, NodeKind, Phase, decode, encode

TIMING = Timing(last_call_s=0.5, switch_lead_s=0.5, grace_s=1.5)
NODES = [f"n{i}" for i in range(6)]

events = st.one_of(
    st.builds(Join, st.sampled_from(NODES), st.just("10.0.0.1"), st.integers(1, 65535), st.integers(1, 4),
              st.sampled_from(list(NodeKind))),
    st.builds(Leave, st.sampled_from(NODES), immediate=st.booleans(), finished=st.booleans()),
    st.builds(NodeLost, st.sampled_from(NODES), st.sampled_from(["node_silent", "process_exited"]), st.just("x")),
    st.builds(SlotDown, st.sampled_from(NODES), st.integers(0, 4), st.just("rank_exited"), st.just("x")),
    st.builds(SlotsUp, st.sampled_from(NODES), st.lists(st.integers(0, 4), max_size=3).map(tuple)),
    st.builds(Rejoin, st.sampled_from(NODES), st.integers(0, 12), st.integers(0, 30), st.sampled_from(["", "a", "b"]),
              st.just("10.0.0.2"), st.integers(1, 65535), st.integers(1, 4), st.sampled_from(list(NodeKind))),
    st.builds(Finishing, st.sampled_from(NODES), st.just("done")),
    st.builds(NodeFault, st.sampled_from(NODES), st.integers(0, 2**41)),
    st.builds(SlotError, st.sampled_from(NODES), st.integers(0, 4), st.sampled_from(["", "0123abcd", "4567ef01"]),
              st.integers(0, 30), st.integers(1, 9)),
    st.just(Stop("operator")),
    st.just(Tick()),
)
specs = st.builds(lambda lo, extra, mult: JobSpec(lo, lo + extra, mult), st.integers(1, 3), st.integers(0, 3),
                  st.sampled_from([1, 2]))


@settings(max_examples=300, deadline=None)
@given(specs, st.lists(st.lists(events, max_size=4), max_size=25), st.booleans(), st.integers(1, 8), st.booleans())
def test_any_sequence_of_events_keeps_the_invariants(spec, batches, prestart, max_members, rebuilding):
    state = JobState("fuzz", spec, rebuilding=rebuilding)
    finished: set[str] = set()  # left as finished: the map keeps them until the next change (no generation)
    for i, batch in enumerate(batches):
        ctx = Context(now=i * 0.3, wall_ms=i, term=1, timing=TIMING, max_step=i * 10, step_time_s=0.1,
                      prestart=prestart, max_members=max_members)
        d = decide(state, batch, ctx)
        nxt = d.state
        finished |= {n for e in d.events if e.kind == "node_finished" for n in e.nodes}
        assert nxt.generation >= state.generation
        # nodes taken back during a rebuild raise the generation to theirs; nothing is published before it ends
        assert (nxt.generation > state.generation) == d.new_generation or (state.rebuilding and nxt.rank_map is None)
        assert len(nxt.members) <= max(max_members, len(state.members))
        assert len({m.node_id for m in nxt.members}) == len(nxt.members)
        # a run ends once: its outcome and end never change, and nothing is published once it is ending
        if state.ended:
            assert (nxt.outcome, nxt.outcome_reason, nxt.ended_ms) == (state.outcome, state.outcome_reason,
                                                                       state.ended_ms)
        assert d.ended == (nxt.ended and not state.ended)
        assert not (state.frozen and d.new_generation)
        rm = nxt.rank_map
        if rm is not None and nxt.phase is Phase.RUNNING and not nxt.frozen:
            members = {m.node_id: m for m in nxt.members}
            ranks = []
            for p in rm.placements:
                m = members.get(p.node_id)
                if m is None:
                    assert p.node_id in finished, f"{p.node_id} is in the map but no member"
                else:
                    assert set(p.slots) <= set(m.usable_slots), "a down or missing slot is never placed"
                ranks += [p.rank_of(s) for s in p.slots]
            assert sorted(ranks) == list(range(rm.world_size)) and rm.world_size % spec.world_size_multiple == 0
            assert spec.min_nodes <= len(rm.placements) <= spec.max_nodes
        assert all(len(m.faults_ms) <= HOLD_OUT_FAILURES for m in nxt.members), "a member keeps its last faults only"
        assert all(len({e[0] for e in m.last_errors}) == len(m.last_errors) and all(0 <= e[0] < m.slots and e[1]
                                                                                    for e in m.last_errors)
                   for m in nxt.members), "a member keeps one last failure a slot of its own"
        if d.persist:
            assert decode(encode(nxt)) == nxt
        state = nxt
