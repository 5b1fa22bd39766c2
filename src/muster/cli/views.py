"""The read-only verbs: `muster status`, `events`, `jobs` and `logs`, once or followed."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import grpc

from muster import rank_logs
from muster.logs import as_text
from muster.terminal import escaped
from muster.json_output import as_json, status_document
from muster.cli.calls import ask, coordinators_of, job_of, retry_later, run_over, when


def status(args: argparse.Namespace) -> int:
    from muster.v1 import muster_pb2 as pb

    job = job_of(args)
    if (args.node or args.page_token) and not job:
        raise ValueError("--node and --page-token need the job: muster status JOB ...")
    if args.page_size < 0:
        raise ValueError("--page-size must be at least 0")
    states = [s.strip() for s in args.states.split(",") if s.strip()] if args.states else []
    if args.run and not job:
        raise ValueError("--run needs the job: muster status JOB --run N")
    request = pb.StatusRequest(job=job, page_size=args.page_size, page_token=args.page_token or "",
                               node=args.node or "", states=states, run=args.run)
    if not args.watch:
        print("\n".join(status_view(args, job, ask(args, "Status", request))))
        return 0
    with coordinators_of(args) as coordinators:
        return _watch(args, lambda: status_view(args, job, ask(args, "Status", request, coordinators)))


def status_view(args: argparse.Namespace, job: str, response) -> list[str]:
    """`muster status`'s output lines: the table, or the JSON document (one line under --watch)."""
    doc = status_document(response, job)
    if args.json:
        return [json.dumps(doc, indent=None if args.watch else 2)]
    jobs = doc["jobs"]
    out = [f"replica {doc['replica']}  muster {doc['version'] or '-'}"]  # (a replica before versions says none)
    if not jobs:
        return out + ["no jobs"]
    for j in jobs:
        live = f"  phase {j['phase']}" if j["outcome"] == "running" else ""
        out.append(f"job {j['name']}  run {j['run']}  {j['outcome']}  leader {j['leader'] or '-'}  term {j['term']}  "
                   f"generation {j['generation']}  world_size {j['world_size']}{live}")
        if j["outcome"] != "running":
            out.append(f"  ended {when(j['ended_unix_ms'])}: {j['outcome_reason']}")
        if s := j["summary"]:  # the first page
            counts = ", ".join(f"{n} {state}" for state, n in sorted(s["rank_states"].items())) or "none"
            out.append(f"  nodes {s['nodes']}  spares {s['spares']}  ranks: {counts}")
        if h := j["health"]:
            out.append(f"  live ranks {h['live_ranks']}  frames/s {h['frames_per_second']:.1f}  evictions "
                       f"{h['evictions']}  last detection {h['last_detection_s']:.3f}s  last recovery "
                       f"{h['last_recovery_s']:.3f}s")
            if restored := [r for r in h["recent_recoveries"] if r["tier"]]:
                r = restored[-1]
                out.append(f"  last restore g{r['generation']}: {_restored(r['tier'], r['step'], r['steps_lost'])}")
        if snapshotting := [r for r in j["ranks"] if r["snapshot_every"]]:
            out.append(_snapshots_line(snapshotting))
        out.append(f"  {'RANK':>5} {'LOCAL':>5} {'NODE':<24} {'NODE_RANK':>9} {'HOST':<15} {'PID':>8} {'STEP':>10} "
                   f"{'COMPUTE':>9} {'STRAGGLER':>9} {'RESTARTS':>8}  STATE")
        for r in j["ranks"]:
            compute = f"{r['compute_us'] / 1000:.1f}ms" if r["compute_us"] else "-"
            straggler = f"{r['straggler_factor']:.2f}x" if r["straggler_factor"] else "-"
            out.append(f"  {r['rank']:>5} {r['local_rank']:>5} {r['node']:<24} {r['node_rank']:>9} "
                       f"{r['host'] or '-':<15} {r['pid'] or '-':>8} {r['step']:>10} {compute:>9} {straggler:>9} "
                       f"{r['restarts']:>8}  {r['state']}" + (f" ({r['phase']})" if r["phase"] else ""))
        if j["next_page_token"]:
            out.append(f"  more ranks: --page-token {j['next_page_token']} (or --all)")
        if s:
            unlisted = s["spares"] - len(j["spares"])
            out.append(f"  spares: {', '.join(j['spares']) or '-'}" + (f" (+{unlisted} more)" if unlisted else ""))
    return [escaped(line) for line in out]  # phases, reasons, hosts: others' text


def _snapshots_line(ranks: list[dict]) -> str:
    """The peer snapshots of the ranks shown (the page's): their period and the host memory they take."""
    every = sorted({r["snapshot_every"] for r in ranks})
    held = [r["snapshot_bytes"] or 0 for r in ranks]
    return (f"  peer snapshots every {'/'.join(map(str, every))} steps on {len(ranks)} ranks shown: host memory "
            f"{max(held) / (1 << 20):.1f} MiB on the rank holding most, {sum(held) / (1 << 20):.1f} MiB in all")


