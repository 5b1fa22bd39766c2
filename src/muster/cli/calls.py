"""A client verb's calls to the coordinators: the job as the coordinator names it, one call to any
replica (a job's live pages asked of its leader), and what a refresh loop retries."""

from __future__ import annotations

import argparse
import time

import grpc
import structlog

from muster.cli.flags import security

log = structlog.get_logger(__name__)


def job_of(args: argparse.Namespace) -> str:
    """The job as given, or as the coordinator names it (`muster run` maps ids such as `MyRun`)."""
    from muster.names import job_name

    return job_name(args.job) if args.job else ""


def coordinators_of(args):
    from muster.client import Coordinators

    return Coordinators(args.coordinator, timeout_s=args.timeout, election_wait_s=args.election_wait,
                        security=security(args))


def ask(args, rpc: str, request, coordinators=None):
    """One call to any replica; `coordinators`: connections kept open across calls (--watch, --follow)."""
    if coordinators is None:
        with coordinators_of(args) as coordinators:
            return ask(args, rpc, request, coordinators)
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


def retry_later(exc: grpc.RpcError) -> bool:
    """A replica restarting or a leader changing: said on stderr, asked again at the next refresh.
    Any other refusal (a bad job name, a token) ends the command as it would without --watch."""
    from muster.client import TRANSIENT

    if exc.code() not in TRANSIENT:
        return False
    log.warning("no_answer_retrying", code=exc.code().name, details=exc.details())
    return True


def run_over(args, job: str, run: int, coordinators) -> bool:
    """The run has its outcome and no leader any more: its record, history included, is final (a
    replica that cannot tell now is asked again next time)."""
    from muster.v1 import muster_pb2 as pb

    try:
        js = coordinators.call("Status", pb.StatusRequest(job=job, run=run, brief=True)).jobs[0]
    except grpc.RpcError as exc:
        if not retry_later(exc):
            raise
        return False
    return js.outcome != "running" and not js.leader


def when(unix_ms: int | None) -> str:
    """A moment in the local time, with its offset (hosts and readers may be in other zones)."""
    return time.strftime("%Y-%m-%d %H:%M:%S %z", time.localtime(unix_ms / 1000)) if unix_ms else "-"
