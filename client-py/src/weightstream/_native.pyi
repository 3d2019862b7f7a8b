"""Types of the native extension (client-py/rust/): the protocol, over client-rs."""

from collections.abc import Callable
from os import PathLike
from typing import Any

SYSTEM_SOCKET: str
SOCKET_ENV: str
DTYPES: dict[str, int]
BACKENDS: dict[str, int]
FAULT_CODES: dict[str, int]

def socket_path(socket: str | PathLike[str] | None = None) -> PathLike[str]: ...
def _after_fork_in_child() -> None: ...

# The 8-bit AdamW kernel (weightstream.torch.adamw8 is its API): tensors by data_ptr().
ADAMW8_BLOCK: int

def adamw8bit_step(
    p_ptr: int,
    g_ptr: int,
    g_dtype: str,
    qm_ptr: int,
    qv_ptr: int,
    sm_ptr: int,
    sv_ptr: int,
    w_ptr: int,
    n: int,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    grad_scale: float,
    isa: str | None = None,
) -> None: ...
def adamw8bit_isas() -> list[str]: ...

# Records: read-only, with the proto's field names (see weightstream.protocol).
GetInfoResponse = Any
Device = Any
Limits = Any
Quotas = Any
QuotaUse = Any
TensorInfo = Any
ModelManifest = Any
StorePhases = Any
LoadProgress = Any
ListModelsResponse = Any
TensorPlacement = Any
GroupLayout = Any
Region = Any
OpenSessionResponse = Any
SessionStats = Any
SessionInfo = Any
WaitTotals = Any
Staged = Any
BeginUploadResponse = Any
UploadTensor = Any

#: Upload data: ``bytes``, or ``(data_ptr, nbytes)`` of a contiguous CPU tensor kept alive.
Payload = bytes | tuple[int, int]

class Client:
    def __init__(self, socket: str | PathLike[str] | None = None) -> None: ...
    @property
    def socket(self) -> PathLike[str]: ...
    @property
    def handoff_socket(self) -> PathLike[str]: ...
    @property
    def loaded(self) -> dict[str, list[PathLike[str]]]: ...
    def info(self) -> GetInfoResponse: ...
    def reconnect(self, timeout: float) -> None: ...
    def restore_model(self, model_id: str) -> bool: ...
    def fetch_fd(self, secret: str) -> tuple[int, int]: ...
    def load_model(
        self,
        paths: list[str],
        name: str = "",
        progress: Callable[[LoadProgress], object] | None = None,
        quantize: str | None = None,
        retention: str = "cached",
    ) -> ModelManifest: ...
    def upload_model(
        self,
        name: str,
        tensors: list[tuple[str, int, list[int], Payload]],
        quantize: list[str] = ...,
        retention: str = "cached",
    ) -> tuple[ModelManifest, bool]: ...
    def begin_upload(
        self,
        name: str,
        tensors: list[tuple[str, int, list[int]]],
        quantize: list[str] = ...,
        prequantized: dict[str, tuple[str, list[int]]] = ...,
    ) -> BeginUploadResponse: ...
    def commit_upload(
        self, upload_id: str, retention: str = "cached"
    ) -> tuple[ModelManifest, bool]: ...
    def release_model(self, model_id: str, all_references: bool = False) -> int: ...
    def list_models(self) -> ListModelsResponse: ...
    def list_sessions(self) -> list[SessionInfo]: ...
    def alloc_state_region(
        self, session_id: str, nbytes: int, label: str = ""
    ) -> tuple[str, int, int]: ...
    def free_state_region(self, session_id: str, region_id: str) -> None: ...
    def open_session(
        self,
        model_id: str,
        groups: list[tuple[str, list[str]]],
        vram_budget: int,
        staging_bytes: int = 0,
        device_uuid: str = "",
        label: str = "",
        copy_bandwidth_limit: int = 0,
    ) -> Session: ...

class Session:
    @property
    def id(self) -> str: ...
    @property
    def model_id(self) -> str: ...
    @property
    def layout(self) -> OpenSessionResponse: ...
    @property
    def last_plan(self) -> list[int] | None: ...
    @property
    def submitted(self) -> int: ...
    @property
    def ended(self) -> str | None: ...
    @property
    def closed(self) -> bool: ...
    @property
    def gpu_wait_reports(self) -> int: ...
    def region_fd(self, index: int) -> int: ...
    def submit(self, group: int) -> int: ...
    def wait(self, ticket: int) -> Staged: ...
    def try_wait(self, ticket: int) -> Staged | None: ...
    def add_gpu_wait(self, group: int, ns: int, step: int | None = None) -> None: ...
    def mark_step(self) -> int: ...
    def gpu_wait(self) -> WaitTotals: ...
    def report_gpu_wait(self) -> None: ...
    def acquire(self, group: int) -> Staged: ...
    def release(self, ticket: int) -> None: ...
    def release_and_acquire(self, ticket: int, group: int) -> Staged: ...
    def plan(self, groups: list[int]) -> None: ...
    def disconnect(self) -> None: ...
    def reopen(self, client: Client, model_id: str) -> None: ...
    def close(self) -> None: ...
