"""The coordinator's error tree. Raised by the core and the edges; mapped to gRPC status
codes in one table (`muster.coordinator.codes.STATUS_OF`). Below it, the job store's write
errors, which a leader acts on and never reports."""


class MusterError(Exception):
    """Base of every error the coordinator reports to a caller."""


class InvalidArgument(MusterError):
    pass


class NotFound(MusterError):
    pass


class AlreadyExists(MusterError):
    pass


class RunEnded(NotFound):
    """The job's run that the caller belongs to has ended: how, for the caller to end the same way
    (sent as trailing metadata `muster-run-ended: RUN OUTCOME`)."""

    def __init__(self, job: str, run: int, outcome: str, reason: str):
        self.job, self.run, self.outcome, self.reason = job, run, outcome, reason
        super().__init__(f"run {run} of job {job!r} has ended ({outcome}): {reason}")


class FailedPrecondition(MusterError):
    """Stale term, generation or member: the caller acts on an outdated view."""


class ResourceExhausted(MusterError):
    pass


class DeadlineExceeded(MusterError):
    """A stream that sent nothing within its deadline."""


class NotLeader(MusterError):
    """This replica does not lead the job; `leader` is where to go ("" while unknown)."""

    def __init__(self, job: str, leader: str):
        self.job = job
        self.leader = leader
        where = f"; the leader is at {leader}" if leader else "; no leader is elected yet, retry"
        super().__init__(f"this replica does not lead job {job!r}{where}")


class Unavailable(MusterError):
    pass


class Unauthenticated(MusterError):
    """No token, or one the deployment does not know."""


class PermissionDenied(MusterError):
    """A valid token, for another job."""


class Fenced(Exception):
    """A write was refused because the writer's leadership term is over."""


class PersistUnavailable(Exception):
    """Job state could not be written for now (etcd unreachable, or the write refused): the
    decision is not adopted, and is made again on the next tick."""


class StoreError(Exception):
    """The job store or the coordination (etcd) refused a request for a reason other than availability."""


class StoreUnavailable(StoreError):
    """No store endpoint answered in time (down, partitioned, or without a leader)."""
