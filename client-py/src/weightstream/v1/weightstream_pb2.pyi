from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Backend(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BACKEND_UNSPECIFIED: _ClassVar[Backend]
    BACKEND_HOST: _ClassVar[Backend]
    BACKEND_CUDA: _ClassVar[Backend]

class Dtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[Dtype]
    DTYPE_BOOL: _ClassVar[Dtype]
    DTYPE_U8: _ClassVar[Dtype]
    DTYPE_I8: _ClassVar[Dtype]
    DTYPE_F8_E5M2: _ClassVar[Dtype]
    DTYPE_F8_E4M3: _ClassVar[Dtype]
    DTYPE_I16: _ClassVar[Dtype]
    DTYPE_U16: _ClassVar[Dtype]
    DTYPE_F16: _ClassVar[Dtype]
    DTYPE_BF16: _ClassVar[Dtype]
    DTYPE_I32: _ClassVar[Dtype]
    DTYPE_U32: _ClassVar[Dtype]
    DTYPE_F32: _ClassVar[Dtype]
    DTYPE_F64: _ClassVar[Dtype]
    DTYPE_I64: _ClassVar[Dtype]
    DTYPE_U64: _ClassVar[Dtype]

class FaultCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FAULT_UNSPECIFIED: _ClassVar[FaultCode]
    FAULT_INVALID_ARGUMENT: _ClassVar[FaultCode]
    FAULT_NOT_FOUND: _ClassVar[FaultCode]
    FAULT_FAILED_PRECONDITION: _ClassVar[FaultCode]
    FAULT_RESOURCE_EXHAUSTED: _ClassVar[FaultCode]
    FAULT_INTERNAL: _ClassVar[FaultCode]
    FAULT_SHUTTING_DOWN: _ClassVar[FaultCode]
BACKEND_UNSPECIFIED: Backend
BACKEND_HOST: Backend
BACKEND_CUDA: Backend
DTYPE_UNSPECIFIED: Dtype
DTYPE_BOOL: Dtype
DTYPE_U8: Dtype
DTYPE_I8: Dtype
DTYPE_F8_E5M2: Dtype
DTYPE_F8_E4M3: Dtype
DTYPE_I16: Dtype
DTYPE_U16: Dtype
DTYPE_F16: Dtype
DTYPE_BF16: Dtype
DTYPE_I32: Dtype
DTYPE_U32: Dtype
DTYPE_F32: Dtype
DTYPE_F64: Dtype
DTYPE_I64: Dtype
DTYPE_U64: Dtype
FAULT_UNSPECIFIED: FaultCode
FAULT_INVALID_ARGUMENT: FaultCode
FAULT_NOT_FOUND: FaultCode
FAULT_FAILED_PRECONDITION: FaultCode
FAULT_RESOURCE_EXHAUSTED: FaultCode
FAULT_INTERNAL: FaultCode
FAULT_SHUTTING_DOWN: FaultCode

class Device(_message.Message):
    __slots__ = ("uuid", "name", "total_memory", "free_memory", "pci_bus_id")
    UUID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MEMORY_FIELD_NUMBER: _ClassVar[int]
    FREE_MEMORY_FIELD_NUMBER: _ClassVar[int]
    PCI_BUS_ID_FIELD_NUMBER: _ClassVar[int]
    uuid: str
    name: str
    total_memory: int
    free_memory: int
    pci_bus_id: str
    def __init__(self, uuid: _Optional[str] = ..., name: _Optional[str] = ..., total_memory: _Optional[int] = ..., free_memory: _Optional[int] = ..., pci_bus_id: _Optional[str] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("max_message_bytes", "max_tensors_per_model", "max_groups_per_session", "max_plan_length", "max_live_tickets", "max_upload_bytes", "max_sessions", "max_name_bytes")
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_TENSORS_PER_MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_GROUPS_PER_SESSION_FIELD_NUMBER: _ClassVar[int]
    MAX_PLAN_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_LIVE_TICKETS_FIELD_NUMBER: _ClassVar[int]
    MAX_UPLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_NAME_BYTES_FIELD_NUMBER: _ClassVar[int]
    max_message_bytes: int
    max_tensors_per_model: int
    max_groups_per_session: int
    max_plan_length: int
    max_live_tickets: int
    max_upload_bytes: int
    max_sessions: int
    max_name_bytes: int
    def __init__(self, max_message_bytes: _Optional[int] = ..., max_tensors_per_model: _Optional[int] = ..., max_groups_per_session: _Optional[int] = ..., max_plan_length: _Optional[int] = ..., max_live_tickets: _Optional[int] = ..., max_upload_bytes: _Optional[int] = ..., max_sessions: _Optional[int] = ..., max_name_bytes: _Optional[int] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("version", "backend", "devices", "limits", "alignment")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    ALIGNMENT_FIELD_NUMBER: _ClassVar[int]
    version: str
    backend: Backend
    devices: _containers.RepeatedCompositeFieldContainer[Device]
    limits: Limits
    alignment: int
    def __init__(self, version: _Optional[str] = ..., backend: _Optional[_Union[Backend, str]] = ..., devices: _Optional[_Iterable[_Union[Device, _Mapping]]] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., alignment: _Optional[int] = ...) -> None: ...

class TensorInfo(_message.Message):
    __slots__ = ("name", "dtype", "shape", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: Dtype
    shape: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[Dtype, str]] = ..., shape: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ...) -> None: ...

class ModelManifest(_message.Message):
    __slots__ = ("model_id", "name", "tensors", "total_bytes", "refcount", "sessions", "source")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    REFCOUNT_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    name: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorInfo]
    total_bytes: int
    refcount: int
    sessions: int
    source: str
    def __init__(self, model_id: _Optional[str] = ..., name: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorInfo, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., refcount: _Optional[int] = ..., sessions: _Optional[int] = ..., source: _Optional[str] = ...) -> None: ...

class LoadModelRequest(_message.Message):
    __slots__ = ("paths", "name", "fd_token")
    PATHS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    FD_TOKEN_FIELD_NUMBER: _ClassVar[int]
    paths: _containers.RepeatedScalarFieldContainer[str]
    name: str
    fd_token: str
    def __init__(self, paths: _Optional[_Iterable[str]] = ..., name: _Optional[str] = ..., fd_token: _Optional[str] = ...) -> None: ...

class LoadProgress(_message.Message):
    __slots__ = ("bytes_done", "bytes_total", "current_file")
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FILE_FIELD_NUMBER: _ClassVar[int]
    bytes_done: int
    bytes_total: int
    current_file: str
    def __init__(self, bytes_done: _Optional[int] = ..., bytes_total: _Optional[int] = ..., current_file: _Optional[str] = ...) -> None: ...

class LoadModelEvent(_message.Message):
    __slots__ = ("progress", "manifest")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    progress: LoadProgress
    manifest: ModelManifest
    def __init__(self, progress: _Optional[_Union[LoadProgress, _Mapping]] = ..., manifest: _Optional[_Union[ModelManifest, _Mapping]] = ...) -> None: ...

class BeginUploadRequest(_message.Message):
    __slots__ = ("name", "tensors")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    name: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorInfo]
    def __init__(self, name: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorInfo, _Mapping]]] = ...) -> None: ...

