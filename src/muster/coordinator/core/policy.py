"""Job policy: the knobs that decide sizes and timeouts, validated in one place.

Per-job sizes (min/max nodes, world size multiple) come from the first Join; the timing
knobs are the coordinator's (its `muster serve` flags).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from muster.names import JOB_NAME

MAX_SLOTS = 1024
# Nodes per job: a job of 1M GPUs (125k nodes x 8). What bounds it, measured (docs/limits.md): the
# job's state is ~68 bytes a node encoded (zlib; a member's secret hash does not compress), 8.5 MB
# at 125k nodes, so etcd's --max-request-bytes must be raised past its 1.5 MiB default (~22k nodes)
# to 10 MiB (etcd's own advice as the most); and the leader's memory, ~2 GiB at 125k nodes.
MAX_NODES = 125_000
# Steps and generations far beyond any real run (2**48 steps at 1 µs each are 9 years) but far
# below 2**64: arithmetic on them (a switch step ahead, a generation plus one) stays in uint64.
MAX_STEP = 2**48
MAX_GENERATION = 2**48
STRAGGLER_ACTIONS = ("off", "report", "replace")
MAX_STRAGGLER_FACTOR, MAX_STRAGGLER_MIN_STEPS = 100.0, 1_000_000


class InvalidPolicy(ValueError):
    """A policy value is out of range; the message names the field."""


def check_stragglers(action: str, factor: float, min_steps: int, *, unset_ok: bool) -> None:
    """A straggler policy's values, a deployment's (`muster serve`) or a job's (its spec, where ""
    and 0 are unset: the deployment's stands)."""
    if not (unset_ok and not action) and action not in STRAGGLER_ACTIONS:
        raise InvalidPolicy(f"straggler_action must be one of {', '.join(STRAGGLER_ACTIONS)}"
                            f"{' (or empty)' if unset_ok else ''}, got {action[:40]!r}")
    if not (unset_ok and not factor) and not 1.0 < factor <= MAX_STRAGGLER_FACTOR:
        raise InvalidPolicy(f"straggler_factor must be in (1, {MAX_STRAGGLER_FACTOR:g}], got {factor}")
    if not (0 if unset_ok else 1) <= min_steps <= MAX_STRAGGLER_MIN_STEPS:
        raise InvalidPolicy(f"straggler_min_steps must be in {0 if unset_ok else 1}..{MAX_STRAGGLER_MIN_STEPS}, "
                            f"got {min_steps}")


ON_STATE_LOST = ("", "fail", "restart")


@dataclass(frozen=True)
class JobSpec:
    """What a job asks for. Fixed when the job is created."""

    min_nodes: int = 1
    max_nodes: int = MAX_NODES
    world_size_multiple: int = 1
    # The job's straggler policy; "" and 0: the deployment's (`StragglerPolicy.for_job`).
    straggler_action: str = ""
    straggler_factor: float = 0.0
    straggler_min_steps: int = 0
    # Training state lost beyond every tier (a rank's StateLost): "" or "fail", the run ends failed with
    # the reason; "restart", the ranks begin again at step 0 and the run's events and outcome say so.
    on_state_lost: str = ""

    def validate(self) -> JobSpec:
        if not 1 <= self.min_nodes <= MAX_NODES:
            raise InvalidPolicy(f"min_nodes must be in 1..{MAX_NODES}, got {self.min_nodes}")
        if not self.min_nodes <= self.max_nodes <= MAX_NODES:
            raise InvalidPolicy(
                f"max_nodes must be in min_nodes..{MAX_NODES} ({self.min_nodes}..{MAX_NODES}), got {self.max_nodes}"
            )
        if not 1 <= self.world_size_multiple <= 65_536:
            raise InvalidPolicy(f"world_size_multiple must be in 1..65536, got {self.world_size_multiple}")
        check_stragglers(self.straggler_action, self.straggler_factor, self.straggler_min_steps, unset_ok=True)
        if self.on_state_lost not in ON_STATE_LOST:
            raise InvalidPolicy(f"on_state_lost must be one of {', '.join(filter(None, ON_STATE_LOST))} (or empty), "
                                f"got {self.on_state_lost[:40]!r}")
        return self

    def merged_over(self, default: JobSpec) -> JobSpec:
        """Fields left at zero (proto default) take the coordinator's default."""
        return JobSpec(
            min_nodes=self.min_nodes or default.min_nodes,
            max_nodes=self.max_nodes or max(default.max_nodes, self.min_nodes),
            world_size_multiple=self.world_size_multiple or default.world_size_multiple,
            straggler_action=self.straggler_action, straggler_factor=self.straggler_factor,
            straggler_min_steps=self.straggler_min_steps, on_state_lost=self.on_state_lost,
        )


