"""What only tests use: `until`, a wait on an event loop for a condition; `FakeClock`, a
monotonic clock that moves only when told (pass it as a component's `clock=`); `run_processes`,
the ranks of a multi-process test (or of a benchmark a test runs), started cheaply. The harness
that the demo and the benchmarks share, `wait_until` among it, is in `muster.local`."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
from collections.abc import Callable


async def until(predicate, what: str, timeout_s: float = 5.0, interval_s: float = 0.01):
    """`wait_until` on an event loop: the predicate's first truthy value, or AssertionError naming
    what was waited for."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not (value := predicate()):
        if loop.time() >= deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(interval_s)
    return value


class FakeClock:
    """Monotonic time that moves only when told: `advance(s)`, or `sleep(s)` in place of
    `asyncio.sleep` (the wait is taken at once, on this clock). Pass it as a `clock=`; read `now`."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, s: float) -> float:
        self.now += s
        return self.now

    async def sleep(self, s: float) -> None:
        self.now += max(0.0, s)
        await asyncio.sleep(0)  # others run, as they would while this waited

    async def elapse(self, s: float, step_s: float = 0.1) -> None:
        """`s` seconds pass in steps of `step_s`, a leader's ticks running between them (a real 20 ms
        each): a leader whose clock jumped a whole heartbeat timeout at once takes it for its own pause."""
        end = self.now + s
        while self.now < end:
            self.now = min(end, self.now + step_s)
            await asyncio.sleep(0.02)


def run_processes(target: Callable, args: list[tuple], results: int, timeout_s: float) -> list:
    """One process a tuple of `args`, running `target(*args, out)`, forked from a server that imported
    torch once (a spawned process imports it again: 2-3 s of CPU each; a fork of a test process
    could inherit its OpenMP pool mid-use); the first `results` items they put on the queue `out`,
    within `timeout_s` each. Every process has ended when it returns, killed after 10 s if need be."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*a, out)) for a in args]
    for p in procs:
        p.start()
    try:
        return [out.get(timeout=timeout_s) for _ in range(results)]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
