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

Relayed (`--relayed`): the leader sees what relays forward (`relay.Changes`): each node's progress
once per `--relay-progress` (at its phase), on `RelayLink` streams (its directives wrapped for the
relays as on the wire), and the victim's silence as its relay reports it: at the relay's first
look past the heartbeat timeout (it looks every eighth of it), plus one batch window.

What it reports:
- frame_us: CPU of one `on_frame` (p50, p99 over batches of a tick), the protobuf already parsed;
- tick_ms: the tallies with nothing to decide (p50, p99, max);
- detection_s: simulated time from the victim's last frame to the decision (the heartbeat timeout
  included);
- change_ms: CPU of the tally that decided: liveness, decide, the fenced write (with its
  encoding), every surviving node's directive built and queued; change_loop_held_ms: the longest
  the event loop went without running another task meanwhile (wall clock: frames wait that long);
- evicted: the nodes the run evicted (the victim alone, or load evicted someone);
- leader_cpu_cores: the CPU the leader needs at this rate, frames and ticks together (one core is
  all a Python process has).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
import zlib
from pathlib import Path

from muster import logs
from muster.coordinator.core.policy import Timing
from muster.coordinator.core.state import encode
from muster.coordinator.coordination import LeaderKey
from muster.coordinator.leader import JobLeader
from muster.coordinator.leadership import Leadership
from muster.coordinator.relay import RelayLink
from muster.coordinator.server import stream_end
from muster.coordinator.streams import NodeStream
from muster.coordinator.twins import MemoryJobStore
from muster.v1 import muster_pb2 as pb

sys.path.insert(0, str(Path(__file__).parent))
from capacity import JOB, running_state  # noqa: E402
from recovery import percentile  # noqa: E402


def _ms(values: list[float]) -> dict:
    return {"p50": round(statistics.median(values) * 1e3, 3), "p99": round(percentile(values, 0.99) * 1e3, 3),
            "max": round(max(values) * 1e3, 3)}


RELAY_BATCH_S = 0.02