def _watch(args: argparse.Namespace, view) -> int:
    """`view()`'s lines every --interval seconds until Ctrl-C: redrawn in place on a terminal (as
    `watch` does, cut to its size), else one frame after another (--json: a document per line)."""
    in_place = sys.stdout.isatty() and not args.json
    try:
        while True:
            began = time.monotonic()
            try:
                lines = view()
            except grpc.RpcError as exc:
                if not retry_later(exc):
                    raise
                lines = [f"no answer: {exc.code().name}: {exc.details()}"] if not args.json else []
            if in_place:
                size = shutil.get_terminal_size()
                header = f"every {args.interval:g}s: muster {args.verb}  {time.strftime('%H:%M:%S %z')}"
                shown = [header, "", *lines][:max(1, size.lines - 1)]
                # home, each line over the last frame's (erasing its rest), then the screen's rest: no flicker
                sys.stdout.write("\x1b[H" + "".join(f"{line[:size.columns]}\x1b[K\n" for line in shown) + "\x1b[J")
            elif lines:
                print("\n".join(lines) + ("" if args.json else "\n"))
            sys.stdout.flush()
            time.sleep(max(0.0, args.interval - (time.monotonic() - began)))
    except KeyboardInterrupt:  # the way out: no traceback, the terminal as it was
        return 0


def events(args: argparse.Namespace) -> int:
    from muster.v1 import muster_pb2 as pb

    request = pb.EventsRequest(job=job_of(args), run=args.run)
    if not args.follow:
        response = ask(args, "Events", request)
        if args.json:
            print(json.dumps(as_json(response), indent=2))
        else:
            for e in response.events:
                print(_event_line(e))
            for r in response.recoveries:
                print(_recovery_line(r))
        return 0
    with coordinators_of(args) as coordinators:
        return _follow_events(args, request, coordinators)


def _follow_events(args: argparse.Namespace, request, coordinators) -> int:
    """The run's events as they come (asked every --interval), until its record is final or Ctrl-C;
    one run: the name's next run is not this one's history. --json: each event a document on a line."""
    last, asked = None, False
    try:
        while True:
            try:
                over = asked and run_over(args, request.job, request.run, coordinators)
                response = coordinators.call("Events", request)
            except grpc.RpcError as exc:
                if not asked or not retry_later(exc):
                    raise
            else:
                asked, request.run = True, response.run
                new = _after(response.events, last)
                for e in new:
                    print(json.dumps({"job": response.job, "run": response.run, "event": as_json(e)})
                          if args.json else _event_line(e), flush=True)
                last = new[-1] if new else last
                if over:  # known before these events were asked for: they are the run's last
                    return 0
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0


def _after(events, last) -> list:
    """The events after `last`. The history keeps the latest N: where `last` is no longer in it,
    every event it holds is newer."""
    if last is not None:
        for i in range(len(events) - 1, -1, -1):
            if events[i] == last:
                return list(events[i + 1:])
    return list(events)


def _event_line(e) -> str:
    return escaped(f"{when(e.time_unix_ms)}  g{e.generation:<4} term {e.term:<6} {e.kind:<16} "
                   f"{','.join(e.nodes):<24} {e.reason}")


def _recovery_line(r) -> str:
    """A recovery's timeline (RecoveryRecord), its phases in order and the slowest named."""
    rate = f" {r.bytes_moved / r.transfer_s / (1 << 20):.1f} MiB/s" if r.transfer_s and r.bytes_moved else ""
    took = f"superseded by g{r.superseded_by} after {r.recovery_s:.3f}s" if r.superseded_by else f"{r.recovery_s:.3f}s"
    first = "" if r.superseded_by else f", first step {r.first_step_s:.3f}s"
    return (f"recovery g{r.generation} {'planned' if r.planned else 'after a failure'}: {took} "
            f"(detected {r.detection_s:.3f}s, decided {when(r.decided_unix_ms)}, maps delivered {r.delivered_s:.3f}s, "
            f"old group aborted {r.abort_s:.3f}s, new group formed {r.form_s:.3f}s, state moved {r.sync_s:.3f}s "
            f"{r.bytes_moved / (1 << 20):.1f} MiB{rate}{first}); slowest: {r.slowest}"
            + (f"; {_restored(r.tier, r.step, r.steps_lost)}" if r.tier else ""))


def _restored(tier: str, step: int, lost: int) -> str:
    """Where a recovery's state came from (RecoveryRecord.tier), the step and the steps lost."""
    source = {"replica": "the ranks' own state (in memory)", "snapshot": "peer snapshots",
              "checkpoint": "the durable checkpoint", "none": "nothing: lost beyond every tier, begun again"}
    return f"state from {source.get(tier, tier)} at step {step}, {lost} step{'s' * (lost != 1)} lost"


