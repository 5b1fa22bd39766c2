"""The chaos faults as data: each kind one record (how it is injected, what repairs it, whether a
new leader may lead after it, the answer expected). `Chaos.scenario` looks a kind up here; the
single-fault sequence, the compound tables, the soak and the reliability page's tables
(docs/generate.py) all read this list, so adding a fault is adding one record.

Imports nothing of the harness: the docs generator reads it without starting anything."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from harness import Chaos, Fault

# Where a kind runs: the single-fault sequence (test_faults, and the soak), the compound ones
# (test_compound, test_outages, the soak), and those needing their own cluster.
SINGLE, COMPOUND, RELAYS, PARTITION = "single", "compound", "relays", "partition"


@dataclass(frozen=True)
class FaultKind:
    name: str
    table: str  # SINGLE, COMPOUND, RELAYS or PARTITION
    inject: Callable[[Chaos], Fault]
    fault: str  # what is done, as the reliability page says it
    answer: str  # what the job is expected to do
    repair: Callable[[Chaos, Fault], object] | None = None  # after the answer: restart what the fault took
    # A new leader may lead afterwards: its grace (nodes reconnect before anyone is evicted for
    # silence) and a heartbeat timeout pass before the invariants are checked, since an eviction
    # for a silence that began in the fault shows only then.
    new_leader: bool = False


def _restart_agent(chaos: Chaos, fault: Fault) -> object:
    return chaos.restart_agent(fault.victims[0][0])


def _restart_coordinator(chaos: Chaos, fault: Fault) -> object:
    return chaos.restart_coordinator()


def _restart_etcd(chaos: Chaos, fault: Fault) -> object:
    return chaos.restart_etcd()


KINDS: list[FaultKind] = [
    FaultKind("rank", SINGLE, lambda c: c.kill_rank(), "SIGKILL a rank",
              "abort generation without it; the agent restarts it and it rejoins, receiving the state"),
    FaultKind("rank0", SINGLE, lambda c: c.kill_rank(0), "SIGKILL rank 0 (the store host)",
              "the same; the store moves with rank 0"),
    FaultKind("hang", SINGLE, lambda c: c.hang_rank(), "SIGSTOP a rank",
              "evicted as silent; when resumed it is fenced out (`down_local_ranks`), exits, and is replaced",
              repair=lambda c, f: c.resume(f)),
    FaultKind("agent", SINGLE, lambda c: c.kill_agent(), "SIGKILL an agent",
              "node lost after the heartbeat timeout (its ranks die with it); the restarted agent rejoins",
              repair=_restart_agent),
    FaultKind("leader", SINGLE, lambda c: c.kill_leader(), "SIGKILL the coordinator leader",
              "a standby leads after the lease TTL; no generation change, no eviction",
              repair=_restart_coordinator, new_leader=True),
    FaultKind("etcd_member", SINGLE, lambda c: c.kill_etcd(leader=False), "SIGKILL an etcd follower",
              "nothing changes", repair=_restart_etcd, new_leader=True),
    FaultKind("etcd_leader", SINGLE, lambda c: c.kill_etcd(leader=True), "SIGKILL the etcd leader",
              "nothing changes", repair=_restart_etcd, new_leader=True),
    FaultKind("rank_and_leader", SINGLE, lambda c: c.kill_rank_and_leader(),
              "a rank and the coordinator leader at once",
              "the exit report died with the leader; the new one learns it from the frames",
              repair=_restart_coordinator, new_leader=True),
    FaultKind("during_reform", SINGLE, lambda c: c.kill_during_reform(),
              "a second rank killed as the first one's generation is published",
              "the half-formed group is abandoned"),
    FaultKind("slow_rank", SINGLE, lambda c: c.slow_rank(),
              "a rank throttled from outside (SIGSTOP 60% of every 50 ms)",
              "its node named a straggler within 30 s, nobody else; no generation change "
              "([stragglers](guide/stragglers.md))", repair=lambda c, f: c.unthrottle(f)),
    FaultKind("partition", PARTITION, lambda c: c.partition(next(iter(c.netns))),
              "network partition of one node (network namespace + veth, root only)",
              "node lost; its ranks complete no step alone; once healed it finds itself evicted and joins again "
              "as a new member, its ranks held", repair=lambda c, f: c.heal(f)),
    FaultKind("relay", RELAYS, lambda c: c.kill_relay(), "SIGKILL a relaying replica (relays on)",
              "its nodes reconnect elsewhere; no generation change, no eviction", repair=_restart_coordinator),
    FaultKind("etcd_outage", COMPOUND, lambda c: c.etcd_outage(), "every etcd member SIGKILLed for 10 s",
              "training goes on; a leader is back after etcd; nobody evicted", new_leader=True),
    FaultKind("etcd_freeze", COMPOUND, lambda c: c.etcd_outage(freeze=True), "every etcd member SIGSTOPped for 10 s",
              "the same", new_leader=True),
    FaultKind("coordinators_down", COMPOUND, lambda c: c.coordinators_down(),
              "every coordinator down for 20 s, back at their addresses", "training goes on; nobody evicted",
              new_leader=True),
    FaultKind("etcd_data_loss", COMPOUND, lambda c: c.etcd_data_loss(), "etcd wiped and started fresh (a lost volume)",
              "exactly one `state_rebuilt` generation; no eviction", new_leader=True),
    FaultKind("rank_in_etcd_outage", COMPOUND, lambda c: c.etcd_outage(kill="rank"),
              "a rank SIGKILLed during an etcd outage",
              "survivors hold (no crash), re-form once a leader is back; only the killed rank is replaced",
              new_leader=True),
    FaultKind("rank0_in_etcd_outage", COMPOUND, lambda c: c.etcd_outage(kill="rank0"),
              "rank 0 (the store host) SIGKILLed during an etcd outage", "the same", new_leader=True),
    FaultKind("agent_in_etcd_outage", COMPOUND, lambda c: c.etcd_outage(kill="agent"),
              "a whole node SIGKILLed during an etcd outage",
              "survivors hold; the lost node is judged silent a heartbeat timeout after the survivors reach the "
              "new leader", repair=_restart_agent, new_leader=True),
    FaultKind("rank_in_coordinators_down", COMPOUND, lambda c: c.coordinators_down(kill="rank"),
              "a rank SIGKILLed with every coordinator down",
              "survivors hold, re-form once a leader is back; only the killed rank is replaced", new_leader=True),
    FaultKind("rank0_in_coordinators_down", COMPOUND, lambda c: c.coordinators_down(kill="rank0"),
              "rank 0 SIGKILLed with every coordinator down", "the same", new_leader=True),
    FaultKind("agent_in_coordinators_down", COMPOUND, lambda c: c.coordinators_down(kill="agent"),
              "a whole node SIGKILLed with every coordinator down", "as during an etcd outage",
              repair=_restart_agent, new_leader=True),
    FaultKind("leader_frozen_at_reform", COMPOUND, lambda c: c.freeze_leader_at_reform(),
              "the leader SIGSTOPped as it publishes a reform",
              "a standby takes over and the reform completes; resumed, the old leader has stepped down (fenced)",
              repair=lambda c, f: c.resume_leader(f), new_leader=True),
    FaultKind("hostile_client", COMPOUND, lambda c: c.hostile_client(),
              "a hostile client: garbage bytes, 200k-character names, a 2 MiB message, guessed member ids "
              "without the secret", "precise refusals; no generation, no eviction"),
]

BY_NAME = {k.name: k for k in KINDS}


def named(table: str) -> list[str]:
    """The kinds of one table, in the list's order."""
    return [k.name for k in KINDS if k.table == table]


def markdown(*tables: str) -> str:
    """The reliability page's table of these tables' kinds (docs/generate.py)."""
    rows = [f"| {k.fault} | {k.answer} |" for k in KINDS if k.table in tables]
    return "\n".join(["| fault | expected answer |", "|---|---|", *rows])
