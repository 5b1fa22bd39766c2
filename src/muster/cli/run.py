"""`muster run`: the node agent, its flags and torchrun's command line checked and translated."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
from pathlib import Path


from muster import logs, rank_logs
from muster.net import address_towards, is_loopback, split_host_port
from muster.coordinator.core.policy import STRAGGLER_ACTIONS, JobSpec
from muster.worker.outcome import EXIT_STATUS_HELP
from muster.worker.rank.zygote import PRELOAD
from muster.cli.flags import client_security_flags, coordinator_flag, job_flag, positive_float, positive_int, security


def command(args: argparse.Namespace) -> int:
    from muster.client import parse_addresses
    from muster.worker.agent.agent import NodeAgent
    from muster.worker.agent.agent_config import AgentConfig
    from muster.names import job_name
    from muster.worker.agent.launch import LaunchError, network_env, parse_nodes, plan

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
        host_zygote=args.zygote_socket if args.warm_start else "",
        env={**network, **durable},
        security=security(args),
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


def add_parser(sub) -> None:
    r = sub.add_parser("run", help="node agent: run a command (or a torchrun command line) on this node's slots",
                       description="muster run --coordinator HOST:PORT --job NAME [--nodes MIN:MAX] [--slots N] "
                                   "-- torchrun [torchrun args] script.py [args]   (or -- python script.py [args])",
                       epilog=EXIT_STATUS_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    coordinator_flag(r)
    job_flag(r, False, positional=False, help="the job's id, as torchrun's --rdzv-id takes it (an id that is no "
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
    r.add_argument("--zygote-socket", default=os.environ.get("MUSTER_ZYGOTE_SOCKET", ""), metavar="PATH",
                   help="fork the node's zygote from the host's (`muster zygote --socket PATH`), which imported "
                        "torch already: ranks are warm in milliseconds rather than after the seconds of a new "
                        "interpreter's imports; where none listens there, or it runs another interpreter, module path, "
                        "namespace or cgroup, the node starts its own (default $MUSTER_ZYGOTE_SOCKET)")
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
    client_security_flags(r)
    r.set_defaults(func=command, verb="run")
