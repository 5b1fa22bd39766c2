"""Name rules shared by the coordinator (which enforces them) and the launcher (which maps a user's
job id onto them). Names become etcd keys and log fields: match them with `fullmatch` (a `$` would
let a trailing newline through)."""

from __future__ import annotations

import re

JOB_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")
NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}")


def check_job_name(job: str) -> str:
    """The rule every store key built from a job name relies on: a '/' would let one job's prefix
    match another's keys ("a" vs "a/b")."""
    if not job or "/" in job:
        raise ValueError(f"job name must be non-empty and contain no '/', got {job!r}")
    return job
