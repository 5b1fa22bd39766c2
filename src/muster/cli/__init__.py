"""The `muster` command: serve (coordinator), run (node agent), zygote (a host's warm starts), demo,
completion, and the client verbs: status, events, logs, jobs, stop, drain, delete. Each family has
its module here; this one assembles the parser and runs a verb."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import grpc

from muster import logs, version
from muster.cli import flags, run, serve, verbs, views, zygote


def _demo(args: argparse.Namespace) -> int:
    from muster import demo

    return demo.run(args.duration, args.nodes, args.slots, Path(args.timeline))


def parser() -> argparse.ArgumentParser:
    p = flags.OneLineParser(prog="muster", description="Elastic rendezvous and heartbeat coordinator for PyTorch.")
    p.add_argument("-V", "--version", action="version", version=f"muster {version()}")
    flags.log_flags(p, default=True)
    sub = p.add_subparsers(dest="command", required=True)

    serve.add_parser(sub)
    run.add_parser(sub)
    zygote.add_parser(sub)
    _demo_parser(sub)
    _client_parsers(sub)
    c = sub.add_parser("completion", help="print a shell completion script: eval \"$(muster completion bash)\"")
    c.add_argument("shell", choices=("bash", "zsh"))
    c.set_defaults(func=lambda args: _completion(p, args.shell), verb="completion")
    for verb in sub.choices.values():  # `muster status --log-level debug` as well as before the verb
        flags.log_flags(verb, default=False)
    return p


def _demo_parser(sub) -> None:
    d = sub.add_parser("demo", help="etcd, two coordinators and agents training on CPU; faults on a schedule")
    d.add_argument("--duration", type=flags.positive_float, default=60.0, help="seconds of training after start-up")
    d.add_argument("--nodes", type=flags.positive_int, default=3)
    d.add_argument("--slots", type=flags.positive_int, default=2)
    d.add_argument("--timeline", default="muster-demo.png", help="where to write the PNG timeline")
    d.set_defaults(func=_demo, verb="demo")


def _client_parsers(sub) -> None:
    """The client verbs: status and events for anyone with the job's token, the rest for operators."""
    for name, func, helptext in (
            ("status", views.status, "jobs, leaders, rank maps"), ("events", views.events, "membership history"),
            ("jobs", views.jobs, "every job: running ones and retained finished runs, with their outcome (operator)"),
            ("stop", verbs.stop, "stop a running job: every node drains at one step, agents exit 3 (operator)"),
            ("drain", verbs.drain,
             "one node of a job leaves at a step boundary, as on SIGTERM to its agent (operator)"),
            ("delete", verbs.delete, "delete a finished job's record(s) now rather than at their retention's end "
                                     "(operator)"),
            ("logs", views.logs, "the agents' logs and their ranks' output, from the directory the agents write them "
                                 "to (muster run --log-dir)")):
        q = sub.add_parser(name, help=helptext)
        flags.coordinator_flag(q)
        flags.job_flag(q, name not in ("status", "jobs"), help="the job's name (default $MUSTER_JOB)" + (
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
        q.add_argument("--timeout", type=flags.positive_float, default=5.0,
                       help="seconds for each call (default %(default)s)")
        q.add_argument("--election-wait", type=flags.wait_seconds, default=15.0,
                       help="seconds to keep asking while a replica answers that the job's leader is being elected "
                            "(a failover takes a few); 0 fails at once (default %(default)s)")
        if name in ("status", "events", "logs"):
            q.add_argument("--watch" if name == "status" else "--follow", action="store_true", help={
                "status": "refresh every --interval, in place on a terminal, until Ctrl-C",
                "events": "print the run's events as they come, until its record is final (its outcome, its nodes "
                          "gone) or Ctrl-C",
                "logs": "print what the agents and ranks write next, until the run ends or Ctrl-C"}[name])
            q.add_argument("--interval", type=flags.refresh_interval, default=2.0 if name == "status" else 1.0,
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
        flags.client_security_flags(q)
        q.set_defaults(func=func, verb=name)


def _completion(p: argparse.ArgumentParser, shell: str) -> int:
    import shtab  # generated from the parser itself, so it names every verb and flag there is

    print(shtab.complete(p, shell=shell))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    flags.from_environment(p, args)
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

