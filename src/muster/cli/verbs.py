"""The operator verbs that change a job: `muster stop`, `drain` and `delete`."""

from __future__ import annotations

import argparse
import json


from muster.json_output import as_json
from muster.cli.calls import ask, job_of


def stop(args: argparse.Namespace) -> int:
    from muster.v1 import muster_pb2 as pb

    response = ask(args, "Stop", pb.StopRequest(job=job_of(args), reason=args.reason or ""))
    at = f"after step {response.after_step}" if response.after_step else "now"
    said = f"job {job_of(args)} run {response.run} " + ("was stopped already: nothing changed" if response.already
                                                         else f"stopped: every node drains {at}, its agents exit 3")
    answer(args, response, said)
    return 0


def drain(args: argparse.Namespace) -> int:
    from muster.v1 import muster_pb2 as pb

    response = ask(args, "Drain", pb.DrainRequest(job=job_of(args), node=args.node, reason=args.reason or ""))
    at = f"after step {response.after_step}" if response.after_step else "now"
    said = f"node {args.node} of job {job_of(args)} " + ("had left already: nothing changed" if response.already else
                                                           f"leaves {at} (generation {response.generation} runs "
                                                           "without it)")
    answer(args, response, said, node=args.node)
    return 0


def delete(args: argparse.Namespace) -> int:
    from muster.v1 import muster_pb2 as pb

    response = ask(args, "Delete", pb.DeleteRequest(job=job_of(args), run=args.run))
    answer(args, response, f"deleted {response.deleted} finished run(s) of job {job_of(args)}")
    return 0


def answer(args: argparse.Namespace, response, text: str, **named) -> None:
    """An operator verb's answer: the sentence, or with --json the job, what was named and the response."""
    print(json.dumps({"job": job_of(args), **named, **as_json(response)}, indent=2) if args.json else text)
