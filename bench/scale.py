"""A simulated job at scale in one leader, on a simulated clock (no network). Prints one JSON object.

Every node sends a frame `--rate` times a second at its own phase (as `NodeSession` does); each
tick (`--tick`, the leader's) hands the frames due to `JobLeader.on_frame` and runs the tally.
The clock only orders events: what each part costs is CPU time (this thread's, or the process's
for a change, whose encoding runs in a worker thread), so other load on the host does not count. One node stops
sending; the run goes on until the leader has decided its death and queued every other node its
part of the new map. Writes go to the in-memory store (encoded in a thread, as on etcd).

    python bench/scale.py                      # 100k ranks (12,500 nodes x 8), 10 frames/s, 1.5 s timeout
    python bench/scale.py --relayed            # the same nodes streaming through relays
    python bench/scale.py --ranks 16000 --rate 2

Relayed (`--relayed`): the nodes stream through relays of `--relay-nodes` nodes each, and the leader
sees what relays send (`relay_fold.Changes`) on their `RelayLink`s: every node's first frame, then one
`RelaySummary` per relay and `--relay-progress` (at the relay's phase) standing for every node's
progress, and the victim's silence as its relay reports it: at the relay's first look past the
heartbeat timeout (it looks every eighth of it), plus one batch window. Its directives are wrapped
for the relays as on the wire.

What it reports:
- frame_us: CPU of one `on_frame` (direct), or of one relay's message with its summary (relayed),
  p50 and p99 over batches of a tick, the protobuf already parsed;
- tick_ms: the tallies with nothing to decide (p50, p99, max);
- detection_s: simulated time from the victim's last frame to the decision (the heartbeat timeout
  included);
- map_queued_ms: CPU from the decision (decide returned) to every node's directive queued (the
  fenced write, the adoption, the directives);
- change_ms: CPU of the tally that decided: liveness, decide, the fenced write (with its
  encoding), every surviving node's directive built and queued; change_loop_held_ms: the longest
  the event loop went without running another task meanwhile (wall clock: frames wait that long);
- evicted: the nodes the run evicted (the victim alone, or load evicted someone);
- process_rss_mib: the benchmark's peak resident memory: the leader's (state, liveness, streams) and
  the simulated nodes' frames;
- leader_cpu_cores: the CPU the leader needs at this rate, frames and ticks together (one core is
  all a Python process has).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import statistics
import sys
import time
import zlib
from pathlib import Path

from muster import logs
from muster.coordinator.core.policy import MAX_NODES, Limits, Timing
from muster.coordinator.core.state import encode
from muster.coordinator.coordination import LeaderKey
from muster.coordinator.job import leader as leader_module
from muster.coordinator.job.leader import JobLeader
from muster.coordinator.job.leadership import Leadership
from muster.coordinator.job.relay_link import RelayLink
from muster.coordinator.job.streams import NodeStream
from muster.coordinator.memory import MemoryJobStore
from muster.v1 import muster_pb2 as pb

sys.path.insert(0, str(Path(__file__).parent))
from capacity import JOB, running_state  # noqa: E402
from recovery import percentile  # noqa: E402


def _ms(values: list[float]) -> dict:
    return {"p50": round(statistics.median(values) * 1e3, 3), "p99": round(percentile(values, 0.99) * 1e3, 3),
            "max": round(max(values) * 1e3, 3)}


RELAY_BATCH_S = 0.02


class Simulation:
    """One leader and its nodes on a simulated clock: the nodes' frames due each tick, the tally,
    the directives read; one node (the victim) stops sending at `steady_s`."""

    def __init__(self, ranks: int, slots: int, rate: float, heartbeat_timeout_s: float, tick_s: float,
                 relay_progress_s: float | None, relay_nodes: int = 1000):
        self.nodes, self.slots, self.tick_s = ranks // slots, slots, tick_s
        self.heartbeat_timeout_s, self.relay_progress_s = heartbeat_timeout_s, relay_progress_s
        self.relayed = relay_progress_s is not None
        self.interval = relay_progress_s if self.relayed else 1 / rate
        self.timing = Timing(heartbeat_interval_s=self.interval, heartbeat_timeout_s=heartbeat_timeout_s, grace_s=1.0)
        state = running_state(self.nodes, slots)
        encode(state)  # as a leader that wrote it before: members keep their encoded text
        self.clock = [0.0]
        self.leader = JobLeader(state, leadership=Leadership(LeaderKey(JOB, 1, "bench", "127.0.0.1:7600"),
                                                             MemoryJobStore()),
                                address="127.0.0.1:7600", timing=self.timing, tick_s=tick_s,
                                clock=lambda: self.clock[0],  # a job an operator raised the quotas of (--job-quota)
                                limits=Limits(max_members=MAX_NODES + 16, etcd_mib_per_min=1e6))
        self.frames, self.streams, self.phases = {}, {}, {}
        self.links: dict[str, RelayLink] = {}  # relayed: each relay's link, by its name
        self.relay_of: dict[str, str] = {}
        for i, m in enumerate(state.members):
            link = None
            if self.relayed:
                relay = f"relay-{i // relay_nodes:04d}"
                link = self.links.get(relay) or self.links.setdefault(relay, RelayLink(self.leader, relay))
                link.maps = True  # as its first message said
                self.relay_of[m.node_id] = relay
            self.streams[m.node_id] = self.leader.streams[m.node_id] = NodeStream(
                JOB, m.node_id, m.member_id, m.kind, link=link, stream_id=i + 1,
                assigned=state.generation)  # its assignment came as it attached
            if link is not None:
                link.streams[i + 1] = self.streams[m.node_id]
            self.frames[m.node_id] = pb.NodeFrame(job=JOB, node_id=m.node_id, member_id=m.member_id, term=1,
                                                  generation=state.generation, ranks=[
                                                      pb.RankReport(local_rank=s, pid=10_000 + s, step=1,
                                                                    step_time_us=50_000, state=pb.RANK_STATE_RUNNING)
                                                      for s in range(slots)])
        senders = self.links if self.relayed else self.frames  # who sends the leader a message each interval
        self.phases = {k: zlib.crc32(k.encode()) / 2**32 * self.interval for k in senders}
        self.by_phase = sorted(self.phases, key=self.phases.get)
        self.victim = random.Random(7).choice(sorted(self.frames, key=lambda n: zlib.crc32(n.encode())))
        if self.relayed:  # every node's first frame, as its relay attached it (not timed: no steady cost)
            for node_id, frame in self.frames.items():
                self.leader.on_frame(self.streams[node_id], frame)
        self.killed_at = self.last_frame_of_victim = None
        self.reported = False
        self.frame_cost: list[float] = []
        self.frame_count = 0
        self.quiet_ticks: list[float] = []
        self.decided = self.change_s = self.change_stall_s = self.map_queued_s = None
        self._decided_cpu = None
        real_decide = leader_module.decide

        def decide(*args):  # when the decision was made: the map's queueing counts from there
            decision = real_decide(*args)
            self._decided_cpu = time.process_time()
            return decision

        leader_module.decide = decide

    def due(self, t0: float, t: float) -> list[str]:
        """The nodes whose phase falls in (t0, t] of the interval."""
        lo, hi = t0 % self.interval, t % self.interval
        return [n for n in self.by_phase
                if (lo < self.phases[n] <= hi if lo < hi else (self.phases[n] > lo or self.phases[n] <= hi))]

    def send(self, t: float, step: int, due: list[str]) -> None:
        """The due nodes' frames (the victim's, once killed, not) into the leader, timed; relayed,
        the due relays' summaries."""
        if self.relayed:
            self.summarise(t, step, due)
            return
        batch = []
        for node_id in due:
            if self.killed_at is not None and node_id == self.victim:
                continue
            frame = self.frames[node_id]
            for r in frame.ranks:
                r.step = step
            frame.generation = self.leader.state.generation
            batch.append((self.streams[node_id], frame))
            if node_id == self.victim:
                self.last_frame_of_victim = t
        self.clock[0] = t
        began = time.thread_time()
        for stream, frame in batch:
            self.leader.on_frame(stream, frame)
        if batch:
            self.frame_cost.append((time.thread_time() - began) / len(batch))
            self.frame_count += len(batch)

    def summarise(self, t: float, step: int, due: list[str]) -> None:
        """Each due relay's message: its summary of its nodes, every one of them at `step`."""
        self.clock[0] = t
        if self.killed_at is None:
            self.last_frame_of_victim = t  # its relay still hears it
        ups = [pb.RelayUp(job=JOB, relay=relay, summary=pb.RelaySummary(
            low_step=step, high_step=step, nodes=len(self.links[relay].streams))) for relay in due]
        began = time.thread_time()
        for relay, up in zip(due, ups):
            self.links[relay].receive(up)
        if ups:
            self.frame_cost.append((time.thread_time() - began) / len(ups))
            self.frame_count += len(ups)

    async def tally(self, t: float) -> None:
        """One tally, timed; a changed generation is the decision."""
        generation = self.leader.state.generation
        gaps: list[float] = []
        watching = asyncio.ensure_future(_loop_gaps(gaps))
        began = time.process_time()
        await self.leader.tally_once()
        took = time.process_time() - began
        watching.cancel()
        if self.leader.state.generation != generation:
            self.decided, self.change_s, self.change_stall_s = t, took, max(gaps, default=0.0)
            self.map_queued_s = time.process_time() - self._decided_cpu
        elif t > 2 * self.timing.grace_s:  # past the takeover grace and every node's first judgement
            self.quiet_ticks.append(took)
        for stream in self.streams.values() if not self.relayed else ():
            while not stream.queue.empty():  # the nodes read their directives
                stream.queue.get_nowait()
        for link in self.links.values():  # the relays read theirs
            while link.pending:
                link.take()

    async def run(self, steady_s: float) -> None:
        step, t = 1, 0.0
        while self.decided is None and t < steady_s + 10 * self.heartbeat_timeout_s:
            t0, t = t, t + self.tick_s
            step += 1
            if self.killed_at is None and t >= steady_s:
                self.killed_at = t
            if self.relayed and self.last_frame_of_victim is not None and not self.reported and \
                    t >= _relay_reports_at(self.last_frame_of_victim, self.heartbeat_timeout_s):
                self.reported = True
                self.clock[0] = t
                self.links[self.relay_of[self.victim]].receive(pb.RelayUp(job=JOB, relay=self.relay_of[self.victim], silent=[
                    pb.SilentStream(stream=self.streams[self.victim].stream_id,
                                    silent_ms=int((t - self.last_frame_of_victim) * 1000))]))
            self.send(t, step, self.due(t0, t))
            await self.tally(t)

    def report(self) -> dict:
        leader, nodes = self.leader, self.nodes
        evicted = [e.nodes for e in leader.state.history if e.kind in ("node_silent", "rank_silent", "rank_stalled")]
        frame_us = statistics.median(self.frame_cost) * 1e6
        return {
            "ranks": nodes * self.slots,
            "nodes": nodes,
            "mode": (f"relayed ({len(self.links)} relays, a summary each every {self.relay_progress_s} s)"
                     if self.relayed else "direct"),
            **({"relays": len(self.links), "summaries_per_s_per_relay": 1 / self.interval} if self.relayed else
               {"frames_per_s_per_node": 1 / self.interval}),
            "heartbeat_timeout_s": self.heartbeat_timeout_s,
            "tick_s": self.tick_s,
            "frames": self.frame_count,
            "frame_us": {"p50": round(frame_us, 2), "p99": round(percentile(self.frame_cost, 0.99) * 1e6, 2)},
            "tick_ms": _ms(self.quiet_ticks),
            "detection_s": round(self.decided - self.last_frame_of_victim, 3) if self.decided else None,
            "change_ms": round(self.change_s * 1e3, 1) if self.change_s else None,
            "map_queued_ms": round(self.map_queued_s * 1e3, 1) if self.map_queued_s is not None else None,
            "change_loop_held_ms": round(self.change_stall_s * 1e3, 1) if self.change_stall_s is not None else None,
            "new_world_size": leader.state.rank_map.world_size if leader.state.rank_map else 0,
            "evicted": [n for nodes_ in evicted for n in nodes_],
            "victim": self.victim,
            "process_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "leader_cpu_cores": round(frame_us * 1e-6 * len(self.phases) / self.interval
                                      + statistics.median(self.quiet_ticks) / self.tick_s, 4),
        }


