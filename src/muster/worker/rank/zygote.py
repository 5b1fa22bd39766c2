"""Warm starts: a per-node zygote that has imported torch once and forks each rank from there.

A rank restarted after a failure would otherwise pay the interpreter start and `import torch`
again (1.3-1.5 s of CPU on the 2-core development machine) before the script's first line; forked
from the zygote it reaches it in milliseconds. The zygote is the agent's child (through the exec
wrapper, so it dies with the agent), holds no threads, sockets or CUDA context of its own, and
forks before any of them exist. Each rank is its child: it dies with the zygote (PDEATHSIG) and
the zygote reports its exit status to the agent.

Only `PYTHON [-u] SCRIPT ARGS…` and `PYTHON [-u] -m MODULE ARGS…` with the agent's own interpreter
run warm (what `muster run -- torchrun …` starts is always one); any other command is executed as
before. The child sees what `python SCRIPT` would show it: its own environment, working directory,
stdio, `sys.argv`, `sys.path[0]` and `__main__` (the runner runs it, and marks its completion as
for a cold start); it ends as the interpreter ends it (non-daemon threads joined, atexit handlers
run, an uncaught exception printed and exit 1, the modules it imported torn down), save that what the
zygote imported is not torn down (`runner.end_forked`).

Protocol (a SOCK_SEQPACKET pair, one JSON message per packet): the agent's first message lists
modules to import after the preloaded ones (none for the first zygote); then it sends {"id",
"target", "module", "args", "unbuffered", "env", "cwd"} with the rank's stdin, stdout and stderr
as SCM_RIGHTS descriptors, or {"id", "successor": true} with one end of a new pair, on which the
forked successor reads its own first message and serves; the zygote answers {"id", "pid"} (or
{"id", "error"}), and {"exited": pid, "code": c, "cpu_s": s} when a child ends (c negative:
killed by signal -c, as asyncio reports it; s the CPU seconds it and the processes it reaped used).
A host's zygote (`muster zygote`, or one started with a listening socket) forks a zygote for each
agent that connects to its socket, which lives as long as that connection: the agent's first
message there is {"learned", "env", "cwd", "executable", "isolation"}, answered {"incompatible":
why} where its ranks would see another interpreter, module path, namespaces or cgroup.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import io
import json
import os
import selectors
import signal
import socket
import struct
import sys
from importlib import import_module
from pathlib import Path
from typing import NoReturn

import setproctitle
import structlog

from muster.worker.rank.runner import Program, command_line, end_forked, run

log = structlog.get_logger(__name__)

PR_SET_PDEATHSIG = 1
# What every rank of a DDP script imports; DDP's constructor imports torch._dynamo (1.2 s of CPU alone).
# And Muster's worker library, which a library rank imports first thing (200 modules with gRPC and
# protobuf: 0.2-0.5 s of CPU a rank on a slow host); a node of plain scripts pays it once, in its zygote.
PRELOAD = ("torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo", "muster.worker.library.api")
# What decides the module path a zygote imports from: an agent whose differ uses a zygote of its own.
PATH_ENV = ("PYTHONPATH", "PYTHONHOME", "PYTHONNOUSERSITE", "PYTHONSAFEPATH", "PYTHONPLATLIBDIR")
MAX_MESSAGE = 1 << 20  # a rank's argv and environment
MAX_LEARNED = 3000  # learned modules (~30 bytes each): the message fits a socket's default buffer
READY_WAIT_S = 120.0  # for the zygote's imports: a cold import of torch on a loaded node takes seconds
# For its answer to a fork (milliseconds): one that gives none (stopped, stuck) cannot report its
# ranks' exits either, so it is ended with them and the node starts ranks cold.
ANSWER_WAIT_S = 30.0
# Room in the zygote's argv for its ranks' process titles (setproctitle writes a title over the
# argv's memory; SPT_NOENV keeps it off the environment's, which /proc/PID/environ shows and tools
# read, e.g. a run's tag): a title longer than the zygote's command line with this is cut.
TITLE_ROOM = 2048


# ---- the zygote process ------------------------------------------------------------------


def main() -> None:
    """`python -m muster.worker.rank.zygote CHANNEL PRELOAD TITLE [LISTENER]`: CHANNEL the descriptor of
    the agent's end ("-" for none: a host's zygote, `muster zygote`), PRELOAD comma-separated,
    TITLE room for the ranks' process titles, LISTENER a listening socket's descriptor."""
    # setproctitle finds the argv memory it writes the ranks' titles to by walking from the C
    # environ, which a rank replaces: it must find it now, in the zygote's untouched environment.
    setproctitle.getproctitle()
    channel = socket.socket(fileno=int(sys.argv[1])) if sys.argv[1] != "-" else None
    listener = socket.socket(fileno=int(sys.argv[4])) if len(sys.argv) > 4 else None
    if channel is not None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the agent's: it drains the node
    else:  # a host's: SIGINT and SIGTERM end it (not the agents' zygotes it forked: they outlive it)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda number, _: sys.exit(128 + number))
    # No collection while importing: torch's imports make ~480k objects, and the passes they set off
    # cost a sixth of the zygote's start. What they leave as garbage (~9k objects) is frozen with the
    # rest (_serve): collecting it would walk all 480k again (0.5 s).
    gc.disable()
    for name in filter(None, sys.argv[2].split(",")):
        _preload(channel, name)
    zygote = os.getpid()
    try:
        _serve(channel, listener)  # (never in a rank: it ends in _become_rank)
    finally:
        if listener is not None and channel is None and os.getpid() == zygote:
            _unlink(listener.getsockname())


class _AgentGone(Exception):
    """The agent's end of the channel is closed: this zygote ends, and its ranks with it. (The
    agent's own zygote dies with it anyway; one a host's zygote forked learns it from the channel.)"""


def _serve(channel: socket.socket | None, listener: socket.socket | None = None) -> None:
    """Import the modules the agent's first message names, then fork what it asks for: a rank, or
    a successor (a zygote that imports more on top of this one's modules); and, with a listener, a
    zygote for each agent that connects (`_accept`). Returns when the agent is gone."""
    try:
        _serve_until_gone(channel, listener)
    except _AgentGone:
        pass


def _serve_until_gone(channel: socket.socket | None, listener: socket.socket | None) -> None:
    # Learned modules (the ranks' own imports: hundreds, so a message rather than argv) must leave
    # the process as fork-safe as the given ones did: no thread started, no CUDA. The first that
    # does not ends this zygote, unused; the agent forks the next one without it.
    hello = json.loads(_receive(channel)[0] or b"[]") if channel is not None else []
    if isinstance(hello, dict):  # an agent that connected to a host's zygote
        why = _adopt(hello)
        if why:
            _send(channel, {"incompatible": why})
            return
    learned = hello["learned"] if isinstance(hello, dict) else hello
    gc.disable()
    threads = _threads()
    for name in learned:
        _preload(channel, name)
        torch = sys.modules.get("torch")
        why = ("it starts a thread at import" if _threads() > threads else
               "it initialises CUDA at import" if torch is not None and torch.cuda.is_initialized() else None)
        if why:
            _send(channel, {"unsafe": name, "why": why})
            return
    # What the imports made lives as long as the ranks: out of the collector's reach (the permanent
    # generation, inherited by every fork), a rank's full collection no longer walks it (0.15 s in
    # a Trainer script's start, which calls gc.collect()) nor writes to its pages (copy-on-write).
    gc.freeze()
    gc.enable()  # for the ranks
    zygote = os.getpid()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the selector through the pipe
    _send(channel, {"ready": os.getpid()})
    with selectors.DefaultSelector() as selector:
        for source in (channel, listener, wake_r):
            if source is not None:
                selector.register(source, selectors.EVENT_READ)
        while True:
            for key, _ in selector.select():
                if key.fileobj == wake_r:
                    os.read(wake_r, 4096)
                    _reap(channel)
                    continue
                if key.fileobj is listener:
                    request, fds = {"successor": True, "agents": True}, _accept(listener)
                    if not fds:
                        continue
                else:
                    message, fds = _receive(channel)
                    if not message:
                        return  # the agent is gone (its ranks go with this process)
                    request = json.loads(message)
                try:
                    pid = os.fork()
                except OSError as exc:
                    _close(fds)
                    if "id" in request:
                        _send(channel, {"id": request["id"], "error": f"fork: {exc}"})
                    continue
                if pid == 0:
                    selector.close()
                    for fd in (wake_r, wake_w):
                        os.close(fd)
                    if listener is not None:
                        listener.close()
                    if request.get("successor"):
                        # An agent's, forked by a host's zygote, lives as long as its agent: losing
                        # or restarting the host's ends no rank of any job.
                        _become_successor(channel, fds, None if request.get("agents") else zygote)
                        # a zygote has nothing to flush; a thread an unsafe import started is no reason to wait
                        os._exit(0)
                    _become_rank(channel, request, fds, zygote)  # (never returns: the rank ends there)
                _close(fds)
                if "id" in request:
                    _send(channel, {"id": request["id"], "pid": pid})


def _accept(listener: socket.socket) -> list[int]:
    """An agent's connection to a host's zygote, as the descriptor its zygote serves on; none from
    another user (the socket's mode keeps them out already) or when the accept failed."""
    try:
        conn, _ = listener.accept()
    except OSError:
        return []
    uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[1]
    if uid != os.getuid():
        conn.close()
        return []
    return [conn.detach()]


def _adopt(hello: dict) -> str:
    """An agent's zygote forked from a host's: take the agent's environment and directory, as its
    own zygote would have started with them. What the ranks would see differently is refused (the
    agent then starts its own): another interpreter or module path, or other namespaces or cgroup
    (a node in a network namespace of its own: its ranks must be in it too)."""
    if hello.get("executable") != sys.executable:
        return f"it runs {sys.executable}, the agent {hello.get('executable')}"
    env = hello.get("env", {})
    for name in PATH_ENV:
        if env.get(name) != os.environ.get(name):
            return f"its {name} is {os.environ.get(name)!r}, the agent's {env.get(name)!r}"
    if hello.get("isolation") != isolation():
        return "the agent runs in other namespaces or another cgroup"
    os.environ.clear()
    os.environ.update(env)
    os.chdir(hello["cwd"])
    sys.path[0] = hello["cwd"]  # as `python -m` from there has it
    return ""


def isolation() -> dict[str, str]:
    """What a process's children inherit of where it runs: its namespaces and its cgroup."""
    found = {}
    for ns in ("net", "mnt", "pid", "ipc", "uts", "user", "cgroup"):
        try:
            found[f"ns/{ns}"] = os.readlink(f"/proc/self/ns/{ns}")
        except OSError:
            pass
    try:
        found["cgroup"] = Path("/proc/self/cgroup").read_text()
    except OSError:
        pass
    return found


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _preload(channel: socket.socket | None, name: str) -> None:
    try:
        import_module(name)
    except Exception as exc:  # the script will meet (and report) the same error itself
        _send(channel, {"preload_failed": name, "error": f"{type(exc).__name__}: {exc}"})


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _reap(channel: socket.socket | None) -> None:
    while True:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(channel, {"exited": pid, "code": os.waitstatus_to_exitcode(status),
                        "cpu_s": round(usage.ru_utime + usage.ru_stime, 3)})


def _become_successor(channel: socket.socket | None, fds: list[int], zygote: int | None) -> None:
    """In the forked child: a zygote of its own on the channel the agent passed, which imports the
    learned modules on top of this one's (torch is loaded already) and dies with it (with `zygote`
    None: only with the agent's channel). Returns when the agent is gone (its ranks never return)."""
    if channel is not None:
        channel.close()
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as its agent's own zygote (a host's zygote's child)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if zygote is not None:
        _die_with(zygote)
    _close(fds[1:])
    _serve(socket.socket(fileno=fds[0]))


def _die_with(zygote: int) -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != zygote:
        os._exit(1)  # the zygote died before prctl took effect


def _become_rank(channel: socket.socket, request: dict, fds: list[int], zygote: int) -> NoReturn:
    """In the forked child: take the rank's stdio, environment and directory, then run it and end."""
    inherited = frozenset(sys.modules)
    channel.close()
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _die_with(zygote)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    _close([fd for fd in fds if fd > 2])
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    _fresh_stdio(request["unbuffered"] or bool(os.environ.get("PYTHONUNBUFFERED")))
    if "torch" in sys.modules and os.environ.get("OMP_NUM_THREADS", "").isdigit():
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # read at import otherwise
    _fresh_random()
    program = Program(request["target"], request["module"], tuple(request["args"]), request["unbuffered"])
    # Else `ps`, `top`, `nvidia-smi` and `pgrep -f SCRIPT` show every rank as the zygote (its argv's
    # memory, TITLE_ROOM; /proc/PID/environ still shows the zygote's: docs/operations/observing.md).
    setproctitle.setproctitle(" ".join(command_line(program)))
    try:
        run(program)
    except BaseException as exc:  # (SystemExit and KeyboardInterrupt too: the interpreter's exit takes them)
        end_forked(exc, inherited)
    end_forked(None, inherited)


def _fresh_random() -> None:
    """Random state as a new interpreter has it. `random` reseeds itself at a fork; numpy's global
    generator and torch's default one, each seeded from the OS at its import, would otherwise be
    the zygote's in every rank: the same draws on every rank of the node and at every restart."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.default_generator.seed()  # (the CPU one: the zygote never started CUDA)


def _fresh_stdio(unbuffered: bool) -> None:
    """stdio objects for the new descriptors 0-2, buffered as the interpreter would buffer them."""
    for name, fd, mode in (("stdin", 0, "r"), ("stdout", 1, "w"), ("stderr", 2, "w")):
        old = getattr(sys, name)
        if mode == "r":
            stream = open(fd, "r", closefd=False, encoding=old.encoding, errors=old.errors)
        elif unbuffered:
            stream = io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=old.encoding, errors=old.errors,
                                      write_through=True)
        else:  # stderr is line-buffered; stdout too on a terminal, else block-buffered
            stream = open(fd, "w", buffering=-1, closefd=False, encoding=old.encoding, errors=old.errors,
                          newline=None)
            if name == "stderr" or os.isatty(fd):
                stream.reconfigure(line_buffering=True)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _send(channel: socket.socket | None, message: dict) -> None:
    if channel is not None:  # (a host's zygote answers nobody: its children's exits are its own business)
        try:
            channel.send(json.dumps(message).encode())
        except ConnectionError:
            raise _AgentGone from None


def _receive(channel: socket.socket) -> tuple[bytes, list[int]]:
    """The agent's next message and the descriptors it passed; b"" once it is gone."""
    try:
        message, fds, _, _ = socket.recv_fds(channel, MAX_MESSAGE, 3)
    except ConnectionError:  # it closed with a message of ours unread
        return b"", []
    return message, fds


def _close(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


# ---- the agent's side ---------------------------------------------------------------------


class ZygoteLost(Exception):
    """The zygote is gone or did not start: start ranks cold."""


class WarmProcess:
    """A rank forked by the zygote, as the agent sees a subprocess: pid, returncode, wait(),
    terminate(), kill(), send_signal()."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None
        self._exited = asyncio.get_running_loop().create_future()

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def _ended(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self._exited.set_result(code)


class Zygote:
    """The agent's handle on its node's zygote."""

    def __init__(self, channel: socket.socket, process: asyncio.subprocess.Process | WarmProcess | None):
        self._channel = channel
        self.process = process  # None: forked by a host's zygote, it ends when its channel closes
        self._next_id = 0
        self._pending: dict[int, asyncio.Future] = {}
        self._ranks: dict[int, WarmProcess] = {}
        self._ready = asyncio.get_running_loop().create_future()
        self.lost = False
        self.retiring = False  # a successor serves new ranks: this one ends with its last rank
        self.unsafe: tuple[str, str] | None = None  # a learned module it refused, and why
        self.failed: list[str] = []  # modules whose import failed in it
        self.reaped_cpu_s = 0.0  # the CPU seconds of its ranks that ended (and of what they reaped)
        asyncio.get_running_loop().add_reader(channel.fileno(), self._on_readable)

    @classmethod
    async def start(cls, env: dict[str, str], guard: list[str], preload: tuple[str, ...] = PRELOAD,
                    listener: socket.socket | None = None) -> Zygote:
        """A new zygote, the agent's child through `guard`; with `listener` (a listening Unix
        socket) it also forks a zygote for each agent that connects there, as a host's does."""
        agent_end, zygote_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listening = [str(listener.fileno())] if listener is not None else []
        try:
            process = await asyncio.create_subprocess_exec(
                *guard, sys.executable, "-m", "muster.worker.rank.zygote", str(zygote_end.fileno()), ",".join(preload),
                " " * TITLE_ROOM, *listening, env={**env, "SPT_NOENV": "1"},
                pass_fds=(zygote_end.fileno(), *map(int, listening)), stdin=asyncio.subprocess.DEVNULL)
        finally:
            zygote_end.close()
        agent_end.setblocking(False)
        agent_end.send(b"[]")  # no learned modules yet (read after its imports; fork_successor's are)
        return cls(agent_end, process)

    @classmethod
    async def connect(cls, path: str, env: dict[str, str], preload: tuple[str, ...] = PRELOAD) -> Zygote:
        """The node's zygote forked by the host's zygote listening at `path` (`muster zygote`),
        importing `preload` on top of its modules with `env` as its environment, once it is ready:
        in milliseconds, not the seconds of a new interpreter's imports. It is not the agent's
        child: it ends when the agent's end of its channel closes (the agent's exit included), and
        its ranks with it; the host's zygote ending ends neither. Raises OSError where nothing
        listens there, ZygoteLost where the host's zygote cannot stand in for the agent's own
        (`_adopt`) or does not answer."""
        channel = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            channel.setblocking(False)
            await asyncio.get_running_loop().sock_connect(channel, path)
            channel.send(json.dumps({"learned": list(preload), "env": env, "cwd": os.getcwd(),
                                     "executable": sys.executable, "isolation": isolation()}).encode())
        except BaseException:
            channel.close()
            raise
        zygote = cls(channel, None)
        try:
            await zygote.ready()
        except BaseException:
            zygote.close()
            raise
        return zygote

    async def ready(self, timeout_s: float = READY_WAIT_S) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(self._ready), timeout_s)
        except TimeoutError:
            self.close()
            raise ZygoteLost(f"its imports took longer than {timeout_s:g}s") from None

    async def spawn(self, program: Program, env: dict[str, str], stdio: tuple[int, int, int],
                    answer_wait_s: float = ANSWER_WAIT_S, cwd: str | None = None) -> WarmProcess:
        """Fork a rank running `program` with `env` and these descriptors as its stdin, stdout, stderr,
        in `cwd` (this process's by default)."""
        return await self._fork({"target": program.target, "module": program.module, "args": program.args,
                                 "unbuffered": program.unbuffered, "env": env, "cwd": cwd or os.getcwd()},
                                list(stdio), answer_wait_s)

    async def fork_successor(self, learned: tuple[str, ...]) -> Zygote:
        """A zygote forked from this one that imports `learned` on top of its modules (a new
        interpreter would import torch again: seconds of CPU); it dies with this one."""
        agent_end, zygote_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            agent_end.send(json.dumps(list(learned)).encode())  # into an empty buffer: its first read
            process = await self._fork({"successor": True}, [zygote_end.fileno()], ANSWER_WAIT_S)
        except BaseException:
            agent_end.close()
            raise
        finally:
            zygote_end.close()
        agent_end.setblocking(False)
        return Zygote(agent_end, process)

    async def _fork(self, request: dict, fds: list[int], answer_wait_s: float) -> WarmProcess:
        await self.ready()
        if self.lost:
            raise ZygoteLost("it exited")
        self._next_id += 1
        request_id = self._next_id
        answer = self._pending[request_id] = asyncio.get_running_loop().create_future()
        message = json.dumps({"id": request_id, **request}).encode()
        try:
            socket.send_fds(self._channel, [message], fds)
        except OSError as exc:
            self._pending.pop(request_id, None)
            self._lose(f"send: {exc}")
            raise ZygoteLost(str(exc)) from None
        try:
            reply = await asyncio.wait_for(answer, answer_wait_s)
        except TimeoutError:
            self._pending.pop(request_id, None)
            self.close()
            raise ZygoteLost(f"no answer to a fork in {answer_wait_s:g}s") from None
        if "error" in reply:
            raise ZygoteLost(reply["error"])
        return reply["rank"]

    def _on_readable(self) -> None:
        while True:
            try:
                message = self._channel.recv(MAX_MESSAGE)
            except BlockingIOError:
                return
            except OSError as exc:
                self._lose(str(exc))
                return
            if not message:
                self._lose("it exited")
                return
            m = json.loads(message)
            if "exited" in m:
                self.reaped_cpu_s += m["cpu_s"]
                rank = self._ranks.pop(m["exited"], None)
                if rank is not None:
                    rank._ended(m["code"])
                if self.retiring and not self._ranks:
                    self.close()
                    return
            elif "id" in m:
                if "pid" in m:  # known before the next message is read, which may be its exit already
                    m["rank"] = self._ranks[m["pid"]] = WarmProcess(m["pid"])
                future = self._pending.pop(m["id"], None)
                if future is not None and not future.done():
                    future.set_result(m)
            elif "ready" in m:
                if not self._ready.done():
                    self._ready.set_result(m["ready"])
            elif "preload_failed" in m:
                self.failed.append(m["preload_failed"])
                log.warning("warm_start_preload_failed", module=m["preload_failed"], error=m["error"])
            elif "unsafe" in m:
                self.unsafe = (m["unsafe"], m["why"])
            elif "incompatible" in m:
                self._lose(m["incompatible"], quiet=True)  # the agent says what it does instead
                return

    def _lose(self, why: str, *, quiet: bool = False) -> None:
        """The zygote is gone: so are its ranks (PDEATHSIG). Each is reported killed."""
        if self.lost:
            return
        self.lost = True
        if not quiet:
            log.warning("warm_start_lost", why=why, ranks=len(self._ranks))
        asyncio.get_running_loop().remove_reader(self._channel.fileno())
        self._channel.close()
        for future in self._pending.values():
            if not future.done():
                future.set_result({"error": f"the zygote is gone ({why})"})
        if not self._ready.done():
            self._ready.set_exception(ZygoteLost(why))
            self._ready.exception()  # retrieved: ready() raises its own
        for rank in self._ranks.values():
            rank._ended(-signal.SIGKILL)
        self._ranks.clear()

    def close(self) -> None:
        self._lose("closed by the agent", quiet=True)
        if self.process is not None and self.process.returncode is None:
            self.process.kill()

    def retire(self) -> None:
        """A successor serves new ranks: end with the last of this one's (now, if it has none)."""
        self.retiring = True
        if not self._ranks:
            self.close()


class WarmStarts:
    """The node's zygote, and its successors: a rank reports the installed modules it imported
    (the runner, IMPORTS_FILE_ENV), and a zygote forked from the first that imported them too
    takes over for later starts, so a restart skips the script's heavy imports (transformers,
    accelerate, ...) as it skips torch's. A module that would leave the zygote unsafe to fork (a
    thread, CUDA) is named once and left to the ranks; the zygote serving ranks is never changed in
    place. The first zygote stays, idle once its own ranks end, to fork each successor (sharing its
    pages); a later one ends with its last rank once it is succeeded."""

    def __init__(self, env: dict[str, str], guard: list[str], preload: tuple[str, ...], host_zygote: str = ""):
        self.env, self.guard, self.preload = env, guard, tuple(preload)
        self.host_zygote = host_zygote  # a host's zygote's socket, to fork the first zygote from
        self.learned: tuple[str, ...] = ()
        self.refused: set[str] = set()
        self.first: Zygote | None = None
        self.zygote: Zygote | None = None  # the one serving new ranks
        self._retired: list[Zygote] = []  # successors succeeded in turn, still serving their ranks
        self._learning: asyncio.Task | None = None

    async def start(self) -> None:
        if self.host_zygote:
            try:
                zygote = await Zygote.connect(self.host_zygote, self.env, self.preload)
            except (OSError, ZygoteLost) as exc:
                log.warning("warm_start_host_zygote_refused", socket=self.host_zygote, why=str(exc) or type(exc).__name__,
                            message="the node starts a zygote of its own")
            else:
                self.first = self.zygote = zygote
                log.info("warm_start_host_zygote", socket=self.host_zygote)
                return
        self.first = self.zygote = await Zygote.start(self.env, self.guard, self.preload)

    async def ready(self) -> None:
        """Until the serving zygote's imports are done (bounded); a lost one is the next spawn's to say."""
        if self.zygote is not None:
            try:
                await self.zygote.ready()
            except ZygoteLost:
                pass

    async def spawn(self, program: Program, env: dict[str, str], stdio: tuple[int, int, int]) -> WarmProcess:
        if self.zygote is None:
            raise ZygoteLost("closed")
        return await self.zygote.spawn(program, env, stdio)

    def learn(self, modules: list[str]) -> None:
        """A rank imported these: a successor imports the new ones (one successor at a time, and
        at most MAX_LEARNED modules in all: the list is one message to the zygote)."""
        known = set(self.preload) | set(self.learned) | self.refused
        new = [m for m in modules if m not in known][:MAX_LEARNED - len(self.learned)]
        if new and self.zygote is not None and (self._learning is None or self._learning.done()):
            self._learning = asyncio.ensure_future(self._succeed(new))

    async def _succeed(self, new: list[str]) -> None:
        want = [*self.learned, *new]
        while want and self.first is not None:
            try:
                successor = await self.first.fork_successor(tuple(want))
            except ZygoteLost as exc:
                log.warning("warm_start_learning_failed", modules=len(want), why=str(exc))
                return
            try:
                await successor.ready()
            except ZygoteLost as exc:
                if successor.unsafe is None:
                    log.warning("warm_start_learning_failed", modules=len(want), why=str(exc))
                    return
                name, why = successor.unsafe
                self.refused.add(name)
                want.remove(name)
                log.warning("warm_start_preload_refused", module=name, why=why, message="left to each rank to import")
                continue
            except BaseException:
                successor.close()
                raise
            self.refused.update(successor.failed)
            self.learned = tuple(m for m in want if m not in successor.failed)
            if self.zygote is None:  # closed meanwhile
                successor.close()
                return
            previous, self.zygote = self.zygote, successor
            if previous is not self.first:
                previous.retire()
                self._retired = [z for z in [*self._retired, previous] if not z.lost]
            log.info("warm_start_learned", modules=len(self.learned),
                     packages=sorted({m.split(".")[0] for m in self.learned})[:32])
            return

    def close(self) -> None:
        if self._learning is not None:
            self._learning.cancel()
        for zygote in [*self._retired, self.zygote, self.first]:
            if zygote is not None:
                zygote.close()
        self.first, self.zygote, self._retired = None, None, []


if __name__ == "__main__":
    main()
