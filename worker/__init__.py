"""The worker side of Muster: the in-process library (Worker) a training script uses to keep
training through membership changes, and the client side of the protocol (NodeSession)."""

from muster.worker.api import Worker, WorkerConfig
from muster.worker.errors import CoordinatorLost, Drained, FencedOut, HoldExpired, WorkerError

__all__ = ["Worker", "WorkerConfig", "WorkerError", "FencedOut", "CoordinatorLost", "HoldExpired", "Drained"]
