"""Name rules shared by the coordinator (which enforces them) and the launcher (which maps a user's
job id onto them). Names become etcd keys and log fields: match them with `fullmatch` (a `$` would
let a trailing newline through)."""

from __future__ import annotations

import hashlib
import re

JOB_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")
NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}")


def check_job_name(job: str) -> str:
    """The rule every store key built from a job name relies on: a '/' would let one job's prefix
    match another's keys ("a" vs "a/b")."""
    if not job or "/" in job:
        raise ValueError(f"job name must be non-empty and contain no '/', got {job!r}")
    return job


_HASH_CHARS = 10


def job_name(job_id: str) -> str:
    """The coordinator's name for a job id as torchrun's --rdzv-id accepts it (any string, e.g.
    `MyRun` or a scheduler's id). A valid name is itself; any other id becomes its lowercase form,
    with other characters as '-', plus a hash of the id as given: deterministic (every node of the
    job maps it alike) and distinct (`Run` and `RUN` are two jobs, as for torchrun)."""
    if JOB_NAME.fullmatch(job_id):  # the coordinator's rule (its names are etcd keys)
        return job_id
    if not job_id:
        raise ValueError("the job id is empty")
    digest = hashlib.sha256(job_id.encode("utf-8", "surrogatepass")).hexdigest()[:_HASH_CHARS]
    base = re.sub(r"[^a-z0-9._-]+", "-", job_id.lower()).strip("-._")
    base = base[:62 - _HASH_CHARS]  # 63 in all
    return f"{base}-{digest}" if base else digest