@dataclass(frozen=True)
class Timing:
    """How fast failures are detected and changes are made. Seconds throughout."""

    heartbeat_interval_s: float = 0.1
    heartbeat_timeout_s: float = 2.0
    progress_timeout_s: float | None = None  # fixed stall timeout; None: calibrate
    progress_floor_s: float = 10.0  # calibrated timeout never goes below this
    progress_factor: float = 10.0  # calibrated timeout = factor x p99 step time
    startup_progress_timeout_s: float = 300.0  # before enough step times are known
    long_phase_timeout_s: float = 3600.0  # a declared long phase may last this long
    grace_s: float = 5.0  # after a leader change, at most this before silence/stall evict anyone (liveness.in_grace)
    last_call_s: float = 0.5  # once min_nodes joined, wait this long for more before forming
    form_timeout_s: float = 60.0  # a generation not formed by then is decided again, the missing named
    switch_lead_s: float = 0.2  # planned changes switch this far ahead of the ranks' projected step (as steps)
    # A relay forwards a node's frames that only advance steps at most this often: the leader's
    # view of steps may lag by as much, so a relayed job's planned switches go this much further ahead.
    relay_progress_s: float = 1.0
    history_limit: int = 200
    waiting_timeout_s: float = 600.0  # a job below min_nodes (after it ran) this long fails
    stop_grace_s: float = 30.0  # a stopped job's nodes drain within this; then its run ends regardless

    def validate(self) -> Timing:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None and value <= 0:
                raise InvalidPolicy(f"{field.name} must be positive, got {value}")
        if self.heartbeat_interval_s >= self.heartbeat_timeout_s:
            raise InvalidPolicy(
                f"heartbeat_interval_s ({self.heartbeat_interval_s}) must be below "
                f"heartbeat_timeout_s ({self.heartbeat_timeout_s})"
            )
        return self


# A job's members quota unless an operator raises it (--max-nodes-per-job, --job-quota): not the
# deployment's most, which a job's own spec (its first Join, so any token holder) would reach.
DEFAULT_MAX_MEMBERS = 1024
# `--job-quota JOB:KEY=VALUE,...`: the keys and the `Limits` fields they set for that job alone.
JOB_QUOTA_KEYS = {"nodes": "max_members", "joins": "joins_per_s", "generations": "generations_per_min",
                  "runs": "runs_per_hour", "kept": "runs_kept", "etcd_mib": "etcd_mib_per_min"}


@dataclass(frozen=True)
class Limits:
    """What one deployment accepts, so that no client can make it use unbounded memory, nor one job's
    token the etcd every job shares; past a limit a request gets RESOURCE_EXHAUSTED naming it
    (`muster serve` flags). The per-job ones an operator raises for a job by name (`per_job`)."""

    max_jobs: int = 1_000  # jobs known to the deployment
    max_members: int = DEFAULT_MAX_MEMBERS  # nodes per job, spares included
    max_frames_per_s: float = 50.0  # per Session stream, sustained (bursts up to 2 s worth)
    max_spares: int = 16  # a job's members: its max_nodes and this many spares (at most max_members)
    joins_per_s: float = 20.0  # per job, sustained; bursts of 2 s worth or its members quota (a job starts at once)
    idle_streams: int = 256  # per tenant (a token; without tokens, a host): calls yet to send a first message
    relay_calls: int = 4  # Relay calls per peer and job (a replica relays a job on one)
    generations_per_min: float = 60.0  # per job, bursts of a minute's worth; past them its Joins are refused
    runs_per_hour: float = 60.0  # new runs per job name, bursts of 10 minutes' worth
    runs_kept: int = 32  # finished runs retained per job name (the oldest go first)
    etcd_mib_per_min: float = 8.0  # state a job's leader writes to etcd, bursts of a minute's worth
    per_job: Mapping[str, Limits] = field(default_factory=dict, compare=False)  # `--job-quota`, by job name

    def for_job(self, job: str) -> Limits:
        """The limits of `job`: the deployment's, or those an operator set for it."""
        return self.per_job.get(job, self)

    def with_job_quota(self, text: str) -> Limits:
        """These limits and one job's own: `JOB:KEY=VALUE,...` (keys: JOB_QUOTA_KEYS)."""
        job, _, pairs = text.partition(":")
        if not JOB_NAME.fullmatch(job):
            raise InvalidPolicy(f"job quota {text!r}: {job!r} is no job name (JOB:KEY=VALUE,...)")
        fields = {}
        for pair in filter(None, pairs.split(",")):
            key, _, value = pair.partition("=")
            if key not in JOB_QUOTA_KEYS:
                raise InvalidPolicy(f"job quota {text!r}: {key!r} is no quota (one of {', '.join(JOB_QUOTA_KEYS)})")
            name = JOB_QUOTA_KEYS[key]
            try:
                fields[name] = type(getattr(self, name))(value)
            except ValueError:
                raise InvalidPolicy(f"job quota {text!r}: {key}={value!r} is no number") from None
        if not fields:
            raise InvalidPolicy(f"job quota {text!r}: name at least one quota, e.g. {job}:nodes=4096")
        base = self.for_job(job)
        own = dataclasses.replace(base, **fields, per_job={}).validate()
        return dataclasses.replace(self, per_job={**self.per_job, job: own})

    def members_of(self, spec: JobSpec) -> int:
        """A job's members quota: its spec's max_nodes and spares, within the deployment's limit."""
        return min(self.max_members, spec.max_nodes + self.max_spares)

    def validate(self) -> Limits:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name != "per_job" and (value < 0 or (value == 0 and f.name != "max_spares")):  # spares: may be 0
                raise InvalidPolicy(f"{f.name} must be positive, got {value}")
        return self
