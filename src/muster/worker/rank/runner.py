"""`python -m muster.worker.rank.runner SCRIPT ARGS…` (or `… -m MODULE ARGS…`): run a rank's Python
program as `python SCRIPT` (`python -m MODULE`) would, and tell its agent the moment the program
completed, before interpreter teardown begins.

A script whose `__main__` returned (or that raised SystemExit with status 0 or None) has done its
work, whatever its process does next: torch and gloo destructors abort (SIGABRT) or hang in
teardown, and its agent must count the rank as finished, never run it again. The mark is a file
the agent names in $MUSTER_COMPLETED_FILE (in its private directory): created before teardown, it
survives a SIGKILL or an abort that follows. An uncaught exception or another exit status is no
completion. The warm-start zygote runs its ranks through `run` too. Where the agent asks for it, the
runner also installs the step probe (`step_probe`): the script's steps and compute time, unmodified.
It always installs `group_end`: the script's destroy_process_group() frees its group without gloo's
deadlock, and says that its collective work is done, should its process freeze before __main__ returns.
An uncaught exception is written to torch's error file as @record writes it, with the step it was
raised in where the library knows it: the agent reports both with the exit.

The program sees what `python SCRIPT` shows it: `sys.argv`, `sys.path[0]`, `__main__`, its exit
status, and an uncaught exception's traceback without this module's or runpy's frames.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import json
import os
import runpy
import shutil
import signal
import sys
import threading
import time
import traceback
import types
import weakref
from dataclasses import dataclass
from typing import NoReturn

from muster.worker.rank import group_end, step_probe

COMPLETED_FILE_ENV = "MUSTER_COMPLETED_FILE"
# Where the rank writes the installed modules it imported, for the warm-start zygote to learn.
IMPORTS_FILE_ENV = "MUSTER_IMPORTS_FILE"
IMPORTS_AFTER_ENV = "MUSTER_IMPORTS_AFTER"  # seconds after its start (default IMPORTS_AFTER_S)
IMPORTS_AFTER_S = 20.0  # a script's imports are done by then, short of a very slow start
_RUNPY_FILE = runpy.run_path.__code__.co_filename  # "<frozen runpy>" on 3.11
KEPT_MODULE = "__muster_program__"  # holds the program's globals until teardown (`_keep`)


@dataclass(frozen=True)
class Program:
    """A command the runner (and the zygote) can run: a script or a module under the agent's own
    interpreter."""

    target: str  # the script's path, or the module's name
    module: bool
    args: tuple[str, ...]
    unbuffered: bool


def python_program(argv: tuple[str, ...] | list[str], executable: str = sys.executable) -> Program | None:
    """`argv` as a Program, or None: it must be executed as it is (another interpreter or program,
    options that change how Python starts)."""
    if len(argv) < 2:
        return None
    found = shutil.which(argv[0])
    if found is None or not same_interpreter(found, executable):
        return None  # another interpreter (or venv): its own imports, its own site-packages
    unbuffered, i = False, 1
    while i < len(argv) and argv[i] == "-u":
        unbuffered, i = True, i + 1
    if i < len(argv) and argv[i] == "-m" and i + 1 < len(argv):
        return Program(argv[i + 1], True, tuple(argv[i + 2:]), unbuffered)
    if i < len(argv) and not argv[i].startswith("-"):
        return Program(argv[i], False, tuple(argv[i + 1:]), unbuffered)
    return None


def same_interpreter(path: str, executable: str) -> bool:
    """`path` is `executable` by another name in its directory: a venv's `python` beside the
    `python3` a pip-installed `muster` runs under (the same binary, and the same venv, which the
    directory decides, reached by whatever path: a venv behind a symlinked directory is that venv).
    The same binary elsewhere is another environment."""
    return (os.path.realpath(os.path.dirname(os.path.abspath(path)))
            == os.path.realpath(os.path.dirname(os.path.abspath(executable)))
            and os.path.realpath(path) == os.path.realpath(executable))


def command_line(program: Program, executable: str = sys.executable) -> list[str]:
    """`program` as the command that runs it without the runner: what `ps` shows of a warm rank."""
    return [executable, *(["-u"] if program.unbuffered else []), *(["-m"] if program.module else []),
            program.target, *program.args]


def runner_argv(program: Program, executable: str = sys.executable) -> list[str]:
    """The command line that runs `program` through this module (a cold start)."""
    return [executable, *(["-u"] if program.unbuffered else []), "-m", __name__,
            *(["-m"] if program.module else []), program.target, *program.args]


def run(program: Program) -> None:
    """Run `program` as __main__ in this process; mark its completion for the agent."""
    marker = os.environ.pop(COMPLETED_FILE_ENV, "")  # the program's own children have no say
    pid = os.getpid()  # a child the program forks that returns through here completes nothing
    imports_file = os.environ.pop(IMPORTS_FILE_ENV, "")
    after_s = float(os.environ.pop(IMPORTS_AFTER_ENV, "") or IMPORTS_AFTER_S)
    timer = threading.Timer(after_s, _record_imports, (imports_file, _modules())) if imports_file else None
    if timer is not None:
        timer.daemon = True
        timer.start()
    step_probe.attach(os.environ.pop(step_probe.STEP_FILE_ENV, ""))
    group_end.attach(f"{marker}{group_end.ENDED_SUFFIX}" if marker else "")
    sys.argv = [program.target, *program.args]
    try:
        _run(program, marker, pid)
    finally:
        group_end.close()
        if timer is not None:  # gone before teardown: a live (daemon) thread changes what finalization frees
            timer.cancel()
            timer.join()


def _run(program: Program, marker: str, pid: int) -> None:
    try:
        if program.module:
            sys.path[0] = os.getcwd()
            namespace = runpy.run_module(program.target, run_name="__main__", alter_sys=True)
        else:
            # absolute, as `python SCRIPT` makes __file__ and its tracebacks (argv[0] follows)
            path = os.path.abspath(program.target)
            sys.path[0] = os.path.dirname(path)
            namespace = runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        if exc.code is None or (isinstance(exc.code, int) and exc.code == 0):
            _mark(marker, pid)
        raise
    except BaseException as exc:
        record_error(exc)
        sys.excepthook = _from_program(sys.excepthook)  # the interpreter prints it, and exits 1 (or by SIGINT)
        raise
    _mark(marker, pid)
    _keep(namespace)


def _keep(namespace: dict) -> None:
    """The program's globals die in teardown, as under `python SCRIPT`: in its collection of what
    the modules leave, their __del__ seeing them intact (an abort there is the rank's exit). They are
    held by a module of the rank's own in sys.modules, which teardown removes first, never by what
    a zygote made: a forked rank inherits that frozen (gc.freeze), and the collection takes nothing
    a frozen object holds. The frozen objects stay out of it: walking them all (the zygote's torch)
    cost a warm rank 1.4 s of CPU in teardown, a cold process's teardown ~1 s."""
    kept = types.ModuleType(KEPT_MODULE)
    kept.__dict__["program_globals"] = namespace
    sys.modules[KEPT_MODULE] = kept


def record_error(exc: BaseException) -> None:
    """The exception the program dies of, in torch's error file as its @record writes it (unless
    @record already did), plus the step it was raised in where the library said so (`muster_step`):
    its agent reports both with the exit, for the leader to tell a fault that repeats."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE", "")
    if not path or os.path.exists(path) or isinstance(exc, KeyboardInterrupt):
        return
    doc = {"message": {"message": f"{type(exc).__name__}: {exc}",
                       "extraInfo": {"py_callstack": "".join(traceback.format_exception(exc)),
                                     "timestamp": str(int(time.time()))}}}
    step = getattr(exc, "muster_step", None)
    if isinstance(step, int):
        doc["muster_step"] = step
    try:
        with open(path, "w") as f:
            json.dump(doc, f)
    except OSError:
        pass  # the agent's directory is gone: so is the agent


def _modules() -> list[str]:
    """The installed modules imported so far, submodules included, in the order they were first
    imported: files under site-packages or dist-packages, never the script's own modules beside it.
    (Packages that load their submodules lazily, as transformers does, import little themselves.)"""
    found = []
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None) or ""
        if f"{os.sep}site-packages{os.sep}" in path or f"{os.sep}dist-packages{os.sep}" in path:
            found.append(name)
    return found


def _record_imports(path: str, before: list[str]) -> None:
    """The modules the program imported since its start, for the agent (written whole, then renamed)."""
    known = set(before)
    try:
        with open(f"{path}.tmp", "w") as f:
            f.write("\n".join(m for m in _modules() if m not in known))
        os.replace(f"{path}.tmp", path)
    except OSError:
        pass  # the agent's directory is gone: so is the agent


def _mark(path: str, pid: int) -> None:
    if path and os.getpid() == pid:
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
        except OSError:
            pass  # the agent's directory is gone: so is the agent


def _from_program(hook):
    """`hook` shown the traceback from the program's first frame on, past `run`, `_run` and runpy's frames
    (the interpreter's printer reads the exception's own __traceback__, not the hook's argument)."""
    def excepthook(kind, value, tb):
        here = tb
        while here is not None and here.tb_frame.f_code is not _run.__code__:
            here = here.tb_next
        here = here.tb_next if here is not None else None
        while here is not None and here.tb_frame.f_code.co_filename == _RUNPY_FILE:
            here = here.tb_next
        tb = here or tb
        hook(kind, value.with_traceback(tb), tb)

    return excepthook


def end_forked(exc: BaseException | None, inherited: frozenset[str]) -> NoReturn:
    """End a rank the zygote forked as the interpreter ends `python SCRIPT`, `exc` what the program
    raised (None: it returned): its exception printed (exit 1, or death by SIGINT for
    KeyboardInterrupt) or SystemExit's status taken; its non-daemon threads joined; every atexit
    handler run; then the modules it imported torn down, its own globals first (their __del__ run,
    an abort there is the rank's exit), its garbage collected and its output flushed. What the
    zygote imported is left to the process's end: tearing it down frees the zygote's objects one by
    one, copying every page the rank shares with it (0.45 s of CPU a rank on a slow host, ~42k page
    faults), for nothing the program made."""
    code = 0
    if isinstance(exc, SystemExit):
        code = _system_exit_code(exc.code)
    elif exc is not None:
        sys.excepthook(type(exc), exc, exc.__traceback__)  # (the program's own, `_from_program`)
        code = 1
    interrupted = isinstance(exc, KeyboardInterrupt)
    exc = None  # its traceback holds the program's frames: they die with its modules, below
    try:
        threading._shutdown()  # type: ignore[attr-defined]  (what the interpreter's exit does first)
        atexit._run_exitfuncs()
        _tear_down([name for name in sys.modules if name not in inherited])
    except BaseException:  # (a fault here must neither return into the zygote's code nor end the rank 0)
        traceback.print_exc()
        code = code or 1
    finally:
        _flush()
        if interrupted:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code & 0xFF)


def _flush() -> None:
    """The process's output out, as the interpreter's exit flushes it: Python's streams, then what C
    code (torch's, an extension's) printed into libc's buffers."""
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass  # closed, or its reader gone: as the interpreter, nothing to be done
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass  # no C library to load by that name


def _system_exit_code(code: object) -> int:
    """The status SystemExit(code) ends a process with; a code that is no int is printed, as the
    interpreter prints it, and ends it with 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    try:
        print(code, file=sys.stderr)
    except (OSError, ValueError):
        pass
    return 1


def _tear_down(names: list[str]) -> None:
    """Modules leave as at the interpreter's exit: out of sys.modules, newest first (the program's
    kept globals, `_keep`, are the newest), the garbage collected, then the globals of those still
    alive cleared, private names first (CPython's _PyModule_ClearDict), and collected again."""
    alive = [weakref.ref(m) for m in (sys.modules.pop(name, None) for name in reversed(names))
             if isinstance(m, types.ModuleType)]
    gc.collect()
    for ref in alive:
        namespace = getattr(ref(), "__dict__", None)
        for private in (True, False):
            for key in [k for k in namespace or () if isinstance(k, str) and k.startswith("_") == private]:
                if key != "__builtins__":
                    namespace[key] = None
        namespace = None
    gc.collect()


def main() -> None:
    args = sys.argv[1:]
    module = args[:1] == ["-m"]
    args = args[1:] if module else args
    run(Program(args[0], module, tuple(args[1:]), False))  # -u, if any, was the interpreter's


if __name__ == "__main__":
    main()
