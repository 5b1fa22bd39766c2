import pytest

from muster.testing import FakeClock
from muster.net import Backoff, join_host_port, split_host_port


def test_an_address_splits_into_a_bare_host_and_an_int_port():
    assert split_host_port("node-1:29500") == ("node-1", 29500)
    assert split_host_port("[::1]:0") == ("::1", 0)


@pytest.mark.parametrize("address", ["nonsense", ":80", "host:", "host:http", "host:65536"])
def test_anything_but_host_port_is_refused(address):
    with pytest.raises(ValueError, match="not HOST:PORT"):
        split_host_port(address)


def test_joining_brackets_an_ipv6_host_again():
    assert join_host_port("::1", 80) == "[::1]:80"
    assert join_host_port("10.0.0.1", 80) == "10.0.0.1:80"
    assert split_host_port(join_host_port("::1", 80)) == ("::1", 80)


def test_backoff_doubles_up_to_its_cap_with_jitter_below_twice_each_step():
    backoff = Backoff(0.05, 0.15)
    for step in (0.05, 0.1, 0.15, 0.15):
        assert step <= backoff.next() < 2 * step


def test_backoff_starts_over_when_reset():
    backoff = Backoff(0.05, 1.0)
    for _ in range(4):
        backoff.next()
    backoff.reset()
    assert 0.05 <= backoff.next() < 0.1


def test_backoff_starts_over_after_a_quiet_period_and_not_within_one():
    clock = FakeClock(0.0)
    backoff = Backoff(0.2, 5.0, reset_after_s=60.0, clock=clock)
    for step in (0.2, 0.4, 0.8):
        assert step <= backoff.next() < 2 * step
        clock.advance(59.0)  # each retry within the quiet period of the one before: still doubling
    clock.advance(2.0)  # 61 s since the last retry
    assert 0.2 <= backoff.next() < 0.4


def test_a_nodes_address_is_the_one_on_the_route_to_the_coordinator():
    import socket

    from muster.net import address_towards, is_loopback

    assert address_towards(["127.0.0.1:7600"]) == "127.0.0.1"  # a job on one machine
    assert is_loopback(address_towards(["localhost:7600"]))
    # a coordinator at this host's own (non-loopback) address, if it has one: reached from that address
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: a route, nothing sent
            own = s.getsockname()[0]
        except OSError:
            own = ""
    if own and not is_loopback(own):
        assert address_towards([f"{own}:7600"]) == own
    assert not is_loopback("10.0.0.1") and not is_loopback("coord.example") and is_loopback("::1")


def test_a_reserved_port_is_no_strangers_but_a_tcpstore_serves_on_it():
    """The torchrun backend's MASTER_PORT (a CI run: a port found free was bound by another server
    before the workers' TCPStore, EADDRINUSE): held, nothing else binds it, by name or as a pick of
    port 0, nor connects from it; the workers' store still serves on it, and once it is released the
    port is free."""
    import socket
    from datetime import timedelta

    import torch.distributed as dist

    from muster.net import reserve_port

    held = reserve_port("127.0.0.1")
    port = held.getsockname()[1]
    try:
        with socket.socket() as stranger, pytest.raises(OSError):
            stranger.bind(("127.0.0.1", port))
        picked = []
        for _ in range(200):
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("127.0.0.1", 0))
                picked.append(s.getsockname()[1])
        assert port not in picked
        store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
        store.set("master", "here")
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))
        assert client.get("master") == b"here"
        del client, store
    finally:
        held.close()
    with socket.socket() as s:  # (a closed connection of the store's may sit in TIME_WAIT on it)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
