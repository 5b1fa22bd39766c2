"""A process's link to the coordinator (NodeSession) or to its node agent (RankLink), shared by the
worker library and the torchrun rendezvous handler. Both ends are a `Transport`.

One owner for what the training thread and the link thread share: the link thread, with its own
asyncio loop, runs the transport and is the only writer of the mailbox (`latest`, `base`,
`switches`, `drain_after`); the training thread reads it, waits on `changed`, and reaches the transport only
through the loop (`call`, `leave`, `running`, `send_now`). The transport's end — fenced out, lost, or
the run's end — is turned into a WorkerError here, once.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Protocol, runtime_checkable

import structlog

from muster.v1 import muster_pb2 as pb
from muster.worker.errors import CoordinatorLost, FencedOut, RunEnded, WorkerError
from muster.worker.node_session import Evicted, JobEnded, evicted

log = structlog.get_logger(__name__)


@runtime_checkable
class Transport(Protocol):
    """A process's stream of directives: NodeSession (a node's, to the coordinator) or RankLink (a
    rank's, to its agent, which is the job's member for it). `run` delivers each directive to the
    callback it was built with and ends by raising Evicted (after delivering the eviction),
    JobEnded, or what lost it; returning means it was stopped."""

    generation: int  # the generation this process runs (its frames carry it)
    joined_run: int  # the run of the job it joined (0: not known here, a rank's agent knows it)

    async def join(self, *, retry_for_s: float = 30.0) -> object: ...  # become the job's member

    async def run(self) -> None: ...

    async def leave(self, **kwargs) -> None: ...  # leave the job (the stream's end that follows is expected)

    async def stop(self) -> None: ...

    def silent_s(self) -> float: ...  # since when whoever answers for the coordinator was last heard

# Builds the transport on the link's loop, given the callback its directives go to.
Connect = Callable[[Callable[[pb.Directive], None]], Transport]


class Link:
    def __init__(self, name: str, *, on_directive: Callable[[pb.Directive], None] | None = None,
                 on_failure: Callable[[WorkerError, BaseException | None], None] | None = None):
        """`on_directive` and `on_failure` run on the link thread: after the mailbox has the
        directive, and when the transport ended for good (not when it was stopped)."""
        self.name = name
        self.session: Transport | None = None
        self.latest: pb.Assignment | None = None  # the newest assignment
        self.base: pb.Assignment | None = None  # the newest formed at once (not at a planned step)
        # The planned switches heard, generation -> the step to switch after, for generations newer
        # than the one this process runs (replaced whole, never changed in place: read on other threads).
        self.switches: dict[int, int] = {}
        self.drain_after: int | None = None  # the node leaves the job after this step
        self.ended: pb.JobEnd | None = None  # the job's run ended
        self.changed = threading.Event()  # the mailbox has news (or the link failed)
        self._on_directive = on_directive
        self._on_failure = on_failure
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._left: Transport | None = None  # the session that left the job: its end is no failure

    def open(self, connect: Connect, *, joined: bool = False, join_timeout_s: float = 30.0) -> None:
        """Start the transport (replacing the one before, and its mailbox). A NodeSession joins
        first: with `joined`, before this returns, retried for `join_timeout_s` (its failure raised
        here); otherwise on the link, where a failure goes to `on_failure` like any other."""
        if self._thread is None:
            ready = threading.Event()
            self._thread = threading.Thread(target=self._serve, args=(ready,), name=self.name, daemon=True)
            self._thread.start()
            ready.wait()
        self.call(self._open(connect, joined, join_timeout_s), join_timeout_s + 30)

    def call(self, coroutine: Coroutine, timeout_s: float = 60.0):
        """Run a coroutine on the link's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout_s)

    def leave(self, timeout_s: float = 60.0, **kwargs) -> None:
        """Leave the job (NodeSession.leave's arguments); the stream's end that follows is expected."""
        self._left = self.session
        self.call(self.session.leave(**kwargs), timeout_s)

    def running(self, generation: int) -> None:
        """The generation this process runs now: the transport's frames carry it."""
        self._loop.call_soon_threadsafe(self._running, generation)

    def switch_after(self, generation: int) -> int:
        """The step after which a rank in `generation` leaves it for a planned switch: the earliest heard
        for any newer generation (0: none). A later map that supersedes a planned one before its step
        does not move that step away: peers that heard only the earlier one leave the group there."""
        return min((step for g, step in self.switches.items() if g > generation), default=0)

    def send_now(self) -> None:
        """A frame at once, not at the next interval."""
        self._loop.call_soon_threadsafe(self.session.send_now)

    def silent_s(self) -> float:
        return self.session.silent_s()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the transport, then the loop: what is left on it is cancelled (gRPC's request pump)."""
        if self._thread is None:
            return
        try:
            if self.session is not None:
                self.call(self.session.stop(), timeout_s)
        finally:
            self._loop.call_soon_threadsafe(self._done.set)
            self._thread.join(timeout_s)
            self._thread = None  # closing again is a no-op

    # ---- the link thread -------------------------------------------------------------

    def _serve(self, ready: threading.Event) -> None:
        async def serve() -> None:
            self._loop, self._done = asyncio.get_running_loop(), asyncio.Event()
            ready.set()
            await self._done.wait()

        asyncio.run(serve())

    async def _open(self, connect: Connect, joined: bool, join_timeout_s: float) -> None:
        if self.session is not None:
            await self.session.stop()
        self.latest = self.base = self.drain_after = self.ended = None
        self.switches = {}
        self.session = session = connect(self._deliver)
        if joined:
            await session.join(retry_for_s=join_timeout_s)
        asyncio.create_task(self._run(session, join=not joined))

    async def _run(self, session: Transport, *, join: bool) -> None:
        try:
            if join:
                await session.join()
            await session.run()
        except Evicted as exc:
            self._failed(session, FencedOut(f"fenced out by the coordinator: {exc}"), None)
        except JobEnded as exc:
            if session is self.session:
                self.ended = exc.end
            self._failed(session, RunEnded(exc.end), None)
        except Exception as exc:
            self._failed(session, CoordinatorLost(f"lost the coordinator: {exc}"), exc)

    def _running(self, generation: int) -> None:
        self.session.generation = generation
        self.switches = self._newer()

    def _newer(self) -> dict[int, int]:
        """The switches heard to generations newer than the one this process runs (a handful at most)."""
        return {g: step for g, step in self.switches.items() if g > self.session.generation}

    def _failed(self, session: Transport, error: WorkerError, cause: BaseException | None) -> None:
        if session is not self.session or session is self._left:
            return  # replaced meanwhile, or it left
        if self._on_failure is not None:
            self._on_failure(error, cause)
        elif isinstance(error, RunEnded):
            log.info("link_run_ended", link=self.name, outcome=error.outcome, reason=error.reason)
        else:
            log.warning("link_failed", link=self.name, error=str(error))
        self.changed.set()

    def _deliver(self, d: pb.Directive) -> None:
        if d.HasField("assignment"):
            a = d.assignment
            if self.latest is None or a.generation >= self.latest.generation:
                self.latest = a
                if immediate(a):
                    self.base = a
                else:
                    self.switches = {**self._newer(), a.generation: a.switch_at_step}
            if evicted(d) is not None:
                return  # the transport raises Evicted next: the failure tells
        elif d.HasField("drain"):
            self.drain_after = d.drain.after_step
        if self._on_directive is not None:
            self._on_directive(d)
        self.changed.set()


def immediate(a: pb.Assignment) -> bool:
    """Formed at once (an abort, the first map, a rebuild), not at a planned step boundary."""
    return a.abort_previous or a.switch_at_step == 0
