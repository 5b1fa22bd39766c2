"""Status in pages (status_pages.check_page, .rank_page, .job_status): pages in rank order whose
tokens lead through every rank once, a page boundary inside a node, the node and states filters,
the summary over the whole job, and precise refusals of bad paging input."""

import pytest

from muster.coordinator.job import status_pages

from muster.coordinator import wire
from muster.coordinator.core.liveness import Liveness, RankReport
from muster.coordinator.core.machine import Context, Join, decide
from muster.coordinator.core.policy import JobSpec, Timing
from muster.coordinator.core.state import JobState
from muster.coordinator.errors import FailedPrecondition, InvalidArgument, NotFound
from muster.v1 import muster_pb2 as pb

TIMING = Timing()
SLOTS = 3  # pages of 2 or 4 ranks end inside a node


def ctx(now=0.0):
    return Context(now=now, wall_ms=1_700_000_000_000, term=7, timing=TIMING, max_step=0, step_time_s=None)


def running(nodes: int, spares: int = 0) -> JobState:
    """A formed job of `nodes` nodes in the map, then `spares` more joined."""
    joins = [Join(f"n{i}", f"10.0.0.{i}", 29500, SLOTS) for i in range(nodes)]
    state = decide(JobState("job", JobSpec(1, nodes, 1)), joins, ctx()).state
    spare_joins = [Join(f"s{i}", f"10.0.1.{i}", 29500, SLOTS) for i in range(spares)]
    return decide(state, spare_joins, ctx(1.0)).state if spares else state


def live(state: JobState, exited: dict[str, int] = {}) -> Liveness:
    """Every rank of the map running at step 5, but local rank `exited[node]` of those named."""
    lv = Liveness(TIMING, 0.0)
    for p in state.rank_map.placements:
        lv.observe(p.node_id, state.generation, [
            RankReport(s, 100 + s, 5, 0.1, "exited" if exited.get(p.node_id) == s else "running") for s in p.slots
        ], 0.0)
    return lv


def page(**request) -> status_pages.Page:
    return status_pages.check_page(pb.StatusRequest(job="job", **request))


def all_pages(state, lv, **request) -> list[list[pb.RankStatus]]:
    pages, token = [], ""
    while True:
        ranks, token = status_pages.rank_page(state, lv, page(page_token=token, **request))
        pages.append(ranks)
        if not token:
            return pages


def test_pages_cover_every_rank_once_in_order_with_boundaries_inside_nodes():
    state = running(5)  # 15 ranks
    lv = live(state)
    pages = all_pages(state, lv, page_size=4)
    assert [len(p) for p in pages] == [4, 4, 4, 3]
    ranks = [r for p in pages for r in p]
    assert [r.rank for r in ranks] == list(range(15))
    # Rank 4 is local rank 1 of node n1: the second page starts inside that node.
    assert (pages[1][0].node, pages[1][0].local_rank, pages[1][0].node_rank) == ("n1", 1, 1)
    assert all(r.state == "running" and r.step == 5 and r.pid == 100 + r.local_rank for r in ranks)


def test_a_job_under_the_page_size_is_one_page_and_the_last_page_ends_exactly():
    state = running(4)
    js = status_pages.job_status(state, "me", 7, live(state), page=page())
    assert len(js.ranks) == 12 and js.next_page_token == ""
    assert [len(p) for p in all_pages(state, live(state), page_size=6)] == [6, 6]


def test_the_summary_nodes_and_spares_come_with_the_first_page_only():
    state = running(4, spares=2)
    lv = live(state, exited={"n2": 1})
    first = status_pages.job_status(state, "me", 7, lv, page=page(page_size=5))
    assert (first.summary.nodes, first.summary.spares) == (6, 2)
    assert dict(first.summary.rank_states) == {"running": 11, "exited": 1}
    assert list(first.nodes) == ["n0", "n1", "n2", "n3", "s0", "s1"] and list(first.spares) == ["s0", "s1"]
    second = status_pages.job_status(state, "me", 7, lv, page=page(page_size=5, page_token=first.next_page_token))
    assert not second.HasField("summary") and not second.nodes and not second.spares
    assert [r.rank for r in second.ranks] == [5, 6, 7, 8, 9]