async def simulate(ranks: int, slots: int, rate: float, heartbeat_timeout_s: float, tick_s: float,
                   steady_s: float, relay_progress_s: float | None = None, relay_nodes: int = 1000) -> dict:
    sim = Simulation(ranks, slots, rate, heartbeat_timeout_s, tick_s, relay_progress_s, relay_nodes)
    await sim.run(steady_s)
    return sim.report()


async def _loop_gaps(gaps: list[float]) -> None:
    """The stretches the event loop was held from this task (wall clock), while it runs."""
    while True:
        t = time.perf_counter()
        await asyncio.sleep(0)
        gaps.append(time.perf_counter() - t)


def _relay_reports_at(last_frame: float, heartbeat_timeout_s: float) -> float:
    """When a relay reports a node silent: its first look past the timeout, and a batch window."""
    look = heartbeat_timeout_s / 8
    return (int((last_frame + heartbeat_timeout_s) / look) + 1) * look + RELAY_BATCH_S


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=100_000)
    p.add_argument("--slots", type=int, default=8, help="ranks per node")
    p.add_argument("--rate", type=float, default=10.0, help="frames/s per node")
    p.add_argument("--heartbeat-timeout", type=float, default=1.5, help="seconds")
    p.add_argument("--tick", type=float, default=0.05, help="the leader's tally period, seconds")
    p.add_argument("--relayed", action="store_true", help="the nodes stream through relays (see above)")
    p.add_argument("--relay-progress", type=float, default=1.0, help="seconds between a relay's summaries (relayed)")
    p.add_argument("--relay-nodes", type=int, default=1000, help="nodes per relay (relayed)")
    p.add_argument("--steady", type=float, default=12.0,
                   help="simulated seconds before the victim stops (past the progress timeout's floor, 10 s: every "
                        "node's ranks are judged at least once)")
    args = p.parse_args()
    logs.configure("warning")
    result = {"benchmark": "scale", "host": {"cpus": os.cpu_count(),
                                             "loadavg_at_start": [round(x, 2) for x in os.getloadavg()]}}
    result.update(asyncio.run(simulate(args.ranks, args.slots, args.rate, args.heartbeat_timeout, args.tick,
                                       args.steady, args.relay_progress if args.relayed else None,
                                       args.relay_nodes)))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
