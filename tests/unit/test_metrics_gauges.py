"""Metrics read per-job gauges from plain callables at scrape time."""

from muster.coordinator.metrics import JobGauges, Metrics


def test_gauges_are_read_from_callables_and_only_led_jobs_report_more_than_the_flag():
    jobs = [JobGauges("a", led=True, term=3, generation=7, live_ranks=4, world_size=4, spares=1),
            JobGauges("b", led=False)]
    ready = [True]
    m = Metrics()
    m.watch(lambda: jobs, lambda: ready[0])
    text = m.exposition().decode()
    for line in ('muster_leader{job="a"} 1.0', 'muster_leader{job="b"} 0.0', 'muster_term{job="a"} 3.0',
                 'muster_generation{job="a"} 7.0', 'muster_live_ranks{job="a"} 4.0', 'muster_world_size{job="a"} 4.0',
                 'muster_spare_nodes{job="a"} 1.0', "muster_ready 1.0"):
        assert line in text
    assert 'muster_term{job="b"}' not in text
    ready[0] = False
    jobs.append(JobGauges("c", led=False))
    text = m.exposition().decode()
    assert "muster_ready 0.0" in text and 'muster_leader{job="c"} 0.0' in text
