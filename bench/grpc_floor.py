"""What one grpc.aio process costs per streamed message before any work: the floor under a leader's
direct node frames. Prints one JSON object.

A server whose bidi handler only counts messages (the shape of `Coordinator.Session`) takes
`--streams` streams from client processes, each on a connection of its own and writing a `--bytes`
message `--rate` times a second at its own phase (as nodes do). Per window it reports the messages/s received and the
server's CPU per message: its main thread (the event loop, where a handler's Python runs) and the
whole process (gRPC's event-engine threads read and parse HTTP/2 beside it, on other cores).
`bench/capacity.py` reports the same two figures for a real leader (`leader_loop_us_per_node_frame`,
`leader_frame_cpu_us_per_node_frame`): the difference is what Muster's frame handling costs.

    python bench/grpc_floor.py                     # 500 streams x 10/s, 170-byte messages (an 8-rank NodeFrame)
    python bench/grpc_floor.py --shared            # every stream of a client process on one connection
    python bench/grpc_floor.py --loop asyncio      # on asyncio's own loop, not uvloop
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import sys
import time

import grpc
import uvloop

sys.path.insert(0, os.path.dirname(__file__))
from proc_cpu import cpu_seconds, loop_seconds  # noqa: E402 (imports nothing heavy: each spawned process imports it)

METHOD = "/floor.Floor/Stream"


async def _serve(conn, streams: int, windows: int, window_s: float) -> None:
    received, heard = 0, 0  # messages; streams that sent at least one

    async def stream(requests, context):
        nonlocal received, heard
        first = True
        async for _ in requests:
            received += 1
            heard += first
            first = False
        if False:  # an async generator, as a bidi handler is
            yield b""

    server = grpc.aio.server()
    handler = grpc.stream_stream_rpc_method_handler(stream)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("floor.Floor", {"Stream": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    conn.send(port)
    conn.recv()  # the clients stream: every stream heard from (a loaded machine opens them slowly), warm up, measure
    deadline = time.monotonic() + 60
    while heard < streams:
        if time.monotonic() > deadline:
            raise SystemExit(f"grpc_floor: {heard} of {streams} streams sent a message within 60s")
        await asyncio.sleep(0.05)
    await asyncio.sleep(1.0)
    pid, results = os.getpid(), []
    for _ in range(windows):
        n0, cpu0, loop0, t0 = received, cpu_seconds(pid), loop_seconds(pid), time.monotonic()
        await asyncio.sleep(window_s)
        n, elapsed = received - n0, time.monotonic() - t0
        results.append({"messages_per_s": round(n / elapsed, 1),
                        "loop_us_per_message": round((loop_seconds(pid) - loop0) * 1e6 / n, 1) if n else None,
                        "process_us_per_message": round((cpu_seconds(pid) - cpu0) * 1e6 / n, 1) if n else None})
    conn.send(results)
    await asyncio.Event().wait()  # ended by the parent after the clients: stopping first would fail their writes


def _server_main(conn, streams: int, windows: int, window_s: float, event_loop: str) -> None:
    run = uvloop.run if event_loop == "uvloop" else asyncio.run
    run(_serve(conn, streams, windows, window_s))


async def _stream_from(port: int, streams: int, rate: float, size: int, shared: bool) -> None:
    payload = os.urandom(size)
    # Each node has a connection of its own (a local subchannel pool per channel); --shared
    # multiplexes every stream of a client process on one.
    options = [] if shared else [("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) for _ in range(1 if shared else streams)]

    async def one(i: int) -> None:
        call = channels[i % len(channels)].stream_stream(METHOD)()
        await asyncio.sleep(i / streams / rate)  # each stream at its own phase
        due = time.monotonic()
        while True:
            await call.write(payload)
            due += 1 / rate
            await asyncio.sleep(max(0.0, due - time.monotonic()))

    try:
        await asyncio.gather(*(one(i) for i in range(streams)))
    finally:
        await asyncio.gather(*(c.close() for c in channels))


def _client_main(port: int, streams: int, rate: float, size: int, shared: bool) -> None:
    asyncio.run(_stream_from(port, streams, rate, size, shared))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=500)
    p.add_argument("--rate", type=float, default=10.0, help="messages/s per stream")
    p.add_argument("--bytes", type=int, default=170, help="message size (an 8-rank NodeFrame is ~170 bytes)")
    p.add_argument("--clients", type=int, default=2, help="client processes")
    p.add_argument("--shared", action="store_true", help="one connection per client process, not one per stream")
    p.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop",
                   help="the server's event loop (`muster serve` runs on uvloop)")
    p.add_argument("--windows", type=int, default=3)
    p.add_argument("--window", type=float, default=8.0, help="seconds per window")
    args = p.parse_args()
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # the clients are ended mid-stream: no GOAWAY notices
    ctx = multiprocessing.get_context("spawn")  # grpc does not survive a fork
    parent, child = ctx.Pipe()
    server = ctx.Process(target=_server_main, args=(child, args.streams, args.windows, args.window, args.loop), daemon=True)
    server.start()
    clients = []
    try:
        if not parent.poll(30):
            raise SystemExit("grpc_floor: the server did not start within 30s")
        port = parent.recv()
        shares = [args.streams // args.clients + (i < args.streams % args.clients) for i in range(args.clients)]
        clients = [ctx.Process(target=_client_main, args=(port, n, args.rate, args.bytes, args.shared),
                               daemon=True)
                   for n in shares]
        for c in clients:
            c.start()
        parent.send("go")
        if not parent.poll(90 + args.windows * args.window * 2):
            raise SystemExit("grpc_floor: no result from the server")
        windows = parent.recv()
    finally:
        for proc in (*clients, server):
            proc.terminate()
            proc.join(5)
    loop = [w["loop_us_per_message"] for w in windows if w["loop_us_per_message"]]
    process = [w["process_us_per_message"] for w in windows if w["process_us_per_message"]]
    print(json.dumps({
        "benchmark": "grpc_floor",
        "host": {"cpus": os.cpu_count(), "loadavg_at_start": [round(x, 2) for x in os.getloadavg()]},
        "grpcio": grpc.__version__, "event_loop": args.loop,
        "streams": args.streams, "rate_per_stream": args.rate, "message_bytes": args.bytes,
        "connections": "one per client process" if args.shared else "one per stream",
        "offered_per_s": args.streams * args.rate,
        "loop_us_per_message_p50": round(statistics.median(loop), 1) if loop else None,
        "process_us_per_message_p50": round(statistics.median(process), 1) if process else None,
        "windows": windows,
    }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
