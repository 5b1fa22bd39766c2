"""The error tree on the wire: the one table from the coordinator's errors to gRPC status codes
(`STATUS_OF`), the bound on a refusal's message, and a relayed node stream's end as the leader
sends it down a Relay call (`stream_end`) and as the relay reads it back (`error_of`), so that a
relayed node is refused with the status a direct one would be.
"""

from __future__ import annotations

import grpc

from muster.coordinator import errors
from muster.v1 import muster_pb2 as pb

MAX_MESSAGE_CHARS = 512  # of a refusal, as sent and logged: it may quote what a caller sent

STATUS_OF: dict[type[errors.MusterError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.RunEnded: grpc.StatusCode.NOT_FOUND,
    errors.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.NotLeader: grpc.StatusCode.UNAVAILABLE,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    errors.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
}

ERROR_OF = {code.value[0]: kind for kind, code in STATUS_OF.items() if kind is not errors.NotLeader}
CLOSE_CODE = 0  # StreamEnd.code of a relayed stream that ends normally (the leader's CLOSE)


def stream_end(item) -> pb.StreamEnd:
    """How a relayed stream ends, as the leader sends it to the relay: an error of the tree with its
    status code, or CLOSE. `error_of` reads it back at the relay."""
    if not isinstance(item, errors.MusterError):
        return pb.StreamEnd(code=CLOSE_CODE)
    return pb.StreamEnd(code=STATUS_OF[type(item)].value[0], message=str(item)[:MAX_MESSAGE_CHARS],
                        leader=getattr(item, "leader", ""))


def error_of(end: pb.StreamEnd, job: str) -> errors.MusterError:
    """A relayed stream's end (as `stream_end` encodes it) as the error the relay ends the node's stream with."""
    if end.code == grpc.StatusCode.UNAVAILABLE.value[0]:
        return errors.NotLeader(job, end.leader)
    return ERROR_OF.get(end.code, errors.Unavailable)(end.message)
