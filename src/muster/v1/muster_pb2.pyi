from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RankState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RANK_STATE_UNSPECIFIED: _ClassVar[RankState]
    RANK_STATE_STARTING: _ClassVar[RankState]
    RANK_STATE_RUNNING: _ClassVar[RankState]
    RANK_STATE_LONG_PHASE: _ClassVar[RankState]
    RANK_STATE_EXITED: _ClassVar[RankState]
    RANK_STATE_UNMONITORED: _ClassVar[RankState]
    RANK_STATE_FORMING: _ClassVar[RankState]
    RANK_STATE_HOLDING: _ClassVar[RankState]
    RANK_STATE_RESTARTING: _ClassVar[RankState]
    RANK_STATE_FINISHED: _ClassVar[RankState]

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_ACTIVE: _ClassVar[Role]
    ROLE_SPARE: _ClassVar[Role]
    ROLE_WAITING: _ClassVar[Role]
    ROLE_EVICTED: _ClassVar[Role]
RANK_STATE_UNSPECIFIED: RankState
RANK_STATE_STARTING: RankState
RANK_STATE_RUNNING: RankState
RANK_STATE_LONG_PHASE: RankState
RANK_STATE_EXITED: RankState
RANK_STATE_UNMONITORED: RankState
RANK_STATE_FORMING: RankState
RANK_STATE_HOLDING: RankState
RANK_STATE_RESTARTING: RankState
RANK_STATE_FINISHED: RankState
ROLE_UNSPECIFIED: Role
ROLE_ACTIVE: Role
ROLE_SPARE: Role
ROLE_WAITING: Role
ROLE_EVICTED: Role

