"""Testing helpers shipped with Muster: coordinator replicas as real processes and simulated node
agents over real gRPC. Used by the tests, the demo and the benchmarks."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc

from muster.coordinator.client import leader_hint
from muster.v1 import muster_pb2 as pb
from muster.v1 import muster_pb2_grpc as pb_grpc

FAST = [
    "--heartbeat-interval", "0.05", "--heartbeat-timeout", "1.0", "--grace", "2.0",
    "--last-call", "0.3", "--session-ttl", "2", "--tick", "0.05",
]


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.02):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


class CoordinatorProcess:
    """`muster serve` on 127.0.0.1:0 against the given etcd (none: its private etcd); its address is
    read from its log."""

    def __init__(self, etcd_endpoints: list[str], log_path: Path, extra: list[str] | None = None):
        self.log_path = log_path
        etcd = ["--etcd", ",".join(etcd_endpoints)] if etcd_endpoints else []
        self.args = [sys.executable, "-m", "muster.cli", "--log-json", "serve", *etcd,
                     "--listen", "127.0.0.1:0", *FAST, *(extra or [])]
        self.proc: subprocess.Popen | None = None
        self.address = ""

    def start(self, timeout_s: float = 20.0) -> CoordinatorProcess:
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        serving = wait_until(lambda: self.find("coordinator_serving") or self._died(), timeout_s, "coordinator start")
        self.address = serving[0]["advertise"]
        return self

    def _died(self):
        if self.proc.poll() is not None:
            raise AssertionError(f"coordinator exited with {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
        return None

    def records(self) -> list[dict]:
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
        return out

    def find(self, event: str, **fields) -> list[dict]:
        return [r for r in self.records() if r.get("event") == event and all(r.get(k) == v for k, v in fields.items())]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        finally:
            self._log.close()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(5)
        self._log.close()


class SimulatedNode:
    """A simulated node agent: joins, streams frames for its slots (one step per frame), follows the
    leader (hints and pulses), records directives. `silent = True` makes it hang."""

    def __init__(self, addresses: list[str], job: str, node_id: str, *, slots: int = 2, spec: pb.JobSpec | None = None,
                 is_process: bool = False, interval_s: float = 0.05, store_port: int = 29500):
        self.addresses = list(addresses)
        self.job, self.node_id, self.slots = job, node_id, slots
        self.spec = spec or pb.JobSpec()
        self.is_process = is_process
        self.interval_s = interval_s
        self.store_port = store_port
        self.member_id = 0
        self.term = 0
        self.generation = 0
        self.step = 0
        self.directives: list[pb.Directive] = []
        self.silent = False  # stop sending frames, keep the stream open (a hang)
        self.exits: list[pb.RankExit] = []
        self.leader = ""
        self.errors: list[grpc.RpcError] = []
        self._task: asyncio.Task | None = None
        self._session_call = None
        self._stopping = False
        self._leader_silent = False
        self._heard_at = 0.0
        self.leader_timeout_s = 2.0  # from the JoinResponse
        self._changed = asyncio.Event()

    async def _call(self, rpc: str, request, timeout_s: float = 10.0):
        deadline = time.monotonic() + timeout_s
        order = ([self.leader] if self.leader else []) + self.addresses
        while True:
            address = order.pop(0) if order else None
            if address is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{rpc}: no leader answered")
                await asyncio.sleep(0.1)
                order = list(self.addresses)
                continue
            async with grpc.aio.insecure_channel(address) as channel:
                try:
                    response = await getattr(pb_grpc.CoordinatorStub(channel), rpc)(request, timeout=5)
                    self.leader = address
                    return response
                except grpc.aio.AioRpcError as exc:
                    if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                        raise
                    hint = leader_hint(exc)
                    if hint:
                        order.insert(0, hint)

    async def join(self) -> pb.JoinResponse:
        resp = await self._call("Join", pb.JoinRequest(
            job=self.job, node_id=self.node_id, slots=self.slots, host="127.0.0.1", store_port=self.store_port,
            spec=self.spec, agent_pid=os.getpid(), is_process=self.is_process))
        self.member_id = resp.member_id
        self.leader_timeout_s = resp.heartbeat_timeout_ms / 1000
        return resp

    def frame(self) -> pb.NodeFrame:
        active = self.assignment().role == pb.ROLE_ACTIVE if self.directives else False
        ranks = [pb.RankReport(local_rank=s, pid=10_000 + s, step=self.step, step_time_us=50_000,
                               state=pb.RANK_STATE_RUNNING if active else pb.RANK_STATE_STARTING)
                 for s in (self.assignment().local_ranks if active else [])]
        exits, self.exits = self.exits, []
        return pb.NodeFrame(job=self.job, node_id=self.node_id, member_id=self.member_id, term=self.term,
                            generation=self.generation, ranks=ranks, exits=exits)

    def assignment(self) -> pb.Assignment:
        for d in reversed(self.directives):
            if d.HasField("assignment"):
                return d.assignment
        return pb.Assignment()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _frames(self):
        while True:
            if not self.silent:
                if self.assignment().role == pb.ROLE_ACTIVE:
                    self.step += 1
                yield self.frame()
            await asyncio.sleep(self.interval_s)

    async def _run(self) -> None:
        while not self._stopping:
            address = self.leader or self.addresses[0]
            self._leader_silent = False
            try:
                async with grpc.aio.insecure_channel(address) as channel:
                    self._session_call = call = pb_grpc.CoordinatorStub(channel).Session(self._frames())
                    watchdog = asyncio.create_task(self._watch(call))
                    try:
                        async for d in call:
                            self._heard_at = asyncio.get_running_loop().time()
                            if self._directive(d):
                                return
                        return
                    finally:
                        watchdog.cancel()
            except asyncio.CancelledError:
                if self._stopping:
                    return
                if not self._leader_silent:
                    raise
                hint = ""  # the watchdog ended a silent stream: try another replica
            except grpc.aio.AioRpcError as exc:
                if self._stopping:
                    return
                self.errors.append(exc)
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    return
                hint = leader_hint(exc)
            others = [a for a in self.addresses if a != address]
            self.leader = hint or (others[0] if others else address)
            await asyncio.sleep(0.05)

    def _directive(self, d: pb.Directive) -> bool:
        """Record one directive; True when the node was evicted."""
        self.term = max(self.term, d.term)
        if not d.HasField("assignment") and not d.HasField("drain"):
            return False  # the leader's pulse
        self.directives.append(d)
        if d.HasField("assignment"):
            self.generation = d.generation
        self._changed.set()
        return d.HasField("assignment") and d.assignment.role == pb.ROLE_EVICTED

    async def _watch(self, call) -> None:
        """The leader pulses; a stream silent for heartbeat_timeout is ended (a frozen leader)."""
        loop = asyncio.get_running_loop()
        self._heard_at = loop.time()
        while True:
            await asyncio.sleep(self.leader_timeout_s / 4)
            if loop.time() - self._heard_at > self.leader_timeout_s:
                self._leader_silent = True
                call.cancel()
                return

    async def wait_for(self, predicate, timeout_s: float, what: str):
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not predicate(self):
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                raise AssertionError(f"{self.node_id}: timed out waiting for {what}; last {self.assignment()}")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), min(remaining, 0.1))
            except TimeoutError:
                pass
        return self.assignment()

    async def stop(self) -> None:
        """End the stream the gRPC way (cancelling a pending read from asyncio can wedge it)."""
        self._stopping = True
        if self._session_call is not None:
            self._session_call.cancel()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, 5)
            except (TimeoutError, asyncio.CancelledError, grpc.RpcError):
                pass
