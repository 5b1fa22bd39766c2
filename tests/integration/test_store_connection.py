"""A rank keeps its connection to the generation's store for the next generation on the same store.
Every new connection costs c10d a reverse-DNS lookup of the peer on each side (SocketImpl formats
the address with getnameinfo), the store host's in its one event-loop thread: one unanswered query
held every rank of a 16-rank generation 5 s (the resolver's timeout) in the arrival barrier. A kill
that leaves the store where it was now opens no connection to it."""

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from muster.worker.library.comm import Comm, GroupSpec, Superseded
from muster.worker.sockets import is_tcp, new_sockets, shutdown_peer_sockets, socket_inodes, store_connections
from muster.local import wait_until


def store(timeout_s: float = 30) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))


def connections(port: int) -> set[int]:
    """This process's connections to a store, by their local port (fd numbers are reused)."""
    import socket

    found = set()
    for fd in socket_inodes():
        s = socket.socket(fileno=fd)
        try:
            if is_tcp(s) and s.getpeername()[1] == port:
                found.add(s.getsockname()[1])
        except OSError:
            pass
        finally:
            s.detach()
    return found


def spec(generation: int, server: dist.TCPStore, world_size: int = 1) -> GroupSpec:
    return GroupSpec(generation, 0, world_size, 0, f"127.0.0.1:{server.port}", f"generation-{generation}")


@pytest.mark.timeout(60)
def test_the_next_generation_on_the_same_store_opens_no_connection_to_it():
    server = store()
    own = connections(server.port)  # the server object's own client
    comm = Comm("gloo", host_store=False, timeout_s=30)
    try:
        comm.form(spec(1, server), abandoned=lambda: False)
        first = connections(server.port) - own
        assert len(first) == 1
        for generation in (2, 3):
            comm.destroy()
            comm.form(spec(generation, server), abandoned=lambda: False)
            assert connections(server.port) - own == first, f"generation {generation} connected anew"
    finally:
        comm.destroy()


@pytest.mark.timeout(60)
def test_a_generation_on_another_store_closes_the_connection_to_the_previous_one():
    first, second = store(), store()
    comm = Comm("gloo", host_store=False, timeout_s=30)
    own = connections(first.port)
    try:
        comm.form(spec(1, first), abandoned=lambda: False)
        assert connections(first.port) - own
        comm.destroy()
        comm.form(spec(2, second), abandoned=lambda: False)
        assert connections(first.port) - own == set()
    finally:
        comm.destroy()


@pytest.mark.timeout(60)
def test_a_store_connection_an_abort_cut_while_forming_is_not_used_again():
    server = store()
    own = connections(server.port)
    comm = Comm("gloo", host_store=False, timeout_s=30)
    failed: list[BaseException] = []

    def form_alone_in_two():  # rank 1 never arrives: the barrier waits until the abort cuts it
        try:
            comm.form(spec(1, server, world_size=2), abandoned=lambda: False)
        except Exception as exc:
            failed.append(exc)

    forming = threading.Thread(target=form_alone_in_two)
    forming.start()
    try:
        arrivals = dist.PrefixStore("generation-1/", server)
        wait_until(lambda: arrivals.check(["arrived/0"]), 20, "rank 0 arrived", interval_s=0.01)
        cut = connections(server.port) - own
        comm.abort(2)
        forming.join(20)
        assert not forming.is_alive() and failed, "the barrier outlived the abort"
        comm.destroy()
        comm.form(spec(2, server), abandoned=lambda: False)
        now = connections(server.port) - own
        assert now and not now & cut, "generation 2 formed over the connection the abort shut down"
    finally:
        forming.join(20)
        comm.destroy()


@pytest.mark.timeout(60)
def test_a_generation_aborted_while_connecting_to_its_store_waits_on_nothing():
    """The abort came before the connection was registered for it to cut: no store wait may start
    (a stopped store host would hold it for the client's whole timeout)."""
    server = store()
    comm = Comm("gloo", host_store=False, timeout_s=30)
    comm.abort(2)
    with pytest.raises(Superseded):
        comm.form(spec(1, server, world_size=2), abandoned=lambda: False)  # rank 1 never arrives
    assert not dist.PrefixStore("generation-1/", server).check(["arrived/0"])


@pytest.mark.timeout(60)
def test_a_unix_socket_among_the_new_fds_is_no_store_connection():
    """Under `muster run` the rank's link to its agent is a unix socket, opened or reopened at any
    time: it is never taken for a connection of the store's, nor shut down by an abort."""
    import socket


    before = socket_inodes()
    a, b = socket.socketpair()
    try:
        found = new_sockets(before)
        assert set(found) == {a.fileno(), b.fileno()}
        assert store_connections(found, 29500) == {} and shutdown_peer_sockets(found, set()) == 0
        a.sendall(b"x")
        assert b.recv(1) == b"x"  # still open
    finally:
        a.close()
        b.close()


@pytest.mark.timeout(30)
def test_a_socket_that_reuses_an_old_descriptor_number_is_the_groups_and_an_old_one_is_left_alone():
    """A group's sockets are known by inode: one whose descriptor number an older socket had (an
    aborted group's sockets close whenever its last reference goes, possibly while the next group
    connects) is still found new, and so shut by the next abort; a number recorded for a socket
    since closed, and now another's, is not shut down."""
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    old = socket.create_connection(("127.0.0.1", port))
    old_peer, _ = listener.accept()
    before = socket_inodes()
    number = old.fileno()
    old.close()  # its number is free: the next socket takes it
    new = socket.create_connection(("127.0.0.1", port))
    new_peer, _ = listener.accept()
    try:
        assert new.fileno() == number
        found = new_sockets(before)
        assert number in found and new_peer.fileno() in found
        stale = {fd: inode for fd, inode in before.items() if fd == number}  # the closed socket, as recorded
        assert shutdown_peer_sockets(stale, set()) == 0
        new.sendall(b"x")
        assert new_peer.recv(1) == b"x"  # left alone
        assert shutdown_peer_sockets({number: found[number]}, set()) == 1
        assert new_peer.recv(1) == b""  # shut: its peer sees the end
    finally:
        for s in (new, new_peer, old_peer, listener):
            s.close()
