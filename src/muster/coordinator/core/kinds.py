"""The kinds of failure the leader acts on, as the history records them and the wire sends them.

A `StrEnum`, so that its members are the very strings persisted and sent before it existed: they
compare equal to the plain strings of a decoded history and format as them. The worker keeps its
own set of these strings (worker/ imports nothing of the coordinator); a test keeps the two equal.
"""

from enum import StrEnum


class FailureKind(StrEnum):
    NODE_SILENT = "node_silent"  # no frame from the node for the heartbeat timeout
    PROCESS_EXITED = "process_exited"  # a process node exited, or its stream closed without leaving
    RANK_EXITED = "rank_exited"
    RANK_SILENT = "rank_silent"  # its agent has not heard from it for the heartbeat timeout
    RANK_STALLED = "rank_stalled"  # its step did not advance for the progress timeout
    RANK_NOT_FORMED = "rank_not_formed"  # did not reach the generation within the form timeout
    RANK_RESTARTED = "rank_restarted"  # its agent restarts it in place (a script without the library)
    GROUP_BROKEN = "group_broken"  # ranks hold after a failed collective, nobody found failed
    GROUP_NOT_FORMED = "group_not_formed"  # every rank arrived but the group did not form


# A node or rank taken out of the job: counted as an eviction.
EVICTIONS = frozenset({FailureKind.NODE_SILENT, FailureKind.RANK_SILENT, FailureKind.RANK_STALLED,
                       FailureKind.RANK_EXITED, FailureKind.PROCESS_EXITED, FailureKind.RANK_NOT_FORMED})
# The same members re-form: a group that broke or did not form, or a rank its agent restarts in place.
GROUP_KINDS = frozenset({FailureKind.GROUP_BROKEN, FailureKind.GROUP_NOT_FORMED, FailureKind.RANK_RESTARTED})
