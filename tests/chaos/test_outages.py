"""Outages longer than the compound sequence's: every etcd member down 30 s (and, marked slow, every
etcd member or every coordinator down 2 minutes) while rank 0 (the store host) or a whole node dies.
However long the outage, every surviving rank steps again within HEAL_BOUND_S of the heal: the
etcd client reconnects within about a second of etcd's return (gRPC's reconnect backoff is capped),
the replicas retry their sessions and campaigns under a second apart, and the old session's
lease, which a restarted etcd renews, is revoked as soon as etcd answers instead of a TTL later;
and a node lost meanwhile is judged a heartbeat timeout after the survivors reached the new leader,
whatever its takeover grace."""

import json

import pytest
from compound import summary
from harness import HEAL_BOUND_S, HEARTBEAT_TIMEOUT_S, OUTAGE_AGENT_EXPECT, Chaos
from muster.local import record_time


def outages(tmp_path, job: str, names: list[str], seconds: float, **options) -> Chaos:
    chaos = Chaos(tmp_path, job=job, seed=23, outages_s=(seconds, seconds), **options)
    began, first_step, stopped_by = 0.0, 0, None
    try:
        chaos.start()
        first_step = max(r["step"] for r in chaos.last_steps().values())
        began = chaos.full_at
        for name in names:
            try:
                chaos.scenario(name)  # strict: raises on a wedge (past HEAL_BOUND_S) or a lost survivor
            except AssertionError as exc:
                stopped_by = f"{name} after a {seconds:g} s outage: {exc}"
                raise
    finally:
        report = chaos.report()
        leftovers = chaos.stop()
        print(json.dumps(summary(chaos, report, seed=23, began=began, first_step=first_step, stopped_by=stopped_by),
                         indent=2))
    assert not leftovers, f"processes left behind: {leftovers}"
    resumed = {f.kind: f.resumed_s for f in chaos.faults}
    assert all(s is not None and s <= HEAL_BOUND_S for s in resumed.values()), resumed
    return chaos


@pytest.mark.timeout(300)
def test_rank0_and_then_a_node_lost_in_30_s_etcd_outages_are_back_within_the_bound_whatever_the_grace(tmp_path):
    """With the coordinator's default takeover grace (5 s). Issue 40: the survivors, attached within
    0.25 s of the new leader's election, stepped again only 7.2-7.6 s after the heal: the grace held
    the lost node's eviction. The grace ends a heartbeat timeout (2 s) after their first frame: back
    within HEAL_BOUND_S, and the loss decided about a heartbeat timeout after the takeover, however
    long etcd took to answer."""
    chaos = outages(tmp_path, "outage30", ["rank0_in_etcd_outage", "agent_in_etcd_outage"], 30.0, grace_s=5.0)
    fault = chaos.faults[-1]
    assert fault.kind == "agent_in_etcd_outage"
    records = [r for c in chaos.replicas for r in c.records() if record_time(r) >= fault.healed_at]
    takeover = min(record_time(r) for r in records if r.get("event") == "leadership_acquired" and r.get("members"))
    decided = min(record_time(r) for r in records
                  if r.get("event") == "membership_changed" and r.get("kind") in OUTAGE_AGENT_EXPECT)
    # the wheel's slot (an eighth of the timeout), a tick and the survivors' first frame on top
    assert decided - takeover <= HEARTBEAT_TIMEOUT_S + 1.0, (round(decided - takeover, 2), fault.notes)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_minute_outages_of_etcd_and_of_every_coordinator_are_back_within_the_bound(tmp_path):
    outages(tmp_path, "outage120", ["rank0_in_etcd_outage", "agent_in_etcd_outage", "rank_in_coordinators_down",
                                    "agent_in_coordinators_down"], 120.0)
