"""Refusals as counted lines (security review 4, N3: a line per refused attach made 65 MB of log
for 4 MB sent), and a job's members quota from its spec (N4) within the node cap."""

import asyncio

import pytest
from structlog.testing import capture_logs

from muster.coordinator.core.policy import DEFAULT_MAX_MEMBERS, MAX_NODES, InvalidPolicy, JobSpec, Limits
from muster.coordinator.quotas import RefusalLog
from muster.testing import FakeClock


def test_a_flood_of_refusals_is_a_line_a_window_with_its_count_and_nothing_is_lost():
    clock = FakeClock(0.0)
    refusals = RefusalLog(window_s=1.0, clock=clock)

    async def flood():
        for i in range(1000):
            refusals.refused("relayed_stream_refused", "PermissionDenied", f"stream {i}", job="a")
        refusals.refused("relayed_stream_refused", "NotFound", "another kind", job="a")
        clock.advance(1.0)
        await asyncio.sleep(0.0)
        await asyncio.sleep(1.05)  # the held count's line is due a window after the first

    with capture_logs() as lines:
        asyncio.run(flood())
    assert [(line["code"], line["refused"], line["error"]) for line in lines] == [
        ("PermissionDenied", 1, "stream 0"), ("NotFound", 1, "another kind"), ("PermissionDenied", 999, "stream 999")]


def test_a_jobs_members_quota_is_its_max_nodes_and_spares_within_the_deployments_limit():
    assert Limits().members_of(JobSpec(1, 4, 1)) == 4 + 16
    assert Limits(max_spares=0).members_of(JobSpec(1, 4, 1)) == 4
    assert Limits(max_members=10).members_of(JobSpec(1, 8, 1)) == 10
    assert Limits().members_of(JobSpec()) == DEFAULT_MAX_MEMBERS == 1024, \
        "a job that names no max_nodes (or 125,000): the deployment's quota, not its most"
    assert Limits().with_job_quota("big:nodes=125016").for_job("big").members_of(JobSpec()) == MAX_NODES + 16


def test_a_job_of_a_million_gpus_is_allowed_and_one_node_more_is_refused_with_the_cap():
    assert JobSpec(1, 125_000, 1).validate().max_nodes == MAX_NODES == 125_000  # 1M GPUs: 125k nodes x 8
    with pytest.raises(InvalidPolicy, match=r"max_nodes must be in min_nodes\.\.125000 \(1\.\.125000\), got 125001"):
        JobSpec(1, MAX_NODES + 1, 1).validate()
