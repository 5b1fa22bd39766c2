"""The `muster` command: serve (coordinator), run (node agent), demo, completion, and the client
verbs: status, events, logs, jobs, stop, drain, delete."""

from __future__ import annotations

import argparse
import asyncio
import difflib
import json
import os
import re
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import structlog

from muster import logs, rank_logs, version
from muster.terminal import escaped
from muster.json_output import as_json, status_document
from muster.net import address_towards, is_loopback, split_host_port
from muster.coordinator.core.policy import DEFAULT_MAX_MEMBERS, MAX_NODES, STRAGGLER_ACTIONS, JobSpec
from muster.worker.outcome import EXIT_STATUS_HELP
from muster.worker.agent.zygote import PRELOAD

log = structlog.get_logger(__name__)


def _serve(args: argparse.Namespace) -> int:
    import uvloop

    from muster.coordinator.auth import Tokens
    from muster.coordinator.core.policy import InvalidPolicy, Timing
    from muster.coordinator.core.stragglers import StragglerPolicy
    from muster.coordinator.replica import ReplicaConfig
    from muster.coordinator.service import ServeConfig, serve

    try:
        timing = Timing(
            heartbeat_interval_s=args.heartbeat_interval,
            heartbeat_timeout_s=args.heartbeat_timeout,
            progress_timeout_s=args.progress_timeout,
            progress_floor_s=args.progress_floor,
            progress_factor=args.progress_factor,
            grace_s=args.grace,
            last_call_s=args.last_call,
            form_timeout_s=args.form_timeout,
            switch_lead_s=args.switch_lead,
            relay_progress_s=args.relay_progress,
            waiting_timeout_s=args.waiting_timeout,
            stop_grace_s=args.stop_grace,
        ).validate()
        if args.relay_min_nodes < 1 or not 0 < args.relay_batch <= 1:
            raise ValueError(f"--relay-min-nodes must be at least 1 (got {args.relay_min_nodes}) and --relay-batch "
                             f"within (0, 1] seconds (got {args.relay_batch})")
        replica = ReplicaConfig(
            timing=timing,
            default_spec=JobSpec(args.min_nodes, args.max_nodes, args.world_size_multiple).validate(),
            tick_s=args.tick,
            session_ttl_s=args.session_ttl,
            limits=_limits(args),
            stragglers=StragglerPolicy(args.straggler_action, args.straggler_factor, args.straggler_min_steps,
                                       duration(args.straggler_window), args.straggler_replace_max),
            relay=not args.no_relay,
            relay_min_nodes=args.relay_min_nodes,
            relay_batch_s=args.relay_batch,
            retain_finished_s=duration(args.retain_finished),
        )
        etcd_access = _etcd_access(args)
        tls = _tls_files(args, "tls_client_ca", "tls_cert", "tls_key")
        if tls.ca and not tls.cert:  # mTLS without TLS would serve plaintext, checking nobody
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key: client certificates are checked "
                             "only over TLS")
        peer_tls = _tls_files(args, "peer_tls_ca", "peer_tls_cert", "peer_tls_key")
        _check_listen(args, bool(tls.cert))
        _ports_free(args)
        if args.tokens:
            Tokens.load(args.tokens)  # its mode and lines, before anything starts
    except (InvalidPolicy, OSError, ValueError) as exc:
        # The policy names its fields (heartbeat_timeout_s): the user wrote flags (--heartbeat-timeout).
        print("muster serve: " + re.sub(r"\b([a-z]+(?:_[a-z]+)*)_s\b", lambda m: "--" + m[1].replace("_", "-"),
                                        str(exc)), file=sys.stderr)
        return 2
    config = ServeConfig(
        listen=args.listen,
        advertise=args.advertise,
        etcd=tuple(e.strip().removeprefix("http://") for e in args.etcd.split(",") if e.strip()) if args.etcd else (),
        data_dir=Path(args.data_dir),
        max_message_bytes=args.max_message_bytes,
        metrics_listen=args.metrics_listen,
        http=args.http,
        http_hosts=tuple(args.http_host),
        metrics_open=args.metrics_open,
        tokens_file=args.tokens or "",
        tls=tls,
        etcd_access=etcd_access,
        replica=replica,
        peer_tls=peer_tls,
    )
    try:
        # uvloop: a quarter less of the event loop's CPU per node frame than asyncio's own loop
        # (1,000 nodes x 15 frames/s, A/B twice: 35-37 vs 43-46 us), where every frame's Python runs.
        uvloop.run(serve(config))
    except Exception as exc:  # a clear line for the operator, the traceback in the log
        print(f"muster serve: {exc}", file=sys.stderr)
        return 1
    return 0


def _limits(args: argparse.Namespace):
    """serve's limits: the deployment's, then each --job-quota's for its job."""
    from muster.coordinator.core.policy import Limits

    limits = Limits(args.max_jobs, args.max_nodes_per_job, args.max_frames_per_second,
                    max_spares=args.max_spares_per_job, joins_per_s=args.max_joins_per_second,
                    idle_streams=args.max_idle_streams, relay_calls=args.max_relay_calls,
                    generations_per_min=args.max_generations_per_minute, runs_per_hour=args.max_runs_per_hour,
                    runs_kept=args.max_runs_kept, etcd_mib_per_min=args.max_etcd_mib_per_minute).validate()
    for text in args.job_quota:
        limits = limits.with_job_quota(text)
    return limits


def _check_listen(args: argparse.Namespace, tls: bool) -> None:
    """The addresses, before anything starts (etcd included); and no open door by default: an
    address beyond loopback needs TLS or tokens, or --insecure said out loud."""
    for flag in ("listen", "advertise", "metrics_listen"):
        if getattr(args, flag):
            try:
                split_host_port(getattr(args, flag))
            except ValueError as exc:
                raise ValueError(f"--{flag.replace('_', '-')}: {exc}") from None
    if args.http and not args.metrics_listen:
        raise ValueError("--http serves the page on the metrics port: give --metrics-listen HOST:PORT")
    if args.http and not (args.insecure or args.tokens and tls
                          or is_loopback(split_host_port(args.metrics_listen)[0])):
        raise ValueError(f"--http on {args.metrics_listen} shows every job to anyone who reaches the port, and takes "
                         "their tokens: add --tokens (the page then asks for one) and --tls-cert/--tls-key (it serves "
                         "HTTPS with them: no token in the clear), or --insecure to serve it so anyway")
    host, _ = split_host_port(args.listen)
    if not (tls or args.tokens or args.insecure or is_loopback(host)):
        raise ValueError(f"--listen {args.listen} reaches beyond this host with neither TLS (--tls-cert) nor tokens "
                         "(--tokens): anyone who reaches the port could stop or delete any job; add them, or "
                         "--insecure to serve so anyway")


