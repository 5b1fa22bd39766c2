"""`muster zygote`: the host's zygote. It imports torch once and forks a zygote for each node agent
started on this host with `muster run --zygote-socket PATH`, which then has its ranks warm at once
rather than after a new interpreter's imports (seconds; tens of seconds from a network filesystem):
an agent restarted after a crash or an upgrade, or the next job's."""

from __future__ import annotations

import argparse
import os
import socket
import stat
import sys

from muster.worker.rank.zygote import PRELOAD, TITLE_ROOM


def command(args: argparse.Namespace) -> int:
    path = os.path.abspath(args.socket)
    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as probe:
                try:
                    probe.connect(path)
                except ConnectionRefusedError:
                    os.unlink(path)  # a stale one: its zygote is gone
                else:
                    print(f"muster zygote: a zygote already listens at {path}", file=sys.stderr)
                    return 1
        else:
            print(f"muster zygote: {path} exists and is not a socket", file=sys.stderr)
            return 2
    except FileNotFoundError:
        pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    umask = os.umask(0o177)  # 0600: forking a zygote runs code as this user, so only this user may ask
    try:
        listener.bind(path)
    except OSError as exc:
        print(f"muster zygote: --socket {path}: {exc.strerror}", file=sys.stderr)
        return 2
    finally:
        os.umask(umask)
    listener.listen(64)
    listener.set_inheritable(True)
    print(f"muster zygote: pid {os.getpid()} listening at {path} (importing {args.preload})", file=sys.stderr,
          flush=True)
    # This process becomes the zygote: a new interpreter holding nothing of the CLI's (no gRPC, no threads).
    os.execve(sys.executable, [sys.executable, "-m", "muster.worker.rank.zygote", "-", args.preload, " " * TITLE_ROOM,
                               str(listener.fileno())], {**os.environ, "SPT_NOENV": "1"})


def add_parser(sub) -> None:
    z = sub.add_parser("zygote", help="the host's zygote: imports torch once for every `muster run --zygote-socket` "
                                      "on this host")
    z.add_argument("--socket", required=True, metavar="PATH",
                   help="the Unix socket to listen at (made 0600: only this user's agents are served)")
    z.add_argument("--preload", default=",".join(PRELOAD), metavar="MODULES",
                   help="modules imported once, comma-separated (default %(default)s; never one that initialises "
                        "CUDA); each agent's --preload is imported on top")
    z.set_defaults(func=command, verb="zygote")