def test_persisted_status_pages_the_same_with_every_rank_persisted():
    state = running(3)
    pages = all_pages(state, None, page_size=2)
    assert [r.rank for p in pages for r in p] == list(range(9))
    assert {r.state for p in pages for r in p} == {"persisted"}
    first = status_pages.job_status(state, "", 7, None, page=page())
    assert dict(first.summary.rank_states) == {"persisted": 9}


def test_each_ranks_restarts_are_its_agents_latest_report():
    state = running(1)
    lv = Liveness(TIMING, 0.0)

    def frame(restarts: list[int], now: float) -> list[int]:
        reports = [pb.RankReport(local_rank=s, pid=100 + s, state=pb.RANK_STATE_RUNNING, restarts=n)
                   for s, n in enumerate(restarts)]
        lv.observe("n0", state.generation, wire.check_frame_ranks(pb.NodeFrame(ranks=reports), state.member("n0")), now)
        return [r.restarts for r in status_pages.rank_page(state, lv, page())[0]]

    assert frame([0, 2, 0], 0.0) == [0, 2, 0]
    assert frame([1, 3, 0], 1.0) == [1, 3, 0]  # replaced, not summed: the agent keeps the count
    assert {r.restarts for r in status_pages.rank_page(state, None, page())[0]} == {0}  # persisted: not known


def test_ranks_of_a_node_not_yet_heard_from_are_unknown():
    state = running(2)
    lv = Liveness(TIMING, 0.0)
    ranks, _ = status_pages.rank_page(state, lv, page())
    assert {r.state for r in ranks} == {"unknown"}
    assert dict(status_pages.job_summary(state, lv).rank_states) == {"unknown": 6}


def test_node_filter_gives_that_nodes_ranks_and_a_spare_none():
    state = running(4, spares=1)
    ranks, token = status_pages.rank_page(state, live(state), page(node="n2"))
    assert [(r.rank, r.node, r.local_rank) for r in ranks] == [(6, "n2", 0), (7, "n2", 1), (8, "n2", 2)]
    assert token == ""
    # Paged within the node: the token of its second page resumes in it.
    first, token = status_pages.rank_page(state, live(state), page(node="n2", page_size=2))
    rest, end = status_pages.rank_page(state, live(state), page(node="n2", page_size=2, page_token=token))
    assert [r.rank for r in first + rest] == [6, 7, 8] and end == ""
    assert status_pages.rank_page(state, live(state), page(node="s0")) == ([], "")
    assert not status_pages.job_status(state, "me", 7, live(state), page=page(node="n2")).HasField("summary")
    with pytest.raises(NotFound, match="'n9' is no member"):
        status_pages.rank_page(state, live(state), page(node="n9"))


def test_states_filter_selects_ranks_and_bounds_the_scan_of_each_page():
    state = running(40)  # 120 ranks, two exited far apart
    lv = live(state, exited={"n1": 2, "n38": 0})
    pages = all_pages(state, lv, page_size=1, states=["exited", "unknown"])
    found = [(r.rank, r.node) for p in pages for r in p]
    assert found == [(5, "n1"), (114, "n38")]
    # A page of 1 scans at most SCAN_FACTOR ranks: the 120 ranks take several pages, some empty.
    assert len(pages) >= 120 // status_pages.SCAN_FACTOR and [] in pages


def test_an_empty_job_has_an_empty_last_page():
    state = JobState("job", JobSpec(1, 2, 1))
    js = status_pages.job_status(state, "me", 1, Liveness(TIMING, 0.0), page=page())
    assert (list(js.ranks), js.next_page_token, js.summary.nodes, dict(js.summary.rank_states)) == ([], "", 0, {})


def test_listing_of_nodes_is_bounded_and_the_summary_counts_them_all(monkeypatch):
    monkeypatch.setattr(status_pages, "MAX_LISTED_NODES", 3)
    state = running(5)
    js = status_pages.job_status(state, "me", 7, None, page=page())
    assert list(js.nodes) == ["n0", "n1", "n2"] and js.summary.nodes == 5


def test_brief_has_neither_ranks_nor_summary():
    state = running(2)
    js = status_pages.job_status(state, "me", 7, live(state), brief=True)
    assert not js.ranks and not js.HasField("summary") and not js.nodes


