"""What a rank reads from a generation's store or a peer's bytes is data it checks, never code
(security review 5, H1): the skeleton's closed format round-trips real training state and refuses
anything else by name; a store value without the generation's seal is refused; stores listen on the
node's address, not on every interface."""

from __future__ import annotations

import os
import pickle
from datetime import timedelta

import numpy
import pytest
import torch

from muster.worker.library.snapshot_ring import Snapshot, pack
from muster.worker.library.transfer import SkeletonRefused, TensorRef, decode, describe, encode, flatten
from muster.worker.store import Seal, StoreTampered, serve, serve_soon


class RunsCode:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def described(tree):
    leaves: list = []
    skeleton = flatten(tree, leaves)
    refs = [TensorRef(i, tuple(t.shape), str(t.dtype).removeprefix("torch."), t.element_size(), False)
            for i, (_, t) in enumerate(leaves)]
    return describe(skeleton, refs)


def training_state():
    """A model, AdamW after a step, an LR scheduler, a grad scaler's and RNG states: what extras hold."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    return {"model": model.state_dict(), "optimizer": opt.state_dict(),
            "extras": {"sched": sched.state_dict(), "plateau": plateau.state_dict(), "rng": torch.get_rng_state(),
                       "np_rng": numpy.random.get_state(), "data": {"samples": 320, 7: b"\x00\xff", "big": 1 << 70,
                                                                   "nan": float("nan"), "pos": numpy.int64(5)}}}


def same(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, numpy.ndarray):
        return a.dtype == b.dtype and numpy.array_equal(a, b)
    if isinstance(a, float) and a != a:
        return b != b
    return type(a) is type(b) and a == b


def test_real_training_state_round_trips_exactly():
    d = described(training_state())
    assert same(decode(encode(d)), d)
    assert encode(decode(encode(d))) == encode(d)  # canonical: equal states fingerprint equally


def test_a_value_the_format_lacks_is_refused_by_its_path():
    with pytest.raises(SkeletonRefused, match=r"the state at /extras/x/fn holds a builtins.function"):
        encode({"extras": {"x": {"fn": lambda: 0}}})


def test_a_pickle_or_any_other_foreign_bytes_never_run(tmp_path):
    marker = tmp_path / "ran"
    for hostile in (pickle.dumps({"model": RunsCode(str(marker))}), b"{" * 100_000, b'{"x": 1}', b'{"T": [0]}',
                    b'{"T": [0, [2], "load", 8, false]}', b'{"T": [0, [-1], "float32", 4, false]}',
                    b'{"T": [0, [2], "float32", 8, false]}', b'[{"T": [1, [2], "float32", 4, false]}]',
                    b'{"n": ["|O", [1], "AA==", false]}', b'{"d": [[[1], 2]]}', b"\xff\xfe"):
        with pytest.raises(SkeletonRefused):
            decode(hostile)
    assert not marker.exists()


def test_a_snapshot_whose_head_lies_about_its_size_is_refused():
    snap = pack({"w": torch.arange(6, dtype=torch.float32)}, step=3)
    assert torch.equal(snap.tree()["w"], torch.arange(6, dtype=torch.float32))
    short = Snapshot(3, snap.data, snap.nbytes - 4)
    with pytest.raises(SkeletonRefused, match="its tensors need"):
        short.tree()
    lying = snap.data.clone()
    lying[:8].view(torch.int64).fill_(1 << 40)
    with pytest.raises(SkeletonRefused, match="a skeleton of"):
        Snapshot(3, lying, snap.nbytes).tree()


def test_a_store_value_is_taken_only_with_its_generations_seal_for_its_own_key():
    seal = Seal(b"k" * 32, "muster/j/g2-abc")
    sealed = seal.seal("state/card/0", "5 ff aa")
    assert seal.open("state/card/0", sealed) == b"5 ff aa"
    for key, value in (("state/card/0", b"5 ff aa"),  # written raw, as by any store client
                       ("state/card/1", sealed),  # another key's sealed value, replayed
                       ("state/card/0", sealed[:-1] + b"b"),
                       ("state/card/0", b"")):
        with pytest.raises(StoreTampered, match="without this generation's seal"):
            seal.open(key, value)
    with pytest.raises(StoreTampered):  # another generation's key
        Seal(b"q" * 32, "muster/j/g2-abc").open("state/card/0", sealed)


def listening_address(port: int) -> str:
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in list(f)[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:  # LISTEN
                    return address
    raise AssertionError(f"nothing listens on {port}")


def test_a_store_listens_on_the_nodes_address_not_every_interface():
    store = serve("127.0.0.1", timedelta(seconds=5))
    assert listening_address(store.port) == "0100007F"  # 127.0.0.1, not 00000000
    client = torch.distributed.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=5))
    client.set("a", "b")
    assert store.get("a") == b"b"


def test_a_nodes_store_made_on_a_thread_listens_on_its_port_before_it_is_made_and_serves_from_then():
    """An agent's store (`serve_soon`): the port goes into the node's Join at once; a client that
    connects before the TCPStore takes the socket over waits in the backlog, and is served."""
    port, made = serve_soon("127.0.0.1", timedelta(seconds=5))
    assert listening_address(port) == "0100007F"  # listening as it returns, on the node's address
    client = torch.distributed.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))
    client.set("a", "b")
    store = made.result(timeout=5)
    assert store.port == port and store.get("a") == b"b"
