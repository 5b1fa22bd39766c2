"""The worker's error tree: what a training script may see at a step boundary."""

from muster.v1 import muster_pb2 as pb
from muster.worker.node_session import Evicted


class WorkerError(Exception):
    """Base of the errors the worker library raises into the training thread."""


class FencedOut(WorkerError):
    """The coordinator evicted this rank (it hung, or was cut off): its state is stale. Exit."""


class CoordinatorLost(WorkerError):
    """The background link to the coordinator failed for good; the cause is chained."""


class HoldExpired(WorkerError):
    """A collective failed for a reason outside this rank and no new generation came within the
    hold timeout (no coordinator reachable, or the group never re-formed): the rank gives up."""


class Drained(WorkerError):
    """This rank's node leaves the job (graceful drain): training here ends after `after_step`."""


class StateMismatch(WorkerError):
    """This rank cannot hold the job's training state: its model has another layout (the first
    differing tensor is named), or what it received kept differing from the sources' fingerprint.
    It never trains on a state that is not the others'; the job goes on without it."""


class StateLost(StateMismatch):
    """No tier holds the job's training state at a step its ranks can agree on: no rank, no peer
    snapshot, no readable complete checkpoint (or none was configured). The run ends failed saying
    so (its leader ends it at the rank's exit) rather than train on from `build` or step 0."""


class ShardLost(StateLost):
    """A sharded job with peer snapshots lost a rank together with the buddy that held its snapshot
    (or before any snapshot was exchanged), and no checkpoint is configured: no rank holds that shard.
    The run ends rather than train on a partial state."""


class ShardedStateRefused(WorkerError):
    """`register` was given sharded state (FSDP/FSDP2, DTensor parameters, ZeroRedundancyOptimizer)
    without a layout that keeps a second copy of each shard (replica groups, or peer snapshots): a lost
    shard could not be recovered. Refused, never
    trained on as if it were replicated."""


class ReformFailed(WorkerError):
    """Forming the next group failed with the same error on consecutive tries (not a peer's or the
    network's failure: the same error from this rank's own state or code each time): holding for
    another try would loop until the hold timeout. The rank ends with the error named; its agent
    reports it, and the leader ends the run when it repeats."""


class LayoutMismatch(WorkerError):
    """The job's generation does not fit the layout declared at `register` (e.g. 3 ranks for
    Replicas(2, 2)): the mesh cannot be built, and no rank trains on a partial one."""


class RunEnded(WorkerError):
    """The job's run ended (succeeded, failed, or stopped by an operator): nothing more to train
    here. Leave the training loop; `outcome` says how the run ended (muster.worker.outcome has its
    exit status)."""

    def __init__(self, end: pb.JobEnd):
        super().__init__(f"run {end.run} of the job ended: {end.outcome}" + (f" ({end.reason})" if end.reason else ""))
        self.outcome = end.outcome
        self.reason = end.reason


__all__ = ["WorkerError", "FencedOut", "CoordinatorLost", "HoldExpired", "Drained", "RunEnded", "StateMismatch", "StateLost", "ShardLost", "ShardedStateRefused", "LayoutMismatch",
           "ReformFailed",
           "Evicted"]