def refusal(error, check, *args) -> str:
    with pytest.raises(error) as err:
        check(*args)
    assert len(str(err.value)) < 300, str(err.value)
    return str(err.value)


@pytest.mark.parametrize("request_, says", [
    (dict(page_size=status_pages.MAX_PAGE_SIZE + 1), f"at most {status_pages.MAX_PAGE_SIZE}"),
    (dict(page_token="-5"), "page_token '-5' is none that Status gave"),
    (dict(page_token="g1r-1"), "page_token"),
    (dict(page_token="x" * 10_000), "(10000 chars)"),
    (dict(page_token="g1r" + "9" * 11), "page_token"),
    (dict(node="bad node"), "node_id 'bad node' is invalid"),
    (dict(states=["dead"]), "'dead' is no rank state"),
    (dict(states=["y" * 5000]), "(5000 chars)"),
    (dict(states=["running"] * 100), "states lists 100 states"),
])
def test_bad_paging_input_is_refused_precisely(request_, says):
    assert says in refusal(InvalidArgument, status_pages.check_page, pb.StatusRequest(job="job", **request_))


def test_paging_needs_a_job():
    assert "need a job" in refusal(InvalidArgument, status_pages.check_page, pb.StatusRequest(page_token="g1r0"))
    assert "need a job" in refusal(InvalidArgument, status_pages.check_page, pb.StatusRequest(node="n0"))
    assert status_pages.check_page(pb.StatusRequest(page_size=10)).size == 10  # every job's first page


def test_a_token_of_another_generation_or_beyond_the_job_is_refused():
    state = running(2)  # generation 1, 6 ranks
    msg = refusal(FailedPrecondition, status_pages.rank_page, state, None, page(page_token="g2r3"))
    assert "generation 2" in msg and "without a page_token" in msg
    assert "beyond the job's world size 6" in refusal(InvalidArgument, status_pages.rank_page, state, None,
                                                      page(page_token="g1r7"))
    assert status_pages.rank_page(state, None, page(page_token="g1r6")) == ([], "")


def test_a_finished_run_shows_its_outcome_and_no_live_phase():
    from dataclasses import replace

    from muster.coordinator.core.state import Outcome

    state = running(2)
    assert status_pages.job_status(state, "leader:1", 7, None, brief=True).phase == "running"
    ended = replace(state, outcome=Outcome.SUCCEEDED, outcome_reason="every rank completed its script")
    js = status_pages.job_status(ended, "", 7, None, brief=True)
    assert (js.outcome, js.phase) == ("succeeded", "ended")


def test_peer_snapshots_reported_in_a_frame_are_shown_by_status_per_rank_and_summed_in_its_table():
    from muster.cli.views import status_view as _status_view
    from muster.json_output import status_document

    state = running(2)
    lv = Liveness(TIMING, 0.0)
    mib = 1 << 20
    for i, p in enumerate(state.rank_map.placements):
        frame = pb.NodeFrame(ranks=[pb.RankReport(local_rank=s, pid=100 + s, step=5, state=pb.RANK_STATE_RUNNING,
                                                  snapshot_every=10 if i == 0 else 0,
                                                  snapshot_bytes=(s + 1) * mib if i == 0 else 0)
                                    for s in p.slots])
        lv.observe(p.node_id, state.generation, wire.check_frame_ranks(frame, state.member(p.node_id)), 0.0)
    status = status_pages.job_status(state, "127.0.0.1:7600", 7, lv)
    doc = status_document(pb.StatusResponse(jobs=[status]), "job")
    ranks = doc["jobs"][0]["ranks"]
    assert [(r["snapshot_every"], r["snapshot_bytes"]) for r in ranks] == [(10, mib), (10, 2 * mib), (10, 3 * mib)] + [
        (None, None)] * 3  # a rank without snapshots: null, as the JSON shape says "none"
    lines = _status_view(type("Args", (), {"json": False, "watch": False})(), "job", pb.StatusResponse(jobs=[status]))
    assert "  peer snapshots every 10 steps on 3 ranks shown: host memory 3.0 MiB on the rank holding most, 6.0 MiB " \
           "in all" in lines, lines