async def simulate(ranks: int, slots: int, rate: float, heartbeat_timeout_s: float, tick_s: float,
                   steady_s: float, relay_progress_s: float | None = None) -> dict:
    nodes = ranks // slots
    relayed = relay_progress_s is not None
    interval = relay_progress_s if relayed else 1 / rate
    timing = Timing(heartbeat_interval_s=interval, heartbeat_timeout_s=heartbeat_timeout_s, grace_s=1.0)
    state = running_state(nodes, slots)
    encode(state)  # as a leader that wrote it before: members keep their encoded text
    clock = [0.0]
    leader = JobLeader(state, leadership=Leadership(LeaderKey(JOB, 1, "bench", "127.0.0.1:7600"), MemoryJobStore()),
                       address="127.0.0.1:7600", timing=timing, tick_s=tick_s, clock=lambda: clock[0])
    frames, streams, phases = {}, {}, {}
    link = RelayLink(leader, "relay", stream_end) if relayed else None
    for i, m in enumerate(state.members):
        streams[m.node_id] = leader.streams[m.node_id] = NodeStream(JOB, m.node_id, m.member_id, m.kind, link=link,
                                                                    stream_id=i + 1)
        frames[m.node_id] = pb.NodeFrame(job=JOB, node_id=m.node_id, member_id=m.member_id, term=1,
                                         generation=state.generation, ranks=[
                                             pb.RankReport(local_rank=s, pid=10_000 + s, step=1, step_time_us=50_000,
                                                           state=pb.RANK_STATE_RUNNING) for s in range(slots)])
        phases[m.node_id] = zlib.crc32(m.node_id.encode()) / 2**32 * interval
    by_phase = sorted(phases, key=phases.get)
    victim = random.Random(7).choice(by_phase)
    killed_at = last_frame_of_victim = None
    frame_cost, frame_count, quiet_ticks = [], 0, []
    decided = change_s = change_stall_s = None
    reported = False
    step = 1
    t = 0.0
    while decided is None and t < steady_s + 10 * heartbeat_timeout_s:
        t0, t = t, t + tick_s
        step += 1
        # The nodes whose phase falls in (t0, t] of the interval send a frame.
        lo, hi = t0 % interval, t % interval
        due = [n for n in by_phase if (lo < phases[n] <= hi if lo < hi else (phases[n] > lo or phases[n] <= hi))]
        if killed_at is None and t >= steady_s:
            killed_at = t
        if relayed and last_frame_of_victim is not None and not reported and \
                t >= _relay_reports_at(last_frame_of_victim, heartbeat_timeout_s):
            reported = True
            leader.silent_at_relay(streams[victim], int((t - last_frame_of_victim) * 1000))
        batch = []
        for node_id in due:
            if killed_at is not None and node_id == victim:
                continue
            frame = frames[node_id]
            for r in frame.ranks:
                r.step = step
            frame.generation = leader.state.generation
            batch.append((streams[node_id], frame))
            if node_id == victim:
                last_frame_of_victim = t
        clock[0] = t
        began = time.thread_time()
        for stream, frame in batch:
            leader.on_frame(stream, frame)
        if batch:
            frame_cost.append((time.thread_time() - began) / len(batch))
            frame_count += len(batch)
        generation = leader.state.generation
        gaps: list[float] = []
        watching = asyncio.ensure_future(_loop_gaps(gaps))
        began = time.process_time()
        await leader.tally_once()
        took = time.process_time() - began
        watching.cancel()
        if leader.state.generation != generation:
            decided, change_s, change_stall_s = t, took, max(gaps, default=0.0)
        elif t > 2 * timing.grace_s:  # past the takeover grace and every node's first judgement
            quiet_ticks.append(took)
        for stream in streams.values():
            while not stream.queue.empty():  # the nodes read their directives
                stream.queue.get_nowait()
        while link is not None and link.out:  # the relays read theirs
            link.take()
    evicted = [e.nodes for e in leader.state.history if e.kind in ("node_silent", "rank_silent", "rank_stalled")]
    frame_us = statistics.median(frame_cost) * 1e6
    return {
        "ranks": nodes * slots,
        "nodes": nodes,
        "mode": f"relayed (progress every {relay_progress_s} s)" if relayed else "direct",
        "frames_per_s_per_node": 1 / interval,
        "heartbeat_timeout_s": heartbeat_timeout_s,
        "tick_s": tick_s,
        "frames": frame_count,
        "frame_us": {"p50": round(frame_us, 2), "p99": round(percentile(frame_cost, 0.99) * 1e6, 2)},
        "tick_ms": _ms(quiet_ticks),
        "detection_s": round(decided - last_frame_of_victim, 3) if decided else None,
        "change_ms": round(change_s * 1e3, 1) if change_s else None,
        "change_loop_held_ms": round(change_stall_s * 1e3, 1) if change_stall_s is not None else None,
        "new_world_size": leader.state.rank_map.world_size if leader.state.rank_map else 0,
        "evicted": [n for nodes_ in evicted for n in nodes_],
        "victim": victim,
        "leader_cpu_cores": round(frame_us * 1e-6 * nodes / interval + statistics.median(quiet_ticks) / tick_s, 3),
    }


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
    p.add_argument("--relay-progress", type=float, default=1.0, help="seconds (relayed)")
    p.add_argument("--steady", type=float, default=12.0,
                   help="simulated seconds before the victim stops (past the progress timeout's floor, 10 s: every "
                        "node's ranks are judged at least once)")
    args = p.parse_args()
    logs.configure("warning")
    result = {"benchmark": "scale", "host": {"cpus": os.cpu_count(),
                                             "loadavg_at_start": [round(x, 2) for x in os.getloadavg()]}}
    result.update(asyncio.run(simulate(args.ranks, args.slots, args.rate, args.heartbeat_timeout, args.tick,
                                       args.steady, args.relay_progress if args.relayed else None)))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
