"""`muster serve`: a coordinator replica, its flags checked before etcd starts."""

from __future__ import annotations

import argparse
import os
import re
import socket
import sys
from pathlib import Path


from muster.net import is_loopback, split_host_port
from muster.coordinator.core.policy import DEFAULT_MAX_MEMBERS, MAX_NODES, JobSpec
from muster.cli.flags import DEFAULT_ADDRESS, duration, positive_float, positive_int, secret_file, tls_files


def command(args: argparse.Namespace) -> int:
    import uvloop

    from muster.coordinator.auth import Tokens
    from muster.coordinator.core.policy import InvalidPolicy, Timing
    from muster.coordinator.core.stragglers import StragglerPolicy
    from muster.coordinator.replica.replica import ReplicaConfig
    from muster.coordinator.edges.service import ServeConfig, serve

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
        tls = tls_files(args, "tls_client_ca", "tls_cert", "tls_key")
        if tls.ca and not tls.cert:  # mTLS without TLS would serve plaintext, checking nobody
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key: client certificates are checked "
                             "only over TLS")
        peer_tls = tls_files(args, "peer_tls_ca", "peer_tls_cert", "peer_tls_key")
        check_listen(args, bool(tls.cert))
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


def check_listen(args: argparse.Namespace, tls: bool) -> None:
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


def _etcd_access(args: argparse.Namespace):
    """etcd TLS and auth from the flags; the password from a file or $MUSTER_ETCD_PASSWORD, never argv."""
    from muster.coordinator.etcd.client import EtcdAccess

    password = ""
    if args.etcd_user:
        if args.etcd_password_file:
            password = secret_file(args.etcd_password_file, "--etcd-password-file")
        else:
            password = os.environ.get("MUSTER_ETCD_PASSWORD", "")
        if not password:
            raise ValueError("--etcd-user needs a password: --etcd-password-file FILE or $MUSTER_ETCD_PASSWORD")
    return EtcdAccess(tls_files(args, "etcd_cacert", "etcd_cert", "etcd_key"), args.etcd_user or "", password)


def add_parser(sub) -> None:
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
                   help="a generation not formed by then is decided again, naming the ranks that are missing; a "
                   "job no node joined by then (the Join that made it gave up first) ends failed")
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
    s.set_defaults(func=command, verb="serve")


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
