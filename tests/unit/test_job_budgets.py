"""A job's rates on the etcd every job shares (security review 5, H2): kept by job name, so that a
new run or term does not refill them; charged past empty (generations, bytes: they happen), with
refusals until paid back; each refusal naming its quota and the flag that raises it; and an
operator's per-job quotas over the deployment's."""

import pytest

from muster.coordinator.core.policy import InvalidPolicy, Limits
from muster.coordinator.errors import ResourceExhausted
from muster.coordinator.quotas import JobBudgets
from muster.testing import FakeClock


def test_a_jobs_budgets_outlive_its_runs_and_terms_and_go_once_full_again():
    clock = FakeClock()
    budgets = JobBudgets(Limits(runs_per_hour=6.0), clock)  # bursts of 10 minutes' worth: 1
    for _ in range(1):
        budgets.of("a").runs.spend()
    with pytest.raises(ResourceExhausted, match=r"more than 6 new runs an hour of job 'a'.*--max-runs-per-hour; "
                                                r"--job-quota a:runs=N raises it for this job"):
        budgets.of("a").runs.spend()
    budgets.of("b").runs.spend()  # another job's are its own
    clock.advance(600)
    budgets.of("a").runs.spend()  # paid back at its rate
    with pytest.raises(ResourceExhausted):
        budgets.of("a").runs.spend()
    clock.advance(7200)  # both full again: dropped at the next look, as new ones are full too
    budgets.of("c")
    assert len(budgets) == 1, "what is kept: the jobs that spent lately, not every job ever run"


def test_generations_and_etcd_bytes_are_charged_past_empty_and_refuse_until_paid_back():
    clock = FakeClock()
    budget = JobBudgets(Limits(generations_per_min=60.0, etcd_mib_per_min=1.0), clock).of("a")
    budget.etcd.charge(3 * 2**20)  # a write larger than the budget happens, once
    with pytest.raises(ResourceExhausted, match=r"more than 1 MiB a minute written to etcd by job 'a'.*"
                                                r"--max-etcd-mib-per-minute; --job-quota a:etcd_mib=N"):
        budget.etcd.check()
    clock.advance(119)
    with pytest.raises(ResourceExhausted):
        budget.etcd.check()  # 2 MiB of debt: two minutes
    clock.advance(2)
    budget.etcd.check()
    budget.generations.charge(60)
    with pytest.raises(ResourceExhausted, match="more than 60 generations a minute of job 'a'"):
        budget.generations.check()
    clock.advance(1)
    budget.generations.check()


def test_the_joins_burst_is_the_jobs_members_quota_and_grows_once_for_a_larger_spec():
    clock = FakeClock()
    budgets = JobBudgets(Limits(joins_per_s=1.0), clock)
    budgets.of("a", members=3).joins.spend(3)
    with pytest.raises(ResourceExhausted):
        budgets.of("a", members=3).joins.spend(8)  # bursts of 10 (the least) and 3
    budgets.of("a", members=20).joins.spend(17)  # a run of a larger spec: the difference, once
    with pytest.raises(ResourceExhausted):
        budgets.of("a", members=20).joins.spend()


def test_an_operator_raises_one_jobs_quotas_by_name():
    limits = Limits().with_job_quota("big:nodes=16384,etcd_mib=256").with_job_quota("big:runs=120")
    big = limits.for_job("big")
    assert (big.max_members, big.etcd_mib_per_min, big.runs_per_hour) == (16384, 256.0, 120.0)
    assert limits.for_job("other") is limits and limits.max_members == 1024
    for text, error in (("big", "name at least one quota"), ("big:cpus=4", "'cpus' is no quota"),
                        ("big:nodes=many", "is no number"), ("Big/x:nodes=4", "is no job name"),
                        ("big:nodes=0", "max_members must be positive")):
        with pytest.raises(InvalidPolicy, match=error):
            Limits().with_job_quota(text)