class UploadTensor(_message.Message):
    __slots__ = ("name", "offset", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    offset: int
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class BeginUploadResponse(_message.Message):
    __slots__ = ("upload_id", "size", "tensors", "fd_secret")
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    FD_SECRET_FIELD_NUMBER: _ClassVar[int]
    upload_id: str
    size: int
    tensors: _containers.RepeatedCompositeFieldContainer[UploadTensor]
    fd_secret: str
    def __init__(self, upload_id: _Optional[str] = ..., size: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[UploadTensor, _Mapping]]] = ..., fd_secret: _Optional[str] = ...) -> None: ...

class CommitUploadRequest(_message.Message):
    __slots__ = ("upload_id",)
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    upload_id: str
    def __init__(self, upload_id: _Optional[str] = ...) -> None: ...

class CommitUploadResponse(_message.Message):
    __slots__ = ("manifest", "deduplicated")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    DEDUPLICATED_FIELD_NUMBER: _ClassVar[int]
    manifest: ModelManifest
    deduplicated: bool
    def __init__(self, manifest: _Optional[_Union[ModelManifest, _Mapping]] = ..., deduplicated: _Optional[bool] = ...) -> None: ...

class ReleaseModelRequest(_message.Message):
    __slots__ = ("model_id",)
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    def __init__(self, model_id: _Optional[str] = ...) -> None: ...