def jobs(args: argparse.Namespace) -> int:
    from muster.v1 import muster_pb2 as pb

    response = ask(args, "Jobs", pb.JobsRequest(job=job_of(args)))
    if args.json:
        print(json.dumps(as_json(response), indent=2))
        return 0
    print(f"{'JOB':<24} {'RUN':>4} {'OUTCOME':<10} {'WORLD':>6} {'GEN':>5} {'STEP':>9} {'STEP/S':>7} {'STARTED':<25} "
          f"{'ENDED':<25} REASON")
    for j in response.jobs:
        rate = f"{j.steps_per_second:.1f}" if j.steps_per_second else "-"
        print(f"{j.name:<24} {j.run:>4} {j.outcome:<10} {j.world_size:>6} {j.generation:>5} {j.step or '-':>9} "
              f"{rate:>7} {when(j.started_unix_ms):<25} {when(j.ended_unix_ms):<25} {escaped(j.reason)}")
    return 0


def logs(args: argparse.Namespace) -> int:
    """The ranks' output from the agents' --log-dir (shared, or this node's), the job's run's part of
    it: the last --tail lines of each chosen slot's latest start, then with --follow what they write
    next, until the run ends (asked every --interval) or Ctrl-C."""
    from muster.v1 import muster_pb2 as pb

    given = args.log_dir or os.environ.get("MUSTER_LOG_DIR")
    if not given:
        raise ValueError("--log-dir is required (or set MUSTER_LOG_DIR): the directory given to muster run --log-dir")
    log_dir = Path(given)
    if not log_dir.is_dir():
        raise ValueError(f"--log-dir {log_dir}: no such directory")
    if args.tail < 0:
        raise ValueError("--tail must be at least 0")
    job = job_of(args)
    with coordinators_of(args) as coordinators:
        # Asked first whatever the flags: the caller's token must let it see the job (as `status`),
        # and the answer names the run, whose directory alone is read.
        every_page = argparse.Namespace(**{**vars(args), "all": args.rank is not None})
        js = ask(every_page, "Status", pb.StatusRequest(job=job, run=args.run, page_size=0 if args.rank is not None
                                                         else 1), coordinators).jobs[0]
        run = rank_logs.run_dir(log_dir, job, js.run)
        chosen = _log_slots(args, js, run)
        followers = []
        for node, slot, path in chosen:
            lines, offset = rank_logs.tail(path, args.tail)
            _print_logs(args, node, slot, lines)
            followers.append(rank_logs.Follower(node, slot, path, offset))
        if not args.follow:
            return 0
        try:
            while True:
                time.sleep(args.interval)
                over = run_over(args, job, js.run, coordinators)
                for f in followers:
                    _print_logs(args, f.node, f.slot, f.read(run))
                if over:
                    return 0
        except KeyboardInterrupt:
            return 0


def _log_slots(args, js, run: Path) -> list[tuple[str, int | None, Path]]:
    """(node, slot, latest file) of what to show from the run's directory: the slot that runs --rank
    now, or --node's agent (slot None) and slots, or every member node's (`js`: the job's status)."""
    if args.rank is not None:
        r = next((r for r in js.ranks if r.rank == args.rank), None)
        if r is None:
            raise ValueError(f"job {js.name} has no rank {args.rank} in generation {js.generation} "
                             f"(world size {js.world_size})")
        if args.node and args.node != r.node:
            raise ValueError(f"rank {args.rank} of job {js.name} runs on node {r.node}, not {args.node}")
        wanted = [(r.node, r.local_rank)]
    elif args.node:
        wanted = [(args.node, None)]
    else:
        if not js.nodes:
            raise ValueError(f"job {js.name} has no member nodes now (its run ended?): name one with --node")
        wanted = [(n, None) for n in js.nodes]
    chosen: list[tuple[str, int | None, Path]] = []
    if run.is_dir():
        for node, only in wanted:
            agent = rank_logs.agent_log(run, node)
            chosen += [(node, None, agent)] if only is None and agent.is_file() else []
            chosen += [(node, slot, files[-1][1]) for slot, files in sorted(rank_logs.starts(run, node, only).items())]
    if not chosen:
        names = ", ".join(n for n, _ in wanted[:5]) + (" ..." if len(wanted) > 5 else "")
        raise ValueError(f"no logs of {names} in {run} (muster run --log-dir writes them there)")
    return chosen


def _print_logs(args, node: str, slot: int | None, lines: list[str]) -> None:
    prefix = "" if args.rank is not None else f"{node}/{'agent' if slot is None else slot}| "
    for line in lines:
        for part in [line] if slot is not None else as_text(line).splitlines():  # an agent's: JSON records
            print(prefix + escaped(part))
    sys.stdout.flush()
