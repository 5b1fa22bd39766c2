"""A process's own sockets, as the groups' aborts need them: which a generation's group opened
(known by inode, as descriptor numbers are reused), which reach the store, shutting down the
connected ones (gloo has no abort: a shut socket makes a collective blocked on a peer fail at
once), and which interface holds an address (gloo's device)."""

from __future__ import annotations

import fcntl
import os
import socket
import struct


def interface_of(address: str) -> str | None:
    """The network interface holding an IPv4 address, or None (a name, IPv6, not local)."""
    try:
        wanted = socket.inet_aton(address)
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                info = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
            except OSError:
                continue  # no IPv4 address on it
            if info[20:24] == wanted:
                return name
    return None


def socket_inodes() -> dict[int, str]:
    """This process's sockets: descriptor -> 'socket:[inode]'. A socket is known by its inode: a
    descriptor's number is reused as soon as it is closed (an old group's sockets close whenever its
    last reference goes, possibly while the next group connects), its inode is not."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:"):
            found[int(name)] = target
    return found


def new_sockets(before: dict[int, str]) -> dict[int, str]:
    """The sockets opened since `before` was taken (by any thread)."""
    known = set(before.values())
    return {fd: inode for fd, inode in socket_inodes().items() if inode not in known}


def is_tcp(s: socket.socket) -> bool:
    """A TCP socket (a unix one, e.g. the link to the agent, has no port to compare)."""
    return s.type == socket.SOCK_STREAM and s.family in (socket.AF_INET, socket.AF_INET6)


def store_connections(found: dict[int, str], store_port: int) -> dict[int, str]:
    """Among new sockets (other threads open some too), those connected to the store's port."""
    connections = {}
    for fd, inode in found.items():
        try:
            s = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            if is_tcp(s) and s.getpeername()[1] == store_port:
                connections[fd] = inode
        except OSError:
            pass
        finally:
            s.detach()
    return connections


def shutdown_peer_sockets(found: dict[int, str], keep_ports: set[int]) -> int:
    """Shut down connected sockets among `found` (never listeners: gloo's accept loop dies on those)."""
    done = 0
    for fd, inode in found.items():
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != inode:
                continue  # closed, its number reused by another socket or file
            s = socket.socket(fileno=fd)
        except OSError:
            continue  # closed already
        try:
            if not is_tcp(s):
                continue
            peer, local = s.getpeername(), s.getsockname()
            if peer[1] in keep_ports or local[1] in keep_ports:
                continue
            s.shutdown(socket.SHUT_RDWR)
            done += 1
        except OSError:
            pass  # not connected (a listener) or already shut
        finally:
            s.detach()  # the fd stays gloo's
    return done
