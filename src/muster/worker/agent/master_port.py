"""MASTER_ADDR/MASTER_PORT of each generation, for scripts without the worker library: the agent
of rank 0's node serves a fresh TCPStore for each generation and publishes its port in its own
store under the generation's prefix, so no rank reaches the store of an older generation. The
ranks use it as torchrun's workers use their agent's (TORCHELASTIC_USE_AGENT_STORE=True: every
rank a client): it is up before any rank starts, where a store hosted by rank 0's process made
the others retry their connect until it came (c10d's backoff: up to 0.7 s of a restart). Library
ranks need none of it (they form their groups on the generation's store themselves)."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from datetime import timedelta

import structlog

from muster.net import split_host_port
from muster.v1 import muster_pb2 as pb
from muster.worker.store import Seal, StoreKeyTaken, StoreTampered, publish, serve

log = structlog.get_logger(__name__)

MASTER_PORT_WAIT_S = 5.0  # one read of another node's store waits this long for rank 0's node to publish


class MasterPorts:
    """One node's view of the generations' master addresses. Each is found once per generation,
    from the moment its map arrives (not when the ranks' restart gets its turn): a slow rank-0 node
    must not make the others wait out their bound."""

    def __init__(self, host: str, *, library: Callable[[], bool], assignment: Callable[[], pb.Assignment | None],
                 ended: Callable[[], bool], planted: Callable[[int, Exception], None]):
        self.host = host  # what this node's ranks bind and others reach
        # This node's TCPStore, which serves the generations whose rank 0 is here (made on a thread:
        # `serve_soon`).
        self.store: concurrent.futures.Future | None = None
        self._library, self._assignment, self._ended, self._planted = library, assignment, ended, planted
        self._clients: dict[str, object] = {}  # other nodes' stores, by address
        self._found: dict[int, asyncio.Future] = {}  # generation -> its (MASTER_ADDR, MASTER_PORT)
        self._served: dict[int, object] = {}  # generation -> the TCPStore this agent serves its ranks

    async def of(self, a: pb.Assignment) -> tuple[str, str] | None:
        """The master address of generation `a`; None: the node has no rank in it, or a newer map
        superseded it before its port was known, or rank 0's key was planted (`planted` was told)."""
        if a.role != pb.ROLE_ACTIVE or not a.master_address:
            return None
        task = self._found.get(a.generation)
        if task is None:
            task = self._found[a.generation] = asyncio.ensure_future(self._find(a))
            for old in [g for g in self._found if g < a.generation - 1]:
                del self._found[old]
        return await asyncio.shield(task)

    async def current(self) -> tuple[str, str] | None:
        """The master address of the newest map, even if a newer one arrives meanwhile."""
        while True:
            a = self._assignment()
            master = await self.of(a)
            if self._assignment() is a:
                return master

    async def _find(self, a: pb.Assignment) -> tuple[str, str] | None:
        host, master_port = split_host_port(a.master_address)
        key = f"{a.store_prefix}/muster-agent/master-port"
        seal = Seal(a.store_key, a.store_prefix)
        if a.node_rank == 0 and a.rank_offset == 0:  # rank 0 is here: so is the store
            # Library ranks need no store, but a node placed since, whose ranks have not started
            # (so it cannot know they are library ranks), waits for the key: it is published anyway.
            served = None if self._library() else await asyncio.to_thread(serve_store, self.host)
            port = str(served.port if served is not None else master_port)
            try:
                await asyncio.to_thread(publish, await asyncio.wrap_future(self.store), key, port, seal)
            except StoreKeyTaken as exc:  # nodes that read it first would use someone else's port
                self._planted(a.generation, exc)
                return None
            if served is not None:
                self._served[a.generation] = served
            stale = [self._served.pop(g) for g in list(self._served) if g < a.generation - 1]  # their ranks are gone
            await asyncio.to_thread(stale.clear)  # the last references: each server joins its thread there
            return host, port
        if self._library():
            return host, str(master_port)
        # Never a guess: ranks that disagree on the port would wait in init_process_group for good.
        # Rank 0's node publishes within moments; if it is gone, the leader's next map says so.
        warned = False
        while self._assignment().generation == a.generation and not self._ended():
            try:
                return host, seal.open(key, await asyncio.to_thread(self._get, a.store_address, key)).decode()
            except Exception as exc:  # a tampered value is never used either: the ranks wait for a newer map
                if not warned:
                    warned = True
                    if isinstance(exc, StoreTampered):
                        log.error("master_port_tampered", generation=a.generation, store=a.store_address, error=str(exc))
                    else:
                        log.warning("master_port_unpublished", generation=a.generation, store=a.store_address,
                                    error=str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
                                    message="waiting for the node of rank 0 to publish it, or for a newer map")
                await asyncio.sleep(0.2)
        return None

    def _get(self, address: str, key: str) -> bytes:
        """A key of another node's store, waiting for it a bounded time (blocking: a thread)."""
        import torch.distributed as dist

        client = self._clients.get(address)
        try:
            if client is None:
                host, port = split_host_port(address)
                client = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                       timeout=timedelta(seconds=MASTER_PORT_WAIT_S))
                self._clients[address] = client
            return client.get(key)
        except Exception:
            self._clients.pop(address, None)
            raise


def serve_store(host: str):
    """A TCPStore server on a free port, for one generation's ranks (blocking: a thread)."""
    return serve(host, timedelta(seconds=MASTER_PORT_WAIT_S))