class JobSpec(_message.Message):
    __slots__ = ("min_nodes", "max_nodes", "world_size_multiple", "straggler_action", "straggler_factor", "straggler_min_steps", "on_state_lost")
    MIN_NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_MULTIPLE_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_ACTION_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_FACTOR_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_MIN_STEPS_FIELD_NUMBER: _ClassVar[int]
    ON_STATE_LOST_FIELD_NUMBER: _ClassVar[int]
    min_nodes: int
    max_nodes: int
    world_size_multiple: int
    straggler_action: str
    straggler_factor: float
    straggler_min_steps: int
    on_state_lost: str
    def __init__(self, min_nodes: _Optional[int] = ..., max_nodes: _Optional[int] = ..., world_size_multiple: _Optional[int] = ..., straggler_action: _Optional[str] = ..., straggler_factor: _Optional[float] = ..., straggler_min_steps: _Optional[int] = ..., on_state_lost: _Optional[str] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("job", "node_id", "slots", "host", "store_port", "spec", "agent_pid", "is_process", "master_port", "join_key")
    JOB_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    AGENT_PID_FIELD_NUMBER: _ClassVar[int]
    IS_PROCESS_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    JOIN_KEY_FIELD_NUMBER: _ClassVar[int]
    job: str
    node_id: str
    slots: int
    host: str
    store_port: int
    spec: JobSpec
    agent_pid: int
    is_process: bool
    master_port: int
    join_key: bytes
    def __init__(self, job: _Optional[str] = ..., node_id: _Optional[str] = ..., slots: _Optional[int] = ..., host: _Optional[str] = ..., store_port: _Optional[int] = ..., spec: _Optional[_Union[JobSpec, _Mapping]] = ..., agent_pid: _Optional[int] = ..., is_process: _Optional[bool] = ..., master_port: _Optional[int] = ..., join_key: _Optional[bytes] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("job", "node_id", "member_id", "term", "generation", "heartbeat_interval_ms", "heartbeat_timeout_ms", "session_secret", "run", "relay")
    JOB_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    SESSION_SECRET_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    job: str
    node_id: str
    member_id: int
    term: int
    generation: int
    heartbeat_interval_ms: int
    heartbeat_timeout_ms: int
    session_secret: bytes
    run: int
    relay: bool
    def __init__(self, job: _Optional[str] = ..., node_id: _Optional[str] = ..., member_id: _Optional[int] = ..., term: _Optional[int] = ..., generation: _Optional[int] = ..., heartbeat_interval_ms: _Optional[int] = ..., heartbeat_timeout_ms: _Optional[int] = ..., session_secret: _Optional[bytes] = ..., run: _Optional[int] = ..., relay: _Optional[bool] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("job", "node_id", "member_id", "immediate", "reason", "finished", "session_secret")
    JOB_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    IMMEDIATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    SESSION_SECRET_FIELD_NUMBER: _ClassVar[int]
    job: str
    node_id: str
    member_id: int
    immediate: bool
    reason: str
    finished: bool
    session_secret: bytes
    def __init__(self, job: _Optional[str] = ..., node_id: _Optional[str] = ..., member_id: _Optional[int] = ..., immediate: _Optional[bool] = ..., reason: _Optional[str] = ..., finished: _Optional[bool] = ..., session_secret: _Optional[bytes] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ("generation", "switch_at_step")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SWITCH_AT_STEP_FIELD_NUMBER: _ClassVar[int]
    generation: int
    switch_at_step: int
    def __init__(self, generation: _Optional[int] = ..., switch_at_step: _Optional[int] = ...) -> None: ...

class RankReport(_message.Message):
    __slots__ = ("local_rank", "pid", "step", "step_time_us", "state", "heard_ms_ago", "phase", "digest_step", "digest", "generation", "compute_us", "restarts", "snapshot_every", "snapshot_bytes", "reform", "steps_unmeasured")
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_US_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    HEARD_MS_AGO_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    DIGEST_STEP_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_US_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_EVERY_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    REFORM_FIELD_NUMBER: _ClassVar[int]
    STEPS_UNMEASURED_FIELD_NUMBER: _ClassVar[int]
    local_rank: int
    pid: int
    step: int
    step_time_us: int
    state: RankState
    heard_ms_ago: int
    phase: str
    digest_step: int
    digest: bytes
    generation: int
    compute_us: int
    restarts: int
    snapshot_every: int
    snapshot_bytes: int
    reform: ReformPhases
    steps_unmeasured: bool
    def __init__(self, local_rank: _Optional[int] = ..., pid: _Optional[int] = ..., step: _Optional[int] = ..., step_time_us: _Optional[int] = ..., state: _Optional[_Union[RankState, str]] = ..., heard_ms_ago: _Optional[int] = ..., phase: _Optional[str] = ..., digest_step: _Optional[int] = ..., digest: _Optional[bytes] = ..., generation: _Optional[int] = ..., compute_us: _Optional[int] = ..., restarts: _Optional[int] = ..., snapshot_every: _Optional[int] = ..., snapshot_bytes: _Optional[int] = ..., reform: _Optional[_Union[ReformPhases, _Mapping]] = ..., steps_unmeasured: _Optional[bool] = ...) -> None: ...

class ReformPhases(_message.Message):
    __slots__ = ("generation", "abort_s", "form_s", "sync_s", "transfer_s", "bytes_received", "tier", "step", "steps_lost", "begun_at")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ABORT_S_FIELD_NUMBER: _ClassVar[int]
    FORM_S_FIELD_NUMBER: _ClassVar[int]
    SYNC_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEPS_LOST_FIELD_NUMBER: _ClassVar[int]
    BEGUN_AT_FIELD_NUMBER: _ClassVar[int]
    generation: int
    abort_s: float
    form_s: float
    sync_s: float
    transfer_s: float
    bytes_received: int
    tier: str
    step: int
    steps_lost: int
    begun_at: int
    def __init__(self, generation: _Optional[int] = ..., abort_s: _Optional[float] = ..., form_s: _Optional[float] = ..., sync_s: _Optional[float] = ..., transfer_s: _Optional[float] = ..., bytes_received: _Optional[int] = ..., tier: _Optional[str] = ..., step: _Optional[int] = ..., steps_lost: _Optional[int] = ..., begun_at: _Optional[int] = ...) -> None: ...

class RankExit(_message.Message):
    __slots__ = ("local_rank", "pid", "exit_code", "restarting", "error", "step")
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    RESTARTING_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    local_rank: int
    pid: int
    exit_code: int
    restarting: bool
    error: str
    step: int
    def __init__(self, local_rank: _Optional[int] = ..., pid: _Optional[int] = ..., exit_code: _Optional[int] = ..., restarting: _Optional[bool] = ..., error: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class NodeFrame(_message.Message):
    __slots__ = ("job", "node_id", "member_id", "term", "generation", "ranks", "exits", "session_secret", "rejoin", "via_relay", "stream_seq", "run", "world_size", "local_world_size", "steps_only")
    JOB_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    EXITS_FIELD_NUMBER: _ClassVar[int]
    SESSION_SECRET_FIELD_NUMBER: _ClassVar[int]
    REJOIN_FIELD_NUMBER: _ClassVar[int]
    VIA_RELAY_FIELD_NUMBER: _ClassVar[int]
    STREAM_SEQ_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    STEPS_ONLY_FIELD_NUMBER: _ClassVar[int]
    job: str
    node_id: str
    member_id: int
    term: int
    generation: int
    ranks: _containers.RepeatedCompositeFieldContainer[RankReport]
    exits: _containers.RepeatedCompositeFieldContainer[RankExit]
    session_secret: bytes
    rejoin: JoinRequest
    via_relay: bool
    stream_seq: int
    run: int
    world_size: int
    local_world_size: int
    steps_only: bool
    def __init__(self, job: _Optional[str] = ..., node_id: _Optional[str] = ..., member_id: _Optional[int] = ..., term: _Optional[int] = ..., generation: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[RankReport, _Mapping]]] = ..., exits: _Optional[_Iterable[_Union[RankExit, _Mapping]]] = ..., session_secret: _Optional[bytes] = ..., rejoin: _Optional[_Union[JoinRequest, _Mapping]] = ..., via_relay: _Optional[bool] = ..., stream_seq: _Optional[int] = ..., run: _Optional[int] = ..., world_size: _Optional[int] = ..., local_world_size: _Optional[int] = ..., steps_only: _Optional[bool] = ...) -> None: ...

class Assignment(_message.Message):
    __slots__ = ("generation", "role", "abort_previous", "switch_at_step", "world_size", "node_rank", "rank_offset", "local_world_size", "num_nodes", "store_address", "store_prefix", "reason", "local_ranks", "master_address", "down_local_ranks", "start_ranks", "shrink_of", "excluded_ranks", "store_key", "left_out")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ABORT_PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    SWITCH_AT_STEP_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    RANK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LOCAL_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_NODES_FIELD_NUMBER: _ClassVar[int]
    STORE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STORE_PREFIX_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANKS_FIELD_NUMBER: _ClassVar[int]
    MASTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DOWN_LOCAL_RANKS_FIELD_NUMBER: _ClassVar[int]
    START_RANKS_FIELD_NUMBER: _ClassVar[int]
    SHRINK_OF_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_RANKS_FIELD_NUMBER: _ClassVar[int]
    STORE_KEY_FIELD_NUMBER: _ClassVar[int]
    LEFT_OUT_FIELD_NUMBER: _ClassVar[int]
    generation: int
    role: Role
    abort_previous: bool
    switch_at_step: int
    world_size: int
    node_rank: int
    rank_offset: int
    local_world_size: int
    num_nodes: int
    store_address: str
    store_prefix: str
    reason: str
    local_ranks: _containers.RepeatedScalarFieldContainer[int]
    master_address: str
    down_local_ranks: _containers.RepeatedScalarFieldContainer[int]
    start_ranks: bool
    shrink_of: int
    excluded_ranks: _containers.RepeatedScalarFieldContainer[int]
    store_key: bytes
    left_out: int
    def __init__(self, generation: _Optional[int] = ..., role: _Optional[_Union[Role, str]] = ..., abort_previous: _Optional[bool] = ..., switch_at_step: _Optional[int] = ..., world_size: _Optional[int] = ..., node_rank: _Optional[int] = ..., rank_offset: _Optional[int] = ..., local_world_size: _Optional[int] = ..., num_nodes: _Optional[int] = ..., store_address: _Optional[str] = ..., store_prefix: _Optional[str] = ..., reason: _Optional[str] = ..., local_ranks: _Optional[_Iterable[int]] = ..., master_address: _Optional[str] = ..., down_local_ranks: _Optional[_Iterable[int]] = ..., start_ranks: _Optional[bool] = ..., shrink_of: _Optional[int] = ..., excluded_ranks: _Optional[_Iterable[int]] = ..., store_key: _Optional[bytes] = ..., left_out: _Optional[int] = ...) -> None: ...

class Directive(_message.Message):
    __slots__ = ("term", "generation", "assignment", "drain", "end", "finishing")
    TERM_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ASSIGNMENT_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    FINISHING_FIELD_NUMBER: _ClassVar[int]
    term: int
    generation: int
    assignment: Assignment
    drain: Drain
    end: JobEnd
    finishing: bool
    def __init__(self, term: _Optional[int] = ..., generation: _Optional[int] = ..., assignment: _Optional[_Union[Assignment, _Mapping]] = ..., drain: _Optional[_Union[Drain, _Mapping]] = ..., end: _Optional[_Union[JobEnd, _Mapping]] = ..., finishing: _Optional[bool] = ...) -> None: ...

class Drain(_message.Message):
    __slots__ = ("after_step", "reason", "stop")
    AFTER_STEP_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    after_step: int
    reason: str
    stop: bool
    def __init__(self, after_step: _Optional[int] = ..., reason: _Optional[str] = ..., stop: _Optional[bool] = ...) -> None: ...

class JobEnd(_message.Message):
    __slots__ = ("outcome", "reason", "run")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    outcome: str
    reason: str
    run: int
    def __init__(self, outcome: _Optional[str] = ..., reason: _Optional[str] = ..., run: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("job", "brief", "page_size", "page_token", "run", "node", "states")
    JOB_FIELD_NUMBER: _ClassVar[int]
    BRIEF_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    job: str
    brief: bool
    page_size: int
    page_token: str
    run: int
    node: str
    states: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, job: _Optional[str] = ..., brief: _Optional[bool] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., run: _Optional[int] = ..., node: _Optional[str] = ..., states: _Optional[_Iterable[str]] = ...) -> None: ...

class RankStatus(_message.Message):
    __slots__ = ("rank", "local_rank", "node", "node_rank", "pid", "step", "state", "compute_us", "straggler_factor", "phase", "host", "step_time_us", "restarts", "snapshot_every", "snapshot_bytes")
    RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_US_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_FACTOR_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_US_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_EVERY_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    local_rank: int
    node: str
    node_rank: int
    pid: int
    step: int
    state: str
    compute_us: int
    straggler_factor: float
    phase: str
    host: str
    step_time_us: int
    restarts: int
    snapshot_every: int
    snapshot_bytes: int
    def __init__(self, rank: _Optional[int] = ..., local_rank: _Optional[int] = ..., node: _Optional[str] = ..., node_rank: _Optional[int] = ..., pid: _Optional[int] = ..., step: _Optional[int] = ..., state: _Optional[str] = ..., compute_us: _Optional[int] = ..., straggler_factor: _Optional[float] = ..., phase: _Optional[str] = ..., host: _Optional[str] = ..., step_time_us: _Optional[int] = ..., restarts: _Optional[int] = ..., snapshot_every: _Optional[int] = ..., snapshot_bytes: _Optional[int] = ...) -> None: ...

class JobStatus(_message.Message):
    __slots__ = ("name", "leader", "term", "generation", "world_size", "ranks", "spares", "phase", "live", "nodes", "health", "summary", "next_page_token", "run", "outcome", "outcome_reason", "started_unix_ms", "ended_unix_ms")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    SPARES_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_REASON_FIELD_NUMBER: _ClassVar[int]
    STARTED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    ENDED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    name: str
    leader: str
    term: int
    generation: int
    world_size: int
    ranks: _containers.RepeatedCompositeFieldContainer[RankStatus]
    spares: _containers.RepeatedScalarFieldContainer[str]
    phase: str
    live: bool
    nodes: _containers.RepeatedScalarFieldContainer[str]
    health: JobHealth
    summary: JobSummary
    next_page_token: str
    run: int
    outcome: str
    outcome_reason: str
    started_unix_ms: int
    ended_unix_ms: int
    def __init__(self, name: _Optional[str] = ..., leader: _Optional[str] = ..., term: _Optional[int] = ..., generation: _Optional[int] = ..., world_size: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[RankStatus, _Mapping]]] = ..., spares: _Optional[_Iterable[str]] = ..., phase: _Optional[str] = ..., live: _Optional[bool] = ..., nodes: _Optional[_Iterable[str]] = ..., health: _Optional[_Union[JobHealth, _Mapping]] = ..., summary: _Optional[_Union[JobSummary, _Mapping]] = ..., next_page_token: _Optional[str] = ..., run: _Optional[int] = ..., outcome: _Optional[str] = ..., outcome_reason: _Optional[str] = ..., started_unix_ms: _Optional[int] = ..., ended_unix_ms: _Optional[int] = ...) -> None: ...

class JobSummary(_message.Message):
    __slots__ = ("nodes", "spares", "rank_states")
    class RankStatesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NODES_FIELD_NUMBER: _ClassVar[int]
    SPARES_FIELD_NUMBER: _ClassVar[int]
    RANK_STATES_FIELD_NUMBER: _ClassVar[int]
    nodes: int
    spares: int
    rank_states: _containers.ScalarMap[str, int]
    def __init__(self, nodes: _Optional[int] = ..., spares: _Optional[int] = ..., rank_states: _Optional[_Mapping[str, int]] = ...) -> None: ...

class JobHealth(_message.Message):
    __slots__ = ("frames_per_second", "live_ranks", "evictions", "last_detection_s", "last_recovery_s", "recent_recoveries", "history")
    FRAMES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    LIVE_RANKS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    LAST_DETECTION_S_FIELD_NUMBER: _ClassVar[int]
    LAST_RECOVERY_S_FIELD_NUMBER: _ClassVar[int]
    RECENT_RECOVERIES_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    frames_per_second: float
    live_ranks: int
    evictions: int
    last_detection_s: float
    last_recovery_s: float
    recent_recoveries: _containers.RepeatedCompositeFieldContainer[RecoveryRecord]
    history: _containers.RepeatedCompositeFieldContainer[HealthSample]
    def __init__(self, frames_per_second: _Optional[float] = ..., live_ranks: _Optional[int] = ..., evictions: _Optional[int] = ..., last_detection_s: _Optional[float] = ..., last_recovery_s: _Optional[float] = ..., recent_recoveries: _Optional[_Iterable[_Union[RecoveryRecord, _Mapping]]] = ..., history: _Optional[_Iterable[_Union[HealthSample, _Mapping]]] = ...) -> None: ...

class HealthSample(_message.Message):
    __slots__ = ("unix_ms", "world_size", "steps_per_second", "restarts")
    UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    unix_ms: int
    world_size: int
    steps_per_second: float
    restarts: int
    def __init__(self, unix_ms: _Optional[int] = ..., world_size: _Optional[int] = ..., steps_per_second: _Optional[float] = ..., restarts: _Optional[int] = ...) -> None: ...

class RecoveryRecord(_message.Message):
    __slots__ = ("generation", "decided_unix_ms", "detection_s", "recovery_s", "planned", "delivered_s", "abort_s", "form_s", "sync_s", "transfer_s", "bytes_moved", "first_step_s", "slowest", "tier", "step", "steps_lost", "superseded_by")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    DECIDED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    DETECTION_S_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_S_FIELD_NUMBER: _ClassVar[int]
    PLANNED_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_S_FIELD_NUMBER: _ClassVar[int]
    ABORT_S_FIELD_NUMBER: _ClassVar[int]
    FORM_S_FIELD_NUMBER: _ClassVar[int]
    SYNC_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_S_FIELD_NUMBER: _ClassVar[int]
    SLOWEST_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEPS_LOST_FIELD_NUMBER: _ClassVar[int]
    SUPERSEDED_BY_FIELD_NUMBER: _ClassVar[int]
    generation: int
    decided_unix_ms: int
    detection_s: float
    recovery_s: float
    planned: bool
    delivered_s: float
    abort_s: float
    form_s: float
    sync_s: float
    transfer_s: float
    bytes_moved: int
    first_step_s: float
    slowest: str
    tier: str
    step: int
    steps_lost: int
    superseded_by: int
    def __init__(self, generation: _Optional[int] = ..., decided_unix_ms: _Optional[int] = ..., detection_s: _Optional[float] = ..., recovery_s: _Optional[float] = ..., planned: _Optional[bool] = ..., delivered_s: _Optional[float] = ..., abort_s: _Optional[float] = ..., form_s: _Optional[float] = ..., sync_s: _Optional[float] = ..., transfer_s: _Optional[float] = ..., bytes_moved: _Optional[int] = ..., first_step_s: _Optional[float] = ..., slowest: _Optional[str] = ..., tier: _Optional[str] = ..., step: _Optional[int] = ..., steps_lost: _Optional[int] = ..., superseded_by: _Optional[int] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("replica", "jobs", "version")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    replica: str
    jobs: _containers.RepeatedCompositeFieldContainer[JobStatus]
    version: str
    def __init__(self, replica: _Optional[str] = ..., jobs: _Optional[_Iterable[_Union[JobStatus, _Mapping]]] = ..., version: _Optional[str] = ...) -> None: ...

class EventsRequest(_message.Message):
    __slots__ = ("job", "run")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    job: str
    run: int
    def __init__(self, job: _Optional[str] = ..., run: _Optional[int] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("generation", "term", "time_unix_ms", "kind", "reason", "nodes", "world_size")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    TIME_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    generation: int
    term: int
    time_unix_ms: int
    kind: str
    reason: str
    nodes: _containers.RepeatedScalarFieldContainer[str]
    world_size: int
    def __init__(self, generation: _Optional[int] = ..., term: _Optional[int] = ..., time_unix_ms: _Optional[int] = ..., kind: _Optional[str] = ..., reason: _Optional[str] = ..., nodes: _Optional[_Iterable[str]] = ..., world_size: _Optional[int] = ...) -> None: ...

class EventsResponse(_message.Message):
    __slots__ = ("job", "events", "run", "recoveries")
    JOB_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    RECOVERIES_FIELD_NUMBER: _ClassVar[int]
    job: str
    events: _containers.RepeatedCompositeFieldContainer[Event]
    run: int
    recoveries: _containers.RepeatedCompositeFieldContainer[RecoveryRecord]
    def __init__(self, job: _Optional[str] = ..., events: _Optional[_Iterable[_Union[Event, _Mapping]]] = ..., run: _Optional[int] = ..., recoveries: _Optional[_Iterable[_Union[RecoveryRecord, _Mapping]]] = ...) -> None: ...

class JobsRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class JobRecord(_message.Message):
    __slots__ = ("name", "run", "outcome", "reason", "world_size", "generation", "started_unix_ms", "ended_unix_ms", "leader", "step", "steps_per_second")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STARTED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    ENDED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    name: str
    run: int
    outcome: str
    reason: str
    world_size: int
    generation: int
    started_unix_ms: int
    ended_unix_ms: int
    leader: str
    step: int
    steps_per_second: float
    def __init__(self, name: _Optional[str] = ..., run: _Optional[int] = ..., outcome: _Optional[str] = ..., reason: _Optional[str] = ..., world_size: _Optional[int] = ..., generation: _Optional[int] = ..., started_unix_ms: _Optional[int] = ..., ended_unix_ms: _Optional[int] = ..., leader: _Optional[str] = ..., step: _Optional[int] = ..., steps_per_second: _Optional[float] = ...) -> None: ...

class JobsResponse(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobRecord]
    def __init__(self, jobs: _Optional[_Iterable[_Union[JobRecord, _Mapping]]] = ...) -> None: ...

class StopRequest(_message.Message):
    __slots__ = ("job", "reason")
    JOB_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job: str
    reason: str
    def __init__(self, job: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class StopResponse(_message.Message):
    __slots__ = ("run", "after_step", "already")
    RUN_FIELD_NUMBER: _ClassVar[int]
    AFTER_STEP_FIELD_NUMBER: _ClassVar[int]
    ALREADY_FIELD_NUMBER: _ClassVar[int]
    run: int
    after_step: int
    already: bool
    def __init__(self, run: _Optional[int] = ..., after_step: _Optional[int] = ..., already: _Optional[bool] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("job", "node", "reason")
    JOB_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job: str
    node: str
    reason: str
    def __init__(self, job: _Optional[str] = ..., node: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("generation", "after_step", "already")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    AFTER_STEP_FIELD_NUMBER: _ClassVar[int]
    ALREADY_FIELD_NUMBER: _ClassVar[int]
    generation: int
    after_step: int
    already: bool
    def __init__(self, generation: _Optional[int] = ..., after_step: _Optional[int] = ..., already: _Optional[bool] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("job", "run")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    job: str
    run: int
    def __init__(self, job: _Optional[str] = ..., run: _Optional[int] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    def __init__(self, deleted: _Optional[int] = ...) -> None: ...

class RelayedFrame(_message.Message):
    __slots__ = ("stream", "frame")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    FRAME_FIELD_NUMBER: _ClassVar[int]
    stream: int
    frame: NodeFrame
    def __init__(self, stream: _Optional[int] = ..., frame: _Optional[_Union[NodeFrame, _Mapping]] = ...) -> None: ...

class RelayUp(_message.Message):
    __slots__ = ("job", "relay", "frames", "ended", "silent", "summary", "maps")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    SILENT_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    MAPS_FIELD_NUMBER: _ClassVar[int]
    job: str
    relay: str
    frames: _containers.RepeatedCompositeFieldContainer[RelayedFrame]
    ended: _containers.RepeatedScalarFieldContainer[int]
    silent: _containers.RepeatedCompositeFieldContainer[SilentStream]
    summary: RelaySummary
    maps: bool
    def __init__(self, job: _Optional[str] = ..., relay: _Optional[str] = ..., frames: _Optional[_Iterable[_Union[RelayedFrame, _Mapping]]] = ..., ended: _Optional[_Iterable[int]] = ..., silent: _Optional[_Iterable[_Union[SilentStream, _Mapping]]] = ..., summary: _Optional[_Union[RelaySummary, _Mapping]] = ..., maps: _Optional[bool] = ...) -> None: ...

class RelaySummary(_message.Message):
    __slots__ = ("low_step", "high_step", "nodes", "lagging", "resumed")
    LOW_STEP_FIELD_NUMBER: _ClassVar[int]
    HIGH_STEP_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    LAGGING_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    low_step: int
    high_step: int
    nodes: int
    lagging: _containers.RepeatedCompositeFieldContainer[LaggingStream]
    resumed: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, low_step: _Optional[int] = ..., high_step: _Optional[int] = ..., nodes: _Optional[int] = ..., lagging: _Optional[_Iterable[_Union[LaggingStream, _Mapping]]] = ..., resumed: _Optional[_Iterable[int]] = ...) -> None: ...

class LaggingStream(_message.Message):
    __slots__ = ("stream", "since_ms", "step")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    SINCE_MS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    stream: int
    since_ms: int
    step: int
    def __init__(self, stream: _Optional[int] = ..., since_ms: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class SilentStream(_message.Message):
    __slots__ = ("stream", "silent_ms")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    SILENT_MS_FIELD_NUMBER: _ClassVar[int]
    stream: int
    silent_ms: int
    def __init__(self, stream: _Optional[int] = ..., silent_ms: _Optional[int] = ...) -> None: ...

class StreamEnd(_message.Message):
    __slots__ = ("code", "message", "leader")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    leader: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., leader: _Optional[str] = ...) -> None: ...

class RelayedDirective(_message.Message):
    __slots__ = ("stream", "directive", "end")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    DIRECTIVE_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    stream: int
    directive: Directive
    end: StreamEnd
    def __init__(self, stream: _Optional[int] = ..., directive: _Optional[_Union[Directive, _Mapping]] = ..., end: _Optional[_Union[StreamEnd, _Mapping]] = ...) -> None: ...

class RelayDown(_message.Message):
    __slots__ = ("items", "pulse", "summaries", "map")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    PULSE_FIELD_NUMBER: _ClassVar[int]
    SUMMARIES_FIELD_NUMBER: _ClassVar[int]
    MAP_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[RelayedDirective]
    pulse: Directive
    summaries: bool
    map: RelayedMap
    def __init__(self, items: _Optional[_Iterable[_Union[RelayedDirective, _Mapping]]] = ..., pulse: _Optional[_Union[Directive, _Mapping]] = ..., summaries: _Optional[bool] = ..., map: _Optional[_Union[RelayedMap, _Mapping]] = ...) -> None: ...

class RelayedMap(_message.Message):
    __slots__ = ("directive", "removed_node_ranks", "own")
    DIRECTIVE_FIELD_NUMBER: _ClassVar[int]
    REMOVED_NODE_RANKS_FIELD_NUMBER: _ClassVar[int]
    OWN_FIELD_NUMBER: _ClassVar[int]
    directive: Directive
    removed_node_ranks: _containers.RepeatedScalarFieldContainer[int]
    own: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, directive: _Optional[_Union[Directive, _Mapping]] = ..., removed_node_ranks: _Optional[_Iterable[int]] = ..., own: _Optional[_Iterable[int]] = ...) -> None: ...
