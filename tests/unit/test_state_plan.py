"""The state transfer's pure part: the plan every rank computes from the cards, the pieces the
state is cut into, and the skeleton that stands for it; the fingerprint's sensitivity."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from muster.worker.library.state import ReplicatedState, fingerprint
from muster.worker.library.transfer import Card, TensorRef, describe, flatten, paths, pieces, plan, unflatten

A, B, C = "a" * 32, "b" * 32, "c" * 32
L, M = "1" * 16, "2" * 16
CPU = torch.device("cpu")


def test_survivors_that_agree_move_nothing():
    p = plan([Card(7, A, L)] * 4)
    assert not p.moves and p.sources == (0, 1, 2, 3) and p.reference == Card(7, A, L)


def test_the_highest_step_wins_and_its_majority_sends():
    p = plan([Card(7, A, L), Card(8, B, L), Card(8, B, L), Card(8, C, L), Card(0, A, L)])
    assert p.reference == Card(8, B, L)
    assert p.sources == (1, 2) and p.receivers == (0, 3, 4) and p.incompatible == ()


def test_a_first_formation_takes_rank_zeros_state_unless_its_model_is_the_odd_one():
    assert plan([Card(0, A, L), Card(0, B, L), Card(0, C, L)]).sources == (0,)
    p = plan([Card(0, A, M), Card(0, B, L), Card(0, C, L)])
    assert p.sources == (1,) and p.receivers == (2,) and p.incompatible == (0,)


def test_a_joiner_with_another_layout_is_incompatible():
    p = plan([Card(5, A, L), Card(5, A, L), Card(0, B, M)])
    assert p.sources == (0, 1) and p.receivers == () and p.incompatible == (2,) and p.moves


@given(st.lists(st.tuples(st.integers(0, 3), st.sampled_from([A, B, C]), st.sampled_from([L, M])),
                min_size=1, max_size=12))
def test_every_rank_has_one_role_and_the_sources_hold_the_highest_step(raw):
    cards = [Card(*c) for c in raw]
    p = plan(cards)
    roles = [p.role(r) for r in range(len(cards))]
    assert sorted(p.sources + p.receivers + p.incompatible) == list(range(len(cards)))
    assert p.sources and all(cards[r] == p.reference for r in p.sources)
    assert p.reference.step == max(c.step for c in cards)
    assert roles.count("source") == len(p.sources)
    assert plan(cards) == p  # the same on every rank


def ref(i, n, on_device=True):
    return TensorRef(i, (n,), "uint8", 1, on_device)


def test_pieces_send_large_device_tensors_in_place_and_pack_the_rest():
    cut = pieces([ref(0, 10), ref(1, 2500), ref(2, 30), ref(3, 600, on_device=False)], bucket_bytes=1000,
                 direct_min=1000)
    direct = [c for c in cut if c.direct]
    assert [(c.nbytes, c.parts[0][1:3]) for c in direct] == [(1000, (0, 1000)), (1000, (1000, 2000)),
                                                               (500, (2000, 2500))]
    packed = [c for c in cut if not c.direct]
    assert all(c.nbytes <= 1000 for c in cut)
    covered = {}
    for c in packed:
        for index, a, b, off in c.parts:
            assert 0 <= off and off + b - a <= c.nbytes
            covered[index] = covered.get(index, 0) + b - a
    assert covered == {0: 10, 2: 30, 3: 600}


@given(st.lists(st.tuples(st.integers(0, 5000), st.booleans()), max_size=20), st.integers(64, 2048))
def test_pieces_cover_every_byte_once_within_a_bucket(sizes, bucket):
    refs = [ref(i, n, d) for i, (n, d) in enumerate(sizes)]
    seen = {i: [] for i in range(len(refs))}
    for c in pieces(refs, bucket_bytes=bucket, direct_min=bucket // 2):
        assert 0 < c.nbytes <= bucket
        for index, a, b, off in c.parts:
            seen[index].append((a, b))
    for i, (n, _) in enumerate(sizes):
        spans = sorted(seen[i])
        assert sum(b - a for a, b in spans) == n and all(x[1] == y[0] for x, y in zip(spans, spans[1:]))


def test_a_skeleton_flattens_in_a_fixed_order_and_back():
    t1, t2 = torch.ones(2), torch.zeros(3)
    leaves = []
    skeleton = flatten({"b": [t1, 0.5], "a": {"x": t2, "lr": (0.9, 0.99)}}, leaves)
    assert [p for p, _ in leaves] == ["/a/x", "/b/0"]
    refs = [TensorRef(i, tuple(t.shape), "float32", 4, True) for i, (_, t) in enumerate(leaves)]
    assert set(paths(describe(skeleton, refs))) == {"/a/x", "/b/0"}
    back = unflatten(skeleton, [t for _, t in leaves])
    assert back["b"][0] is t1 and back["a"]["x"] is t2 and back["a"]["lr"] == (0.9, 0.99)


def test_the_fingerprint_sees_one_bit_and_the_optimizer_and_extras():
    class Position:
        epoch = 0

        def state_dict(self):
            return {"epoch": self.epoch}

        def load_state_dict(self, s):
            self.epoch = s["epoch"]

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.Adam(model.parameters())
    state = ReplicatedState(model, opt, {"data": Position()})
    before = state.fingerprint(CPU)
    assert state.fingerprint(CPU) == before and len(before) == 16
    with torch.no_grad():
        model.weight.view(-1).view(torch.int32)[5] ^= 1
    flipped = state.fingerprint(CPU)
    assert flipped != before
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    stepped = state.fingerprint(CPU)
    assert stepped != flipped  # the moments appeared
    state.extras["data"].epoch = 1
    assert state.fingerprint(CPU) != stepped


def test_the_device_sums_see_a_swap_that_a_plain_sum_misses():
    from muster.worker.library.state import _device_sums
    a = torch.arange(100, dtype=torch.float32)
    b = a.clone()
    b[[3, 40]] = b[[40, 3]]
    assert _device_sums(a)[0] == _device_sums(b)[0] and not torch.equal(_device_sums(a), _device_sums(b))
    leaves = []
    skeleton = flatten({"t": a}, leaves)
    assert len(fingerprint(describe(skeleton, [TensorRef(0, (100,), "float32", 4, True)]), [a], CPU)) == 16
