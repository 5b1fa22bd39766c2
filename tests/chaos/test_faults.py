"""The chaos sequence: one cluster, one fault after another; after each the job must recover and
the invariants hold (survivors keep their PIDs, contiguous steps, identical state, the events
explain every change; no orphans at the end). Recovery times go to the module's report."""

import pytest

pytestmark = pytest.mark.timeout(150)


def test_sigkill_a_rank(chaos):
    fault = chaos.recover(chaos.kill_rank())
    chaos.full_strength()  # the agent restarted it; it rejoined and received the state
    chaos.check(fault)


def test_sigkill_rank0(chaos):
    fault = chaos.recover(chaos.kill_rank(0))  # the store moves with rank 0
    chaos.full_strength()
    chaos.check(fault)


def test_sigstop_a_rank(chaos):
    fault = chaos.recover(chaos.hang_rank())
    chaos.resume(fault)  # it wakes up fenced out, stops, and the agent replaces it
    chaos.full_strength()
    chaos.check(fault)


def test_sigkill_an_agent(chaos):
    fault = chaos.recover(chaos.kill_agent())
    chaos.restart_agent(fault.victims[0][0])
    chaos.full_strength()
    chaos.check(fault)


def test_sigkill_the_coordinator_leader(chaos):
    fault = chaos.recover(chaos.kill_leader())
    chaos.restart_coordinator()
    chaos.check(fault)


def test_sigkill_an_etcd_member(chaos):
    fault = chaos.recover(chaos.kill_etcd(leader=False))
    chaos.restart_etcd()
    chaos.check(fault)


def test_sigkill_the_etcd_leader(chaos):
    fault = chaos.recover(chaos.kill_etcd(leader=True))
    chaos.restart_etcd()
    chaos.check(fault)


def test_two_faults_at_once(chaos):
    fault = chaos.recover(chaos.kill_rank_and_leader())  # the exit report dies with the leader
    chaos.restart_coordinator()
    chaos.full_strength()
    chaos.check(fault)


def test_a_fault_during_a_reform(chaos):
    fault = chaos.recover(chaos.kill_during_reform())
    chaos.full_strength()
    chaos.check(fault)
