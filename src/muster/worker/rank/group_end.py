"""The end of a script's process group, in a rank the runner starts: freed without a deadlock, and
seen by the agent even if the process then hangs.

Why freeing a group can deadlock (torch 2.13, gloo; found 2026-11-27 with gdb on the hung ranks of
the pytorch/examples DDP tutorial): backward stashes a contextvars.Context in the autograd
thread-local state (`torch.autograd.graph._engine_run_backward`), every collective DDP launches from
backward captures that state, and the gloo worker thread that ran one frees it after completing it,
which takes the GIL (the Context is a Python object). The group's destructor joins its worker threads
with the GIL held: freed while a worker still waits for the GIL, it never returns. DDP's reducer holds
the group, so a script whose DDP wrapper is alive at destroy_process_group() (the tutorial's Trainer,
a local of main()) frees it as main()'s frame is cleared, within milliseconds of the last step's
all-reduce. Warm ranks met it and cold ones (almost) never: the zygote imported
torch.distributed.nn (torch._dynamo imports it) before the script's init_process_group, so the
defaults of its functions (`group=group.WORLD`) are None; a cold rank imports it in DDP's constructor,
after init, and those defaults keep the group until interpreter exit, long after the workers let go.

What the runner does about it (`attach`):
- drain: the script's destroy_process_group() first waits, the GIL released, until no worker holds a
  Context that backward stashed (milliseconds; at most DRAIN_S, for a collective still running), so
  the group can be freed wherever the script lets go of it.
- the mark: its destroy_process_group() of the default group says the script's collective work is
  done. The runner creates a file of the agent's ($MUSTER_COMPLETED_FILE + ENDED_SUFFIX) and a thread
  touches it every PULSE_S until __main__ returns: a thread needs the GIL to touch it, so a file that
  stops changing while the process lives means its interpreter runs nothing any more. Past
  --exit-timeout the agent counts the rank finished and ends it (`EndedFile`): the safety net for a
  freeze that the drain does not prevent. A script still working after destroy_process_group() keeps
  the file changing; one that ends without completing removes it (its exit says how it ended).

A library rank turns it off (`detach`): the library destroys and forms groups at every reform itself.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time

from muster.worker.rank.after_import import when_imported

ENDED_SUFFIX = ".group-ended"
DRAIN_S = 5.0  # a worker frees what it ran within milliseconds; longer is a collective still running
DRAIN_POLL_S = 0.001
PULSE_S = 1.0  # well under any sensible --exit-timeout

_on = False
_path = ""  # the agent's file ('' without an agent: the drain alone)
_pid = 0  # the runner's process: a child the script forks marks nothing
_held: list = []  # the Contexts backward stashed that a collective's captured state may still hold
_pulse: _Pulse | None = None


def attach(path: str) -> None:
    """In a rank the runner starts: install the hooks once the script imports torch (at once in a
    forked rank, whose zygote imported it)."""
    global _on, _path, _pid
    _on, _path, _pid = True, path, os.getpid()
    when_imported("torch", _install)


def detach() -> None:
    """The rank uses the library: its groups are the library's to destroy (the hooks pass through)."""
    global _on
    _on = False
    _held.clear()


def close() -> None:
    """__main__ returned or raised: the pulse stops before interpreter teardown (a live thread changes
    what finalization frees), and its file goes."""
    global _pulse
    if _pulse is not None and os.getpid() == _pid:
        _pulse.stop()
    _pulse = None


def _install() -> None:
    try:
        import torch
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        destroy = distributed_c10d.destroy_process_group
    except (ImportError, AttributeError):  # a torch without distributed: no group to end
        return
    stash = getattr(torch._C, "_stash_obj_in_tls", None)  # (another torch may stash nothing: the mark alone)

    def _stash(key, obj):
        stash(key, obj)
        if _on and key == "context":
            _prune()
            _held.append(obj)

    @functools.wraps(destroy)
    def destroy_process_group(*args, **kwargs):
        if _on:
            group = args[0] if args else kwargs.get("group")
            if (group is None or group is distributed_c10d.GroupMember.WORLD) and _path and os.getpid() == _pid:
                _mark()
            _drain()
        return destroy(*args, **kwargs)

    if stash is not None:
        torch._C._stash_obj_in_tls = _stash  # (called through the attribute, by every backward)
    distributed_c10d.destroy_process_group = dist.destroy_process_group = destroy_process_group


def _refs(held: list) -> list[int]:
    return [sys.getrefcount(c) for c in held]


_OURS = _refs([object()])[0]  # an object only `_held` holds, as _refs counts it


def _prune() -> None:
    """Drop the Contexts nothing but `_held` holds any more."""
    _held[:] = [c for c, refs in zip(_held, _refs(_held)) if refs > _OURS]


def _drain() -> None:
    deadline = time.monotonic() + DRAIN_S
    _prune()
    while _held:
        if time.monotonic() > deadline:
            print(f"muster: a collective still held backward's state {DRAIN_S:g}s into destroy_process_group()",
                  file=sys.stderr)
            return
        time.sleep(DRAIN_POLL_S)  # the GIL released: a worker waiting for it frees its Context
        _prune()


def _mark() -> None:
    global _pulse
    if _pulse is None:
        _pulse = _Pulse(_path)


class _Pulse:
    def __init__(self, path: str):
        self.path = path
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
        except OSError:
            return  # the agent's directory is gone: so is the agent
        self._thread = threading.Thread(target=self._beat, name="muster-group-ended", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(PULSE_S):
            try:
                os.utime(self.path)
            except OSError:
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            os.unlink(self.path)
        except OSError:
            pass


class EndedFile:
    """The agent's side: how long a rank that ended its default group has run no Python."""

    def __init__(self, path: str):
        self.path = path
        self._seen: tuple[int, float] | None = None  # (the file's mtime, when the agent first saw it)

    def frozen_s(self) -> float:
        """Seconds the pulse has not changed (0 while there is none, or it beats)."""
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except OSError:
            self._seen = None
            return 0.0
        now = time.monotonic()
        if self._seen is None or self._seen[0] != mtime:
            self._seen = (mtime, now)
        return now - self._seen[1]
