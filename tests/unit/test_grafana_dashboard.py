"""deploy/grafana/muster-dashboard.json asks only for what the coordinator exports: every query's
metrics and labels are in a replica's /metrics (src/muster/coordinator/metrics.py), and every metric is shown."""

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from muster.coordinator.metrics import JobGauges, Metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "muster-dashboard.json"
ADDED_BY_PROMETHEUS = {"instance"}  # the scrape target's; Muster's own `job` label is kept (honor_labels)


def exported() -> dict[str, tuple[str, set[str]]]:
    """Every sample name a replica's /metrics holds, with its family and its labels: each metric fed once."""
    m = Metrics()
    m.frames.labels("j").inc()
    m.evictions.labels("j", "rank_exited").inc()
    m.generations.labels("j").inc()
    m.detection.labels("j").observe(0.01)
    m.recovery.labels("j").observe(0.5)
    m.runs_ended.labels("succeeded").inc()
    m.etcd_write.observe(0.002)
    m.watch(lambda: [JobGauges("j", led=True, term=2, generation=3, live_ranks=4, world_size=4, steps_per_second=9.5)],
            lambda: True)
    names: dict[str, tuple[str, set[str]]] = {}
    for family in text_string_to_metric_families(m.exposition().decode()):
        if family.name.endswith("_created"):  # prometheus_client's creation times, not Muster's metrics
            continue
        for s in family.samples:
            names.setdefault(s.name, (family.name, set()))[1].update(s.labels)
    return names


def queries() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    found = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    found += [v["definition"] for v in board["templating"]["list"] if v["type"] == "query"]
    return found


def test_every_query_names_metrics_and_labels_the_coordinator_exports():
    names = exported()
    for q in queries():
        metrics = re.findall(r"\bmuster_[a-z0-9_]+\b", q)
        assert metrics, f"no muster metric in {q!r}"
        unknown = [m for m in metrics if m not in names]
        assert not unknown, f"{q!r} names {unknown}, which the coordinator does not export"
        labels = {m for group in re.findall(r"\{([^}]*)\}", q) for m in re.findall(r"([a-z_]+)\s*[=!]", group)}
        labels |= {label.strip() for group in re.findall(r"\b(?:by|on)\s*\(([^)]*)\)", q) for label in group.split(",")}
        labels |= set(re.findall(r"label_values\([^,]+,\s*([a-z_]+)\)", q))
        have = set().union(*(names[m][1] for m in metrics)) | ADDED_BY_PROMETHEUS
        assert labels <= have, f"{q!r} uses labels {labels - have} that {metrics} do not carry"


def test_every_exported_metric_is_on_the_board():
    names = exported()
    shown = {names[m][0] for q in queries() for m in re.findall(r"\bmuster_[a-z0-9_]+\b", q) if m in names}
    missing = {family for family, _ in names.values()} - shown
    assert not missing, f"metrics the dashboard does not show: {sorted(missing)}"


def test_the_board_is_one_grafana_dashboard_over_a_chosen_prometheus():
    board = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)) and board["uid"] and board["schemaVersion"] >= 36
    assert {v["name"] for v in board["templating"]["list"]} == {"datasource", "job"}
    for p in board["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