def _ports_free(args: argparse.Namespace) -> None:
    """The replica's ports, tried before etcd starts: one in use is refused in a line (gRPC said so
    only after etcd had started, in its own words)."""
    for flag in ("listen", "metrics_listen"):
        address = getattr(args, flag)
        host, port = split_host_port(address) if address else ("", 0)
        if not port:
            continue
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (a port in TIME_WAIT is free)
            try:
                probe.bind((host, port))
            except OSError as exc:
                raise OSError(f"--{flag.replace('_', '-')} {address}: {exc.strerror} (another muster serve, or "
                              "another program, holds it)") from None


def duration(text: str) -> float:
    """Seconds from `90`, `90s`, `15m`, `12h` or `7d`."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    number, unit = (text[:-1], units[text[-1]]) if text and text[-1] in units else (text, 1)
    try:
        seconds = float(number) * unit
    except ValueError:
        raise ValueError(f"{text!r} is no duration (e.g. 3600, 90s, 15m, 12h, 7d)") from None
    if not 0 <= seconds < 10**9:
        raise ValueError(f"duration {text!r} is out of range")
    return seconds


def _etcd_access(args: argparse.Namespace):
    """etcd TLS and auth from the flags; the password from a file or $MUSTER_ETCD_PASSWORD, never argv."""
    from muster.coordinator.etcd.client import EtcdAccess

    password = ""
    if args.etcd_user:
        if args.etcd_password_file:
            password = _secret_file(args.etcd_password_file, "--etcd-password-file")
        else:
            password = os.environ.get("MUSTER_ETCD_PASSWORD", "")
        if not password:
            raise ValueError("--etcd-user needs a password: --etcd-password-file FILE or $MUSTER_ETCD_PASSWORD")
    return EtcdAccess(_tls_files(args, "etcd_cacert", "etcd_cert", "etcd_key"), args.etcd_user or "", password)


def _tls_files(args: argparse.Namespace, ca: str, cert: str, key: str):
    """The TLS files three flags name (by their dests), checked: errors name the flags."""
    from muster.security import TlsFiles

    names = (ca, cert, key)
    return TlsFiles(*(getattr(args, n) or "" for n in names)).check(tuple("--" + n.replace("_", "-") for n in names))


def _run(args: argparse.Namespace) -> int:
    from muster.client import parse_addresses
    from muster.worker.agent.agent import NodeAgent
    from muster.worker.agent.agent_config import AgentConfig
    from muster.worker.agent.launch import LaunchError, job_name, network_env, parse_nodes, plan

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        launch = plan(command)
        nodes = parse_nodes(args.nodes) if args.nodes else None
        if launch.nodes and nodes and launch.nodes != nodes:
            raise LaunchError(f"torchrun --nnodes {launch.nodes[0]}:{launch.nodes[1]} contradicts --nodes "
                              f"{args.nodes}: the coordinator owns the node count, give it once")
        if launch.slots and args.slots and launch.slots != args.slots:
            raise LaunchError(f"torchrun --nproc-per-node {launch.slots} contradicts --slots {args.slots}")
        if launch.max_restarts is not None and args.max_restarts is not None and launch.max_restarts != args.max_restarts:
            raise LaunchError(f"torchrun --max-restarts {launch.max_restarts} contradicts --max-restarts "
                              f"{args.max_restarts}")
        for flag in ("join_timeout", "form_timeout", "hold_timeout", "restart_backoff", "wait_report", "exit_timeout"):
            if not getattr(args, flag) >= 0:
                raise LaunchError(f"--{flag.replace('_', '-')} must be at least 0")
        if args.max_restarts is not None and args.max_restarts < 0:
            raise LaunchError("--max-restarts must be at least 0")
        JobSpec(straggler_factor=args.straggler_factor, straggler_min_steps=args.straggler_min_steps).validate()
        durable = _durable_env(args)
        coordinators = parse_addresses(args.coordinator)
        if launch.job is not None and args.job is not None and launch.job != args.job:
            raise LaunchError(f"torchrun --rdzv-id {launch.job} contradicts --job {args.job}: name the job once")
        args.job = args.job if args.job is not None else launch.job  # torchrun's id, when it alone names it
        if args.job is None:
            raise LaunchError("the job is required: --job JOB (or torchrun's --rdzv-id, or set MUSTER_JOB)")
        job = job_name(args.job)
    except ValueError as exc:  # LaunchError, a bad coordinator address or straggler policy
        print(f"muster run: {exc}", file=sys.stderr)
        return 2
    host = args.host or address_towards(list(coordinators))
    span = nodes or launch.nodes
    multi_node = bool(span) and span[1] > 1
    if is_loopback(host) and multi_node and not all(is_loopback(split_host_port(c)[0]) for c in coordinators):
        print(f"muster run: this node's address is {host}, which other hosts cannot reach: pass --host "
              "with an address of this host they can", file=sys.stderr)
    try:  # a job whose size is not known here may span hosts
        network = network_env(host, os.environ, multi_node or not span)
    except LaunchError as exc:
        print(f"muster run: {exc}", file=sys.stderr)
        return 2
    for note in launch.notes:
        print(f"muster run: {note}", file=sys.stderr)
    if job != args.job:
        print(f"muster run: job id {args.job!r} is job {job!r} at the coordinator (its names are 1-63 of "
              "[a-z0-9._-]; `muster status JOB` takes either)", file=sys.stderr)
    max_restarts = args.max_restarts if args.max_restarts is not None else launch.max_restarts
    node_id = args.node_id or f"{socket.gethostname()}-{os.getpid()}"
    if args.log_dir:  # the agent's own lines beside its ranks', for `muster logs`, from its Join on
        try:
            rank_logs.made_dir(Path(args.log_dir), job)  # the job's part now: one it cannot make is said at once
            logs.configure(args.log_level, json=args.log_json, copy=True)
        except OSError as exc:
            print(f"muster run: --log-dir {args.log_dir}: {exc.strerror}", file=sys.stderr)
            return 2
    config = AgentConfig(
        coordinators=tuple(coordinators),
        job=job,
        job_id=args.job,
        node_id=node_id,
        slots=launch.slots or args.slots or 1,
        argv=tuple(launch.argv),
        host=host,
        nodes=nodes or launch.nodes,
        world_size_multiple=args.world_size_multiple,
        stragglers=(args.straggler_action, args.straggler_factor, args.straggler_min_steps),
        on_state_lost=args.on_state_lost,
        max_restarts=3 if max_restarts is None else max_restarts,
        restart_backoff_s=args.restart_backoff,
        log_dir=Path(args.log_dir) if args.log_dir else None,
        hold_timeout_s=args.hold_timeout,
        join_timeout_s=args.join_timeout,
        form_timeout_s=args.form_timeout,
        wait_report_s=args.wait_report,
        exit_timeout_s=args.exit_timeout,
        warm_start=args.warm_start,
        step_probe=args.step_probe,
        preload=tuple(m.strip() for m in args.preload.split(",") if m.strip()),
        env={**network, **durable},
        security=_security(args),
    )
    try:
        return asyncio.run(NodeAgent(config).run())
    except KeyboardInterrupt:  # before the agent's own handler was in place
        return 128 + signal.SIGINT


def _durable_env(args: argparse.Namespace) -> dict[str, str]:
    """The durable tier `muster run` hands its ranks (--checkpoint-dir, --checkpoint-every)."""
    from muster.worker.agent.launch import checkpoint_every

    every = checkpoint_every(args.checkpoint_every)  # (LaunchError: the command line's, exit 2)
    if not args.checkpoint_dir:
        if args.checkpoint_every != "auto":
            raise ValueError("--checkpoint-every needs --checkpoint-dir")
        return {}
    return {"MUSTER_CHECKPOINT_DIR": args.checkpoint_dir, "MUSTER_CHECKPOINT_EVERY": str(every)}


def _demo(args: argparse.Namespace) -> int:
    from muster import demo

    return demo.run(args.duration, args.nodes, args.slots, Path(args.timeline))


def _security(args: argparse.Namespace):
    from muster.security import ClientSecurity

    token = _secret_file(args.token_file, "--token-file") if args.token_file else args.token
    return ClientSecurity(token, _tls_files(args, "tls_ca", "tls_cert", "tls_key"))


def _secret_file(path: str, flag: str) -> str:
    """A secret kept off the command line (which every local user reads in `ps`): a file's text."""
    try:
        secret = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{flag} {path}: {exc.strerror if isinstance(exc, OSError) else exc}") from exc
    if not secret:
        raise ValueError(f"{flag} {path}: the file is empty")
    return secret