class ReleaseModelResponse(_message.Message):
    __slots__ = ("refcount",)
    REFCOUNT_FIELD_NUMBER: _ClassVar[int]
    refcount: int
    def __init__(self, refcount: _Optional[int] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models", "store_bytes", "next_page_token")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    STORE_BYTES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelManifest]
    store_bytes: int
    next_page_token: str
    def __init__(self, models: _Optional[_Iterable[_Union[ModelManifest, _Mapping]]] = ..., store_bytes: _Optional[int] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class GroupSpec(_message.Message):
    __slots__ = ("name", "tensors")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    name: str
    tensors: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., tensors: _Optional[_Iterable[str]] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("model_id", "device_uuid", "vram_budget", "staging_bytes", "groups", "label")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    VRAM_BUDGET_FIELD_NUMBER: _ClassVar[int]
    STAGING_BYTES_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    device_uuid: str
    vram_budget: int
    staging_bytes: int
    groups: _containers.RepeatedCompositeFieldContainer[GroupSpec]
    label: str
    def __init__(self, model_id: _Optional[str] = ..., device_uuid: _Optional[str] = ..., vram_budget: _Optional[int] = ..., staging_bytes: _Optional[int] = ..., groups: _Optional[_Iterable[_Union[GroupSpec, _Mapping]]] = ..., label: _Optional[str] = ...) -> None: ...

class Region(_message.Message):
    __slots__ = ("index", "size", "cuda_ipc_handle", "fd_secret")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    FD_SECRET_FIELD_NUMBER: _ClassVar[int]
    index: int
    size: int
    cuda_ipc_handle: bytes
    fd_secret: str
    def __init__(self, index: _Optional[int] = ..., size: _Optional[int] = ..., cuda_ipc_handle: _Optional[bytes] = ..., fd_secret: _Optional[str] = ...) -> None: ...

class TensorPlacement(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: Dtype
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[Dtype, str]] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class GroupLayout(_message.Message):
    __slots__ = ("group", "name", "nbytes", "tensors", "resident")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    group: int
    name: str
    nbytes: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorPlacement]
    resident: bool
    def __init__(self, group: _Optional[int] = ..., name: _Optional[str] = ..., nbytes: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorPlacement, _Mapping]]] = ..., resident: _Optional[bool] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("session_id", "regions", "groups", "staging_bytes", "resident_bytes", "event_handles")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    STAGING_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    regions: _containers.RepeatedCompositeFieldContainer[Region]
    groups: _containers.RepeatedCompositeFieldContainer[GroupLayout]
    staging_bytes: int
    resident_bytes: int
    event_handles: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, session_id: _Optional[str] = ..., regions: _Optional[_Iterable[_Union[Region, _Mapping]]] = ..., groups: _Optional[_Iterable[_Union[GroupLayout, _Mapping]]] = ..., staging_bytes: _Optional[int] = ..., resident_bytes: _Optional[int] = ..., event_handles: _Optional[_Iterable[bytes]] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class SessionStats(_message.Message):
    __slots__ = ("acquires", "hits", "reuses", "misses", "resident_hits", "bytes_copied", "copies", "prefetches", "stall_ns", "resyncs", "releases", "evictions")
    ACQUIRES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    REUSES_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_HITS_FIELD_NUMBER: _ClassVar[int]
    BYTES_COPIED_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    PREFETCHES_FIELD_NUMBER: _ClassVar[int]
    STALL_NS_FIELD_NUMBER: _ClassVar[int]
    RESYNCS_FIELD_NUMBER: _ClassVar[int]
    RELEASES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    acquires: int
    hits: int
    reuses: int
    misses: int
    resident_hits: int
    bytes_copied: int
    copies: int
    prefetches: int
    stall_ns: int
    resyncs: int
    releases: int
    evictions: int
    def __init__(self, acquires: _Optional[int] = ..., hits: _Optional[int] = ..., reuses: _Optional[int] = ..., misses: _Optional[int] = ..., resident_hits: _Optional[int] = ..., bytes_copied: _Optional[int] = ..., copies: _Optional[int] = ..., prefetches: _Optional[int] = ..., stall_ns: _Optional[int] = ..., resyncs: _Optional[int] = ..., releases: _Optional[int] = ..., evictions: _Optional[int] = ...) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("session_id", "model_id", "device_uuid", "label", "peer_uid", "peer_gid", "peer_pid", "vram_budget", "staging_bytes", "resident_bytes", "attached", "plan_length", "live_tickets", "stats", "age_ms", "group_stall_ns")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    PEER_UID_FIELD_NUMBER: _ClassVar[int]
    PEER_GID_FIELD_NUMBER: _ClassVar[int]
    PEER_PID_FIELD_NUMBER: _ClassVar[int]
    VRAM_BUDGET_FIELD_NUMBER: _ClassVar[int]
    STAGING_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    PLAN_LENGTH_FIELD_NUMBER: _ClassVar[int]
    LIVE_TICKETS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    AGE_MS_FIELD_NUMBER: _ClassVar[int]
    GROUP_STALL_NS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    model_id: str
    device_uuid: str
    label: str
    peer_uid: int
    peer_gid: int
    peer_pid: int
    vram_budget: int
    staging_bytes: int
    resident_bytes: int
    attached: bool
    plan_length: int
    live_tickets: int
    stats: SessionStats
    age_ms: int
    group_stall_ns: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., model_id: _Optional[str] = ..., device_uuid: _Optional[str] = ..., label: _Optional[str] = ..., peer_uid: _Optional[int] = ..., peer_gid: _Optional[int] = ..., peer_pid: _Optional[int] = ..., vram_budget: _Optional[int] = ..., staging_bytes: _Optional[int] = ..., resident_bytes: _Optional[int] = ..., attached: _Optional[bool] = ..., plan_length: _Optional[int] = ..., live_tickets: _Optional[int] = ..., stats: _Optional[_Union[SessionStats, _Mapping]] = ..., age_ms: _Optional[int] = ..., group_stall_ns: _Optional[_Iterable[int]] = ...) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("sessions", "next_page_token")
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionInfo]
    next_page_token: str
    def __init__(self, sessions: _Optional[_Iterable[_Union[SessionInfo, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class Attach(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class Acquire(_message.Message):
    __slots__ = ("group", "ticket")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    group: int
    ticket: int
    def __init__(self, group: _Optional[int] = ..., ticket: _Optional[int] = ...) -> None: ...

class Release(_message.Message):
    __slots__ = ("ticket",)
    TICKET_FIELD_NUMBER: _ClassVar[int]
    ticket: int
    def __init__(self, ticket: _Optional[int] = ...) -> None: ...

class Plan(_message.Message):
    __slots__ = ("groups",)
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, groups: _Optional[_Iterable[int]] = ...) -> None: ...

class ClientMessage(_message.Message):
    __slots__ = ("attach", "acquire", "release", "plan")
    ATTACH_FIELD_NUMBER: _ClassVar[int]
    ACQUIRE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    attach: Attach
    acquire: Acquire
    release: Release
    plan: Plan
    def __init__(self, attach: _Optional[_Union[Attach, _Mapping]] = ..., acquire: _Optional[_Union[Acquire, _Mapping]] = ..., release: _Optional[_Union[Release, _Mapping]] = ..., plan: _Optional[_Union[Plan, _Mapping]] = ...) -> None: ...

class Attached(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class Staged(_message.Message):
    __slots__ = ("ticket", "region", "offset", "ready_event", "free_event")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    READY_EVENT_FIELD_NUMBER: _ClassVar[int]
    FREE_EVENT_FIELD_NUMBER: _ClassVar[int]
    ticket: int
    region: int
    offset: int
    ready_event: int
    free_event: int
    def __init__(self, ticket: _Optional[int] = ..., region: _Optional[int] = ..., offset: _Optional[int] = ..., ready_event: _Optional[int] = ..., free_event: _Optional[int] = ...) -> None: ...

class Fault(_message.Message):
    __slots__ = ("ticket", "code", "message")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ticket: int
    code: FaultCode
    message: str
    def __init__(self, ticket: _Optional[int] = ..., code: _Optional[_Union[FaultCode, str]] = ..., message: _Optional[str] = ...) -> None: ...

class ServerMessage(_message.Message):
    __slots__ = ("attached", "staged", "fault")
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    STAGED_FIELD_NUMBER: _ClassVar[int]
    FAULT_FIELD_NUMBER: _ClassVar[int]
    attached: Attached
    staged: Staged
    fault: Fault
    def __init__(self, attached: _Optional[_Union[Attached, _Mapping]] = ..., staged: _Optional[_Union[Staged, _Mapping]] = ..., fault: _Optional[_Union[Fault, _Mapping]] = ...) -> None: ...
