"""The one JSON shape of every `muster VERB --json` and of the live page's API
(docs/reference/json-schema.json): protobuf messages as plain JSON values."""

from __future__ import annotations

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.json_format import MessageToDict

_INT64 = {FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
          FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64}
# Fields whose zero value says "none" on the wire (their comments in muster.proto): null in JSON.
_NONE_WHEN_ZERO = {
    "JobStatus": {"leader", "ended_unix_ms", "outcome_reason", "next_page_token"},
    "JobRecord": {"leader", "ended_unix_ms", "reason", "step", "steps_per_second"},
    "RecoveryRecord": {"tier", "superseded_by"},
    "RankStatus": {"pid", "host", "compute_us", "step_time_us", "straggler_factor", "phase", "snapshot_every",
                   "snapshot_bytes"},
}


def as_json(message) -> dict:
    """One JSON shape for every verb's --json (docs/reference/json-schema.json): every field present,
    numbers as numbers (protobuf's JSON writes 64-bit ones as strings), and what is absent as null
    (a message field not set, a value whose zero means none), never as a zero of its type."""
    def shaped(descriptor, d: dict) -> dict:
        nulls = _NONE_WHEN_ZERO.get(descriptor.name, ())
        for f in descriptor.fields:
            if f.name not in d:  # (an unset message field: every other one is printed)
                d[f.name] = None
                continue
            if f.message_type is not None and not f.message_type.GetOptions().map_entry:
                for item in d[f.name] if f.is_repeated else [d[f.name]]:
                    shaped(f.message_type, item)
            elif f.type in _INT64:
                d[f.name] = [int(x) for x in d[f.name]] if f.is_repeated else int(d[f.name])
            if f.name in nulls and not d[f.name]:
                d[f.name] = None
        return d
    return shaped(message.DESCRIPTOR, MessageToDict(message, preserving_proto_field_name=True,
                                                    always_print_fields_with_no_presence=True))


def status_document(response, job: str = "") -> dict:
    """A StatusResponse as `muster status --json` prints it: the replica, the leader and term of
    `job` (null without it), and every job shown."""
    jobs = [as_json(j) for j in response.jobs]
    named = next((j for j in jobs if j["name"] == job), None) if job else None
    return {"replica": response.replica, "version": response.version, "leader": named["leader"] if named else None,
            "term": named["term"] if named else None, "jobs": jobs}