def _job(args: argparse.Namespace) -> str:
    """The job as given, or as the coordinator names it (`muster run` maps ids such as `MyRun`)."""
    from muster.worker.agent.launch import job_name

    return job_name(args.job) if args.job else ""


def _coordinators(args):
    from muster.client import Coordinators

    return Coordinators(args.coordinator, timeout_s=args.timeout, security=_security(args))


def _ask(args, rpc: str, request, coordinators=None):
    """One call to any replica; `coordinators`: connections kept open across calls (--watch, --follow)."""
    if coordinators is None:
        with _coordinators(args) as coordinators:
            return _ask(args, rpc, request, coordinators)
    response = coordinators.call(rpc, request)
    if rpc == "Status":
        _live_pages(args, coordinators, request, response)
    return response


def _live_pages(args, coordinators, request, response) -> None:
    """Ranks and steps are live only at each job's leader: ask it for the same page; with `--all`
    follow the pages there (a job whose map changes meanwhile refuses the next token: run again)."""
    for js in response.jobs:
        ask = response.replica
        if not js.live and js.leader and js.leader != response.replica:
            try:
                js.CopyFrom(_page(args, coordinators, js.leader, request, js.name, request.page_token))
                ask = js.leader
            except grpc.RpcError:
                pass  # keep the persisted view
        while args.all and js.next_page_token:
            more = _page(args, coordinators, ask, request, js.name, js.next_page_token)
            js.ranks.extend(more.ranks)
            js.next_page_token = more.next_page_token


def _page(args, coordinators, address: str, request, job: str, token: str):
    from muster.v1 import muster_pb2 as pb

    asked = pb.StatusRequest()
    asked.CopyFrom(request)
    asked.job, asked.page_token = job, token
    return coordinators.stub(address).Status(asked, timeout=args.timeout, metadata=coordinators.security.metadata).jobs[0]


def _status(args: argparse.Namespace) -> int:
    from muster.v1 import muster_pb2 as pb

    job = _job(args)
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
        print("\n".join(_status_view(args, job, _ask(args, "Status", request))))
        return 0
    with _coordinators(args) as coordinators:
        return _watch(args, lambda: _status_view(args, job, _ask(args, "Status", request, coordinators)))


def _status_view(args: argparse.Namespace, job: str, response) -> list[str]:
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
            out.append(f"  ended {_when(j['ended_unix_ms'])}: {j['outcome_reason']}")
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


def _retry_later(exc: grpc.RpcError) -> bool:
    """A replica restarting or a leader changing: said on stderr, asked again at the next refresh.
    Any other refusal (a bad job name, a token) ends the command as it would without --watch."""
    from muster.client import TRANSIENT

    if exc.code() not in TRANSIENT:
        return False
    log.warning("no_answer_retrying", code=exc.code().name, details=exc.details())
    return True


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
                if not _retry_later(exc):
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


def _events(args: argparse.Namespace) -> int:
    from muster.v1 import muster_pb2 as pb

    request = pb.EventsRequest(job=_job(args), run=args.run)
    if not args.follow:
        response = _ask(args, "Events", request)
        if args.json:
            print(json.dumps(as_json(response), indent=2))
        else:
            for e in response.events:
                print(_event_line(e))
            for r in response.recoveries:
                print(_recovery_line(r))
        return 0
    with _coordinators(args) as coordinators:
        return _follow_events(args, request, coordinators)


def _follow_events(args: argparse.Namespace, request, coordinators) -> int:
    """The run's events as they come (asked every --interval), until its record is final or Ctrl-C;
    one run: the name's next run is not this one's history. --json: each event a document on a line."""
    last, asked = None, False
    try:
        while True:
            try:
                over = asked and _run_over(args, request.job, request.run, coordinators)
                response = coordinators.call("Events", request)
            except grpc.RpcError as exc:
                if not asked or not _retry_later(exc):
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
    return escaped(f"{_when(e.time_unix_ms)}  g{e.generation:<4} term {e.term:<6} {e.kind:<16} "
                   f"{','.join(e.nodes):<24} {e.reason}")


