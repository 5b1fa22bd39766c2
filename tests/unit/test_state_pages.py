"""A large state compressed in pages: what any zlib reader reads, and a change compresses only
the pages it changed."""

import zlib

import pytest

from muster.coordinator.core import state as state_module
from muster.coordinator.core.kinds import FailureKind
from muster.coordinator.core.machine import Context, Join, NodeLost, Tick, decide
from muster.coordinator.core.pages import PageCache, _adler_combine, split
from muster.coordinator.core.policy import JobSpec, Timing
from muster.coordinator.core.state import JobState, decode, encode

pytestmark = pytest.mark.timeout(60)


def ctx(now=0.0):
    return Context(now=now, wall_ms=1_700_000_000_000 + int(now * 1000), term=7, timing=Timing(last_call_s=1.0),
                   max_step=0, step_time_s=None)


def running(nodes: int, job: str) -> JobState:
    joins = [Join(f"node-{i:05d}", f"10.0.{i >> 8}.{i & 255}", 29500, 8) for i in range(nodes)]
    state = decide(JobState(job, JobSpec(1, nodes, 1)), joins, ctx()).state
    return decide(state, [Tick()], ctx(now=2.0)).state


def plain(state: JobState) -> bytes:
    """The state's JSON as an unpaged encoding writes it (every item joined at once)."""
    cut = state_module.COMPRESS_ABOVE
    state_module.COMPRESS_ABOVE = 1 << 62
    try:
        return encode(state)
    finally:
        state_module.COMPRESS_ABOVE = cut


def test_the_adler32_of_joined_texts_is_combined_from_theirs():
    texts = [b"", b"a", b"{\"members\":[", b"x" * 100_000, bytes(range(256)) * 300]
    for a in texts:
        for b in texts:
            assert _adler_combine(zlib.adler32(a), zlib.adler32(b), len(b)) == zlib.adler32(a + b)


def test_pages_cut_at_ids_so_a_lost_item_changes_its_own_page_only():
    ids = [f"node-{i:05d}" for i in range(20_000)]
    before = split(ids, ids)
    after = split(ids[:7000] + ids[7001:], ids[:7000] + ids[7001:])
    assert sum(map(len, before)) == 20_000 and len(before) > 5
    assert len(set(before) - set(after)) == 1 and len(set(after) - set(before)) == 1


def test_a_paged_state_is_one_zlib_stream_of_the_same_json_and_a_loss_recompresses_few_pages():
    state = running(3000, "paged")
    data = encode(state)
    assert zlib.decompress(data) == plain(state)  # any zlib reader, an older leader's included
    assert decode(data) == state
    cache = state_module._PAGE_CACHES["paged"]
    total = cache.compressed
    # the last node lost: its member page, and the placements' last page (nothing renumbered before it)
    victim = state.rank_map.placements[-1].node_id
    nxt = decide(state, [NodeLost(victim, FailureKind.NODE_SILENT, "silent")], ctx(now=3.0)).state
    again = encode(nxt)
    assert cache.compressed <= 4 < total
    assert decode(again) == nxt and zlib.decompress(again) == plain(nxt)
    # the same bytes as an encoding with nothing kept
    state_module._PAGE_CACHES.clear()
    assert encode(nxt) == again


def test_a_page_cache_ends_the_stream_for_any_parts():
    cache = PageCache()
    parts = ["{\"a\":[", [("1", "2"), ("3",)], "],\"b\":[", [], "]}"]
    assert zlib.decompress(cache.compress(parts)) == b'{"a":[1,2,3],"b":[]}'
    assert cache.compressed == 2 and zlib.decompress(cache.compress(parts)) == b'{"a":[1,2,3],"b":[]}'
    assert cache.compressed == 0