def _recovery_line(r) -> str:
    """A recovery's timeline (RecoveryRecord), its phases in order and the slowest named."""
    rate = f" {r.bytes_moved / r.transfer_s / (1 << 20):.1f} MiB/s" if r.transfer_s and r.bytes_moved else ""
    return (f"recovery g{r.generation} {'planned' if r.planned else 'after a failure'}: {r.recovery_s:.3f}s "
            f"(detected {r.detection_s:.3f}s, decided {_when(r.decided_unix_ms)}, maps delivered {r.delivered_s:.3f}s, "
            f"old group aborted {r.abort_s:.3f}s, new group formed {r.form_s:.3f}s, state moved {r.sync_s:.3f}s "
            f"{r.bytes_moved / (1 << 20):.1f} MiB{rate}, first step {r.first_step_s:.3f}s); slowest: {r.slowest}"
            + (f"; {_restored(r.tier, r.step, r.steps_lost)}" if r.tier else ""))


def _restored(tier: str, step: int, lost: int) -> str:
    """Where a recovery's state came from (RecoveryRecord.tier), the step and the steps lost."""
    source = {"replica": "the ranks' own state (in memory)", "snapshot": "peer snapshots",
              "checkpoint": "the durable checkpoint", "none": "nothing: lost beyond every tier, begun again"}
    return f"state from {source.get(tier, tier)} at step {step}, {lost} step{'s' * (lost != 1)} lost"


def _when(unix_ms: int | None) -> str:
    """A moment in the local time, with its offset (hosts and readers may be in other zones)."""
    return time.strftime("%Y-%m-%d %H:%M:%S %z", time.localtime(unix_ms / 1000)) if unix_ms else "-"


def _jobs(args: argparse.Namespace) -> int:
    from muster.v1 import muster_pb2 as pb

    response = _ask(args, "Jobs", pb.JobsRequest(job=_job(args)))
    if args.json:
        print(json.dumps(as_json(response), indent=2))
        return 0
    print(f"{'JOB':<24} {'RUN':>4} {'OUTCOME':<10} {'WORLD':>6} {'GEN':>5} {'STEP':>9} {'STEP/S':>7} {'STARTED':<25} "
          f"{'ENDED':<25} REASON")
    for j in response.jobs:
        rate = f"{j.steps_per_second:.1f}" if j.steps_per_second else "-"
        print(f"{j.name:<24} {j.run:>4} {j.outcome:<10} {j.world_size:>6} {j.generation:>5} {j.step or '-':>9} "
              f"{rate:>7} {_when(j.started_unix_ms):<25} {_when(j.ended_unix_ms):<25} {escaped(j.reason)}")
    return 0


def _stop(args: argparse.Namespace) -> int:
    from muster.v1 import muster_pb2 as pb

    response = _ask(args, "Stop", pb.StopRequest(job=_job(args), reason=args.reason or ""))
    at = f"after step {response.after_step}" if response.after_step else "now"
    _answer(args, response, f"job {_job(args)} run {response.run} stopped: every node drains {at}, its agents exit 3")
    return 0


def _drain(args: argparse.Namespace) -> int:
    from muster.v1 import muster_pb2 as pb

    response = _ask(args, "Drain", pb.DrainRequest(job=_job(args), node=args.node, reason=args.reason or ""))
    at = f"after step {response.after_step}" if response.after_step else "now"
    _answer(args, response, f"node {args.node} of job {_job(args)} leaves {at} (generation {response.generation} "
                            "runs without it)", node=args.node)
    return 0


def _delete(args: argparse.Namespace) -> int:
    from muster.v1 import muster_pb2 as pb

    response = _ask(args, "Delete", pb.DeleteRequest(job=_job(args), run=args.run))
    _answer(args, response, f"deleted {response.deleted} finished run(s) of job {_job(args)}")
    return 0


def _answer(args: argparse.Namespace, response, text: str, **named) -> None:
    """An operator verb's answer: the sentence, or with --json the job, what was named and the response."""
    print(json.dumps({"job": _job(args), **named, **as_json(response)}, indent=2) if args.json else text)


def _logs(args: argparse.Namespace) -> int:
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
    job = _job(args)
    with _coordinators(args) as coordinators:
        # Asked first whatever the flags: the caller's token must let it see the job (as `status`),
        # and the answer names the run, whose directory alone is read.
        every_page = argparse.Namespace(**{**vars(args), "all": args.rank is not None})
        js = _ask(every_page, "Status", pb.StatusRequest(job=job, run=args.run, page_size=0 if args.rank is not None
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
                over = _run_over(args, job, js.run, coordinators)
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


def _run_over(args, job: str, run: int, coordinators) -> bool:
    """The run has its outcome and no leader any more: its record, history included, is final (a
    replica that cannot tell now is asked again next time)."""
    from muster.v1 import muster_pb2 as pb

    try:
        js = coordinators.call("Status", pb.StatusRequest(job=job, run=run, brief=True)).jobs[0]
    except grpc.RpcError as exc:
        if not _retry_later(exc):
            raise
        return False
    return js.outcome != "running" and not js.leader


def _print_logs(args, node: str, slot: int | None, lines: list[str]) -> None:
    prefix = "" if args.rank is not None else f"{node}/{'agent' if slot is None else slot}| "
    for line in lines:
        for part in [line] if slot is not None else logs.as_text(line).splitlines():  # an agent's: JSON records
            print(prefix + escaped(part))
    sys.stdout.flush()


DEFAULT_ADDRESS = "127.0.0.1:7600"  # where `muster serve` listens, and where the other verbs look, by default


class OneLineParser(argparse.ArgumentParser):
    """Bad input is one line naming the flag, and exit status 2: not the usage, which buries it."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message}{self._suggestion(message)} (see {self.prog} --help)\n")

    def _suggestion(self, message: str) -> str:
        """'; did you mean X?' for a mistyped verb, choice or flag (`stauts`, `--nodse`)."""
        found = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if found:
            word, known = found[1], re.findall(r"'([^']*)'", found[2])
        elif found := re.search(r"unrecognized arguments: (\S+)", message):
            word, known = found[1].split("=")[0], self._flags()
        else:
            return ""
        close = difflib.get_close_matches(word, known, n=1)
        return f"; did you mean {close[0]}?" if close else ""

    def parse_args(self, args=None, namespace=None):
        self._given = list(sys.argv[1:] if args is None else args)
        return super().parse_args(args, namespace)

    def _flags(self) -> list[str]:
        """This parser's flags and, as an unknown flag is refused by the top parser, the given verb's."""
        flags = list(self._option_string_actions)
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                verb = next((action.choices[a] for a in getattr(self, "_given", ()) if a in action.choices), None)
                flags += verb._flags() if verb is not None else []
        return flags


def _checked(text: str, parse: Callable[[str], float], ok: Callable[[float], bool], what: str):
    """A flag's number, or argparse's one-line refusal naming what it must be."""
    try:
        value = parse(text)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return _checked(text, int, lambda v: v >= 1, "a positive integer")


def positive_float(text: str) -> float:
    return _checked(text, float, lambda v: 0 < v < float("inf"), "a positive number")


def refresh_interval(text: str) -> float:
    """--interval: a refresh loop that neither spins nor looks stuck."""
    return _checked(text, float, lambda v: 0.1 <= v <= 3600, "within 0.1 and 3600 seconds")


def _coordinator_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--coordinator", help=f"HOST:PORT[,HOST:PORT...] of any replicas (default $MUSTER_COORDINATOR, "
                                         f"else {DEFAULT_ADDRESS})")


def _job_flag(p: argparse.ArgumentParser, required: bool, help: str, positional: bool = True) -> None:
    """The job: JOB, positional, with --job kept as an alias (every client verb names it the same way),
    else $MUSTER_JOB (checked after parsing: a job the environment supplies is not missing)."""
    if positional:
        p.add_argument("job", nargs="?", metavar="JOB", help=help)
        p.add_argument("--job", dest="job_option", metavar="JOB", help="the same as JOB")
    else:
        p.add_argument("--job", help=help)
    p.set_defaults(job_required=required)


def _from_environment(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if "coordinator" in args:
        # where the address came from, for the hint when nothing answers there
        args.coordinator_from = ("--coordinator" if args.coordinator else "$MUSTER_COORDINATOR"
                                 if os.environ.get("MUSTER_COORDINATOR") else "the default")
        args.coordinator = args.coordinator or os.environ.get("MUSTER_COORDINATOR") or DEFAULT_ADDRESS
    if getattr(args, "job_option", None):
        if args.job and args.job != args.job_option:
            p.exit(2, f"muster {args.verb}: the job is named twice, {args.job!r} and --job {args.job_option!r}\n")
        args.job = args.job_option
    if "job" in args and args.job is None:
        args.job = os.environ.get("MUSTER_JOB") or None
        if args.job is None and getattr(args, "job_required", False):
            named = "--job JOB" if "job_option" not in args else "JOB"
            p.exit(2, f"muster {args.verb}: the job is required: muster {args.verb} {named} (or set MUSTER_JOB)\n")


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="muster", description="Elastic rendezvous and heartbeat coordinator for PyTorch.")
    p.add_argument("-V", "--version", action="version", version=f"muster {version()}")
    _log_flags(p, default=True)
    sub = p.add_subparsers(dest="command", required=True)

    _serve_parser(sub)
    _run_parser(sub)
    _demo_parser(sub)
    _client_parsers(sub)
    c = sub.add_parser("completion", help="print a shell completion script: eval \"$(muster completion bash)\"")
    c.add_argument("shell", choices=("bash", "zsh"))
    c.set_defaults(func=lambda args: _completion(p, args.shell), verb="completion")
    for verb in sub.choices.values():  # `muster status --log-level debug` as well as before the verb
        _log_flags(verb, default=False)
    return p


def _log_flags(p: argparse.ArgumentParser, default: bool) -> None:
    """The logging flags; after the verb they override only when given (SUPPRESS: no default)."""
    p.add_argument("--log-level", default="info" if default else argparse.SUPPRESS,
                   choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-json", action="store_true", default=None if default else argparse.SUPPRESS,
                   help="JSON logs even on a terminal")


def _completion(p: argparse.ArgumentParser, shell: str) -> int:
    import shtab  # generated from the parser itself, so it names every verb and flag there is

    print(shtab.complete(p, shell=shell))
    return 0


def _serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="run a coordinator replica")
    g = s.add_argument_group("etcd: where the jobs' state and elections live")
    g.add_argument("--etcd", help="etcd endpoints HOST:PORT[,HOST:PORT...]; default: start a private etcd")
    g.add_argument("--data-dir", default=".muster", help="data directory of the private etcd (default %(default)s)")
    g.add_argument("--session-ttl", type=positive_int, default=3, help="etcd lease TTL of the election, seconds")
    g.add_argument("--etcd-cacert", help="trust this CA for etcd's TLS (PEM)")
    g.add_argument("--etcd-cert", help="client certificate for etcd (PEM)")
    g.add_argument("--etcd-key", help="its private key (PEM)")
    g.add_argument("--etcd-user", help="etcd user (auth enabled); password from --etcd-password-file or "
                   "$MUSTER_ETCD_PASSWORD")
    g.add_argument("--etcd-password-file", help="a file holding the etcd user's password")
    g = s.add_argument_group("serving and security")
    g.add_argument("--listen", default=DEFAULT_ADDRESS, help="gRPC listen address (default %(default)s)")
    g.add_argument("--advertise", help="address workers use to reach this replica (default: the listen address)")
    g.add_argument("--tokens", metavar="FILE", help="require per-job tokens: lines of 'JOB TOKEN' ('*': every job; "
                   "'@relay': the replicas' own, to relay; '#' starts a comment line); mode 600, read again on "
                   "SIGHUP or when it changes")
    g.add_argument("--tls-cert", help="serve TLS with this certificate (PEM)")
    g.add_argument("--tls-key", help="the certificate's private key (PEM)")
    g.add_argument("--tls-client-ca", help="mTLS: require client certificates signed by this CA (PEM)")
    g.add_argument("--insecure", action="store_true",
                   help="serve on an address beyond loopback with neither TLS nor tokens (refused without it: "
                        "anyone reaching the port could stop or delete any job)")
    g.add_argument("--metrics-listen", default="", metavar="HOST:PORT",
                   help="serve /metrics (Prometheus), /healthz and /readyz here (default: off); HTTPS with --tls-cert; "
                        "with --tokens, /metrics asks for the '*' or '@metrics' entry's token")
    g.add_argument("--http", action="store_true",
                   help="also serve the live page there: / lists the jobs, /jobs/NAME shows one (its ranks, health "
                        "and events), refreshed every second; with --tokens it asks for the same token as the API; "
                        "beyond loopback it needs --tokens and --tls-cert")
    g.add_argument("--http-host", action="append", default=[], metavar="NAME",
                   help="a Host name the metrics port answers to besides IP addresses, localhost, the --metrics-listen "
                        "and --advertise hosts (an ingress's, a Service's); others get 421 (DNS rebinding); repeatable")
    g.add_argument("--metrics-open", action="store_true",
                   help="/metrics without a token though --tokens is on (it names every job)")
    g = s.add_argument_group("defaults of new jobs (a job's spec overrides them)")
    g.add_argument("--min-nodes", type=positive_int, default=1, help="default min_nodes of new jobs")
    g.add_argument("--max-nodes", type=positive_int, default=MAX_NODES, help="default max_nodes of new jobs")
    g.add_argument("--world-size-multiple", type=positive_int, default=1, help="default world_size_multiple of new jobs")
    g = s.add_argument_group("timing: heartbeats, failure detection, forming")
    g.add_argument("--heartbeat-interval", type=positive_float, default=0.1, help="seconds between node frames")
    g.add_argument("--heartbeat-timeout", type=positive_float, default=2.0, help="silence before a node is lost")
    g.add_argument("--progress-timeout", type=positive_float, default=None, help="fixed stall timeout (default: calibrated)")
    g.add_argument("--progress-floor", type=positive_float, default=10.0, help="lowest calibrated stall timeout")
    g.add_argument("--progress-factor", type=positive_float, default=10.0, help="stall timeout = factor x p99 step time")
    g.add_argument("--grace", type=positive_float, default=5.0, help="after a leader change, the most seconds before "
                   "evicting for silence (less once every node reconnected, or a heartbeat timeout after the first)")
    g.add_argument("--last-call", type=positive_float, default=0.5, help="wait for more nodes once min_nodes joined")
    g.add_argument("--form-timeout", type=positive_float, default=60.0,
                   help="a generation not formed by then is decided again, naming the ranks that are missing")
    g.add_argument("--switch-lead", type=positive_float, default=0.2, help="a planned change (a node joins, a replacement "
                   "rank returns, a drain) switches this many seconds of steps ahead of where the fastest rank is "
                   "by now (its last report projected), so every rank hears of it first; a replacement waits as "
                   "long (default %(default)s s; relayed jobs add --relay-progress)")
    g.add_argument("--tick", type=positive_float, default=0.05, help="seconds between tallies")
    g = s.add_argument_group("a job's end: waiting, stopping, retention")
    g.add_argument("--waiting-timeout", type=positive_float, default=600.0, help="a job below min_nodes after it ran this "
                   "long ends failed (default %(default)s s)")
    g.add_argument("--stop-grace", type=positive_float, default=30.0, help="a stopped job's nodes drain within this; its "
                   "run then ends whoever is left (default %(default)s s)")
    g.add_argument("--retain-finished", default="7d", help="keep a finished run's record (outcome, history) this "
                   "long, then etcd deletes it: seconds or 90s/15m/12h/7d (default %(default)s; 0: keep none)")
    _straggler_flags(s)
    _limit_and_relay_flags(s)
    s.set_defaults(func=_serve, verb="serve")


def _limit_and_relay_flags(s: argparse.ArgumentParser) -> None:
    """serve's limits (what one caller or job may cost) and relaying."""
    g = s.add_argument_group("limits: what one caller or job may cost")
    g.add_argument("--max-message-bytes", type=positive_int, default=1 << 20, help="largest gRPC message accepted")
    g.add_argument("--max-jobs", type=positive_int, default=1_000, help="running jobs this deployment accepts (finished "
                   "ones do not count)")
    g.add_argument("--max-nodes-per-job", type=positive_int, default=DEFAULT_MAX_MEMBERS, help="nodes per job, "
                   "spares included: the most a job's members quota may be, whatever its spec asks (default "
                   "%(default)s; --job-quota raises it for a job)")
    g.add_argument("--max-spares-per-job", type=int, default=16, help="a job's members quota is its max_nodes and "
                   "this many spares (default %(default)s)")
    g.add_argument("--max-joins-per-second", type=positive_float, default=20.0, help="Joins per job, sustained, "
                   "past bursts of 2 s worth or of its members quota, whichever is more (default %(default)s)")
    g.add_argument("--max-generations-per-minute", type=positive_float, default=60.0, help="new generations per "
                   "job, sustained, past bursts of a minute's worth; past them its Joins are refused (failures "
                   "still re-form it; default %(default)s)")
    g.add_argument("--max-runs-per-hour", type=positive_float, default=60.0, help="new runs per job name, "
                   "sustained, past bursts of 10 minutes' worth (default %(default)s)")
    g.add_argument("--max-runs-kept", type=positive_int, default=32, help="finished runs retained per job name "
                   "(--retain-finished), the oldest deleted first (default %(default)s)")
    g.add_argument("--max-etcd-mib-per-minute", type=positive_float, default=8.0, help="MiB of state a job's "
                   "leader writes to etcd, sustained, past bursts of a minute's worth; past them its writes wait "
                   "and its Joins are refused (default %(default)s)")
    g.add_argument("--job-quota", action="append", default=[], metavar="JOB:KEY=N,...",
                   help="one job's own quotas, over the --max-* ones (repeatable): nodes, joins (per second), "
                        "generations (per minute), runs (per hour), kept, etcd_mib (per minute); e.g. "
                        "big-run:nodes=16384,etcd_mib=256")
    g.add_argument("--max-frames-per-second", type=positive_float, default=50.0,
                   help="frames per Session stream, sustained (bursts of 2 s worth); a flooding node is cut off")
    g.add_argument("--max-idle-streams", type=positive_int, default=256, help="Session and Relay calls yet to send "
                   "their first message, per job token (without tokens, per host; default %(default)s)")
    g.add_argument("--max-relay-calls", type=positive_int, default=4, help="Relay calls one peer holds open per job "
                   "(default %(default)s)")
    g = s.add_argument_group("relays: large jobs' node streams spread over the replicas")
    g.add_argument("--no-relay", action="store_true",
                   help="relay no node streams of jobs this replica does not lead (answer with the leader instead)")
    g.add_argument("--relay-min-nodes", type=positive_int, default=64,
                   help="jobs of this many nodes (members or min_nodes) on spread their node streams over the "
                        "replicas, which relay them to the leader (default %(default)s)")
    g.add_argument("--relay-batch", type=positive_float, default=0.02,
                   help="seconds a relay gathers node frames into one batch (exits go at once; default %(default)s)")
    g.add_argument("--relay-progress", type=positive_float, default=1.0,
                   help="seconds between a relay's summaries of its nodes' progress, which stand for their frames "
                        "that only advance steps (changes go at once; the relay judges silence itself; a leader "
                        "before summaries gets each node's latest progress this often; default %(default)s)")
    g.add_argument("--peer-tls-ca", help="relaying: trust this CA for the other replicas' TLS (PEM)")
    g.add_argument("--peer-tls-cert", help="relaying, mTLS: this replica's client certificate (PEM)")
    g.add_argument("--peer-tls-key", help="its private key (PEM)")


def _straggler_flags(s: argparse.ArgumentParser) -> None:
    g = s.add_argument_group("stragglers: ranks persistently slower than the job's median")
    g.add_argument("--straggler-action", default="report", metavar="off|report|replace",
                   help="report: name them (an event, the muster_stragglers metric, a column of muster status); "
                        "replace: also take the straggling node out at a planned step, a hot spare taking its "
                        "place, never below min_nodes; off: neither (default %(default)s)")
    g.add_argument("--straggler-factor", type=float, default=1.5,
                   help="a rank straggles while its compute (forward and backward, before the gradients' "
                        "all-reduce) is this many times the job's median (default %(default)s)")
    g.add_argument("--straggler-min-steps", type=int, default=20,
                   help="steps a rank must straggle for before it is named (default %(default)s)")
    g.add_argument("--straggler-window", default="10m",
                   help="replace: at most --straggler-replace-max nodes of a job per this window (default "
                        "%(default)s): a host-wide slowdown must not take out everyone")
    g.add_argument("--straggler-replace-max", type=int, default=1,
                   help="nodes replace takes out per window (default %(default)s)")


def _run_parser(sub) -> None:
    r = sub.add_parser("run", help="node agent: run a command (or a torchrun command line) on this node's slots",
                       description="muster run --coordinator HOST:PORT --job NAME [--nodes MIN:MAX] [--slots N] "
                                   "-- torchrun [torchrun args] script.py [args]   (or -- python script.py [args])",
                       epilog=EXIT_STATUS_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    _coordinator_flag(r)
    _job_flag(r, False, positional=False, help="the job's id, as torchrun's --rdzv-id takes it (an id that is no "
              "coordinator job name, e.g. MyRun, becomes myrun-HASH; default $MUSTER_JOB, else torchrun's --rdzv-id "
              "after --)")
    r.add_argument("--nodes", help="MIN:MAX nodes of the job (torchrun's --nnodes)")
    r.add_argument("--slots", type=positive_int, help="ranks on this node (torchrun's --nproc-per-node; default 1)")
    r.add_argument("--node-id", help="unique within the job (default HOSTNAME-PID)")
    r.add_argument("--host", help="address other nodes reach this node at (default: this host's address on the route "
                                  "to the coordinator; 127.0.0.1 for a coordinator on loopback)")
    r.add_argument("--world-size-multiple", type=int, default=0)
    g = r.add_argument_group("the job's straggler policy, if this node creates the job (default: the deployment's, "
                             "muster serve --straggler-*)")
    g.add_argument("--straggler-action", choices=STRAGGLER_ACTIONS, default="")
    g.add_argument("--straggler-factor", type=float, default=0.0, help="compute over the job's median (above 1)")
    g.add_argument("--straggler-min-steps", type=int, default=0, help="steps a rank must straggle for")
    r.add_argument("--max-restarts", type=int, help="restarts of a slot for its own crashes (a restart for a new "
                   "map is not counted) before it is given up and reported (default: torchrun's --max-restarts, "
                   "else 3)")
    d = r.add_argument_group("the durable tier, for ranks using the worker library that register no checkpoint= "
                             "themselves (MUSTER_CHECKPOINT_DIR/EVERY; see docs/guide/sharded.md)")
    d.add_argument("--checkpoint-dir", metavar="DIR", help="the library checkpoints the registered state to DIR (local, "
                   "a shared filesystem, or an fsspec URL) and resumes from it where no rank holds a step")
    d.add_argument("--checkpoint-every", default="auto", metavar="N|auto",
                   help="steps between checkpoints, or auto: from the copy's cost and the failures seen "
                        "(default %(default)s)")
    d.add_argument("--on-state-lost", choices=("fail", "restart"), default="",
                   help="the job's answer, if this node creates it, where the training state is lost beyond every "
                        "tier: fail (default) ends the run failed with the reason; restart begins again at step 0, "
                        "and the run's events and outcome say so")
    r.add_argument("--restart-backoff", type=positive_float, default=1.0,
                   help="a rank crashing again soon after its restart waits this long before the next one (doubled "
                        "with each crash in a row; the first restart, and one after a SIGKILL, is immediate)")
    r.add_argument("--warm-start", action=argparse.BooleanOptionalAction, default=True,
                   help="fork Python ranks from a per-node zygote that imported torch once, so a restart reaches "
                        "the script's first line in milliseconds (default: on; --no-warm-start makes every rank a "
                        "new interpreter; other commands always start cold)")
    r.add_argument("--step-probe", action=argparse.BooleanOptionalAction, default=True,
                   help="measure each step of a Python rank that does not use the worker library (hooks on its "
                        "first optimizer's step and on the gradient computed last, installed at its start), for "
                        "the straggler watch and `muster status`; never judged for stalls (default: on)")
    r.add_argument("--preload", default=",".join(PRELOAD), metavar="MODULES",
                   help="modules the zygote imports once for every rank, comma-separated (default %(default)s; "
                        "add the script's heavy imports, e.g. transformers; never one that initialises CUDA)")
    r.add_argument("--log-dir", help="write each rank's output to a file under DIR/JOB/RUN/, and a copy of the agent's "
                   "log as JSON lines (NODE-agent.log), made 0600 in 0700 directories; `muster logs` reads both; "
                   "default: the agent's stdout/stderr only")
    r.add_argument("--hold-timeout", type=positive_float, default=300.0,
                   help="keep the ranks this long while no coordinator answers, then exit (default %(default)s s)")
    r.add_argument("--join-timeout", type=positive_float, default=300.0,
                   help="exit 1 when no coordinator accepts the join within this long (default %(default)s s)")
    r.add_argument("--form-timeout", type=positive_float, default=600.0,
                   help="exit 1 when this node has no place in a generation within this long, e.g. too few nodes "
                        "(default %(default)s s; a hot spare waits on)")
    r.add_argument("--wait-report", type=positive_float, default=10.0,
                   help="while this node has no place, say what it waits for this often (default %(default)s s)")
    r.add_argument("--exit-timeout", type=positive_float, default=30.0,
                   help="a rank whose script completed (its __main__ returned, or sys.exit(0)) but whose process "
                        "is still there this long after (hung in interpreter teardown) is sent SIGTERM, and SIGKILL "
                        "5 s later; so is one whose script called destroy_process_group() and whose process then "
                        "ran no Python this long (frozen); it counts as finished either way, and is never restarted "
                        "(default %(default)s s)")
    r.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    _client_security_flags(r)
    r.set_defaults(func=_run, verb="run")


def _demo_parser(sub) -> None:
    d = sub.add_parser("demo", help="etcd, two coordinators and agents training on CPU; faults on a schedule")
    d.add_argument("--duration", type=positive_float, default=60.0, help="seconds of training after start-up")
    d.add_argument("--nodes", type=positive_int, default=3)
    d.add_argument("--slots", type=positive_int, default=2)
    d.add_argument("--timeline", default="muster-demo.png", help="where to write the PNG timeline")
    d.set_defaults(func=_demo, verb="demo")


def _client_parsers(sub) -> None:
    """The client verbs: status and events for anyone with the job's token, the rest for operators."""
    for name, func, helptext in (
            ("status", _status, "jobs, leaders, rank maps"), ("events", _events, "membership history"),
            ("jobs", _jobs, "every job: running ones and retained finished runs, with their outcome (operator)"),
            ("stop", _stop, "stop a running job: every node drains at one step, agents exit 3 (operator)"),
            ("drain", _drain, "one node of a job leaves at a step boundary, as on SIGTERM to its agent (operator)"),
            ("delete", _delete, "delete a finished job's record(s) now rather than at their retention's end "
                                "(operator)"),
            ("logs", _logs, "the agents' logs and their ranks' output, from the directory the agents write them to "
                            "(muster run --log-dir)")):
        q = sub.add_parser(name, help=helptext)
        _coordinator_flag(q)
        _job_flag(q, name not in ("status", "jobs"), help="the job's name (default $MUSTER_JOB)" + (
            "; without it every job" if name in ("status", "jobs") else ""))
        if name in ("status", "events", "delete", "logs"):
            q.add_argument("--run", type=int, default=0, help="a finished run of the job (default: the running one, "
                           "else the latest)" if name != "delete" else "only this run (default: every retained run)")
        if name in ("stop", "drain"):
            q.add_argument("--reason", help="recorded in the job's history")
        if name == "drain":
            q.add_argument("--node", required=True, help="the node's id")
        if name != "logs":
            follows = "; with --watch or --follow one per line" if name in ("status", "events") else ""
            q.add_argument("--json", action="store_true",
                           help=f"one JSON document (its schema: the reference's JSON output page){follows}")
        q.add_argument("--timeout", type=positive_float, default=5.0, help="seconds for each call (default %(default)s)")
        if name in ("status", "events", "logs"):
            q.add_argument("--watch" if name == "status" else "--follow", action="store_true", help={
                "status": "refresh every --interval, in place on a terminal, until Ctrl-C",
                "events": "print the run's events as they come, until its record is final (its outcome, its nodes "
                          "gone) or Ctrl-C",
                "logs": "print what the agents and ranks write next, until the run ends or Ctrl-C"}[name])
            q.add_argument("--interval", type=refresh_interval, default=2.0 if name == "status" else 1.0,
                           help="seconds between refreshes (default %(default)s; 0.1 to 3600)")
        if name == "logs":
            q.add_argument("--log-dir", help="the agents' --log-dir: shared by the nodes, or this node's; the "
                           "job's run's files are read, DIR/JOB/RUN/ (default $MUSTER_LOG_DIR)")
            q.add_argument("--node", help="only this node's agent and ranks (a node that left the run too)")
            q.add_argument("--rank", type=int, help="only the slot that runs this global rank now (its node's "
                           "files: a rank that moves after a re-form is not followed)")
            q.add_argument("--tail", type=int, default=100, help="the last lines of each slot's latest start "
                           "(default %(default)s)")
            q.set_defaults(all=False)
        if name == "status":
            q.add_argument("--page-size", type=int, default=0, help="ranks per page (default 1000, at most 5000)")
            q.add_argument("--page-token", help="the page after the one that printed it")
            q.add_argument("--all", action="store_true", help="every page: all ranks of the job")
            q.add_argument("--node", help="only this node's ranks (with JOB)")
            q.add_argument("--states", help="only ranks in these states, comma-separated (e.g. exited,unknown)")
        _client_security_flags(q)
        q.set_defaults(func=func, verb=name)


def _client_security_flags(p: argparse.ArgumentParser) -> None:
    env = os.environ.get
    token = p.add_mutually_exclusive_group()
    token.add_argument("--token", default=env("MUSTER_TOKEN", ""), help="the job's token (default $MUSTER_TOKEN); "
                       "on the command line every local user sees it in `ps`: prefer --token-file or $MUSTER_TOKEN")
    token.add_argument("--token-file", metavar="FILE",
                       help="a file holding the job's token (kept off the command line)")
    p.add_argument("--tls-ca", default=env("MUSTER_TLS_CA", ""), help="trust this CA for the coordinators' TLS "
                   "(default $MUSTER_TLS_CA)")
    p.add_argument("--tls-cert", default=env("MUSTER_TLS_CERT", ""), help="mTLS client certificate ($MUSTER_TLS_CERT)")
    p.add_argument("--tls-key", default=env("MUSTER_TLS_KEY", ""), help="its private key ($MUSTER_TLS_KEY)")


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    _from_environment(p, args)
    logs.configure(args.log_level, json=args.log_json)
    try:
        return args.func(args)
    except grpc.RpcError as exc:
        hint = ""
        if exc.code() == grpc.StatusCode.UNAVAILABLE and "coordinator_from" in args:
            hint = (f" (no coordinator answered at {args.coordinator}, from {args.coordinator_from}: is `muster serve` "
                    "running there? --coordinator or $MUSTER_COORDINATOR names another)")
        print(f"muster {args.verb}: {exc.code().name}: {exc.details()}{hint}", file=sys.stderr)
        return 1
    except ValueError as exc:  # a bad address, job name, ...
        print(f"muster {args.verb}: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `muster logs … --follow | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (else the exit's flush fails again)
        return 0


if __name__ == "__main__":
    sys.exit(main())
