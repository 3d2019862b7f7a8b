"""The wire protocol's enums and messages as this package gives them, from the native client
(``weightstream._native``, over client-rs, the one implementation of ``proto/``).

- Each enum value by its proto name, e.g. ``DTYPE_BF16``, ``BACKEND_CUDA``,
  ``FAULT_SHUTTING_DOWN``; and each enum as a ``{name: number}`` dict: ``DTYPES``,
  ``BACKENDS``, ``FAULT_CODES``.
- The records the client returns (read-only, with the protobuf field names):
  ``GetInfoResponse``, ``ModelManifest`` (with ``StorePhases`` and its ``formats``, each a
  ``FormatUse``: format, tensors, bytes, weights, bits per weight), ``TensorInfo``,
  ``LoadProgress``,
  ``ListModelsResponse``, ``SessionInfo``, ``SessionStats``, ``WaitTotals`` (a session's waits
  for weights as its client measured them), ``OpenSessionResponse``,
  ``Region``, ``GroupLayout``, ``TensorPlacement``, ``Staged``, ``Device``, ``Limits``,
  ``Quotas``, ``QuotaUse``, ``BeginUploadResponse``, ``UploadTensor``.
"""

from __future__ import annotations

from weightstream import _native

DTYPES: dict[str, int] = dict(_native.DTYPES)
BACKENDS: dict[str, int] = dict(_native.BACKENDS)
FAULT_CODES: dict[str, int] = dict(_native.FAULT_CODES)

globals().update(DTYPES)
globals().update(BACKENDS)
globals().update(FAULT_CODES)

GetInfoResponse = _native.GetInfoResponse
Device = _native.Device
Limits = _native.Limits
Quotas = _native.Quotas
QuotaUse = _native.QuotaUse
ModelManifest = _native.ModelManifest
StorePhases = _native.StorePhases
FormatUse = _native.FormatUse
TensorInfo = _native.TensorInfo
LoadProgress = _native.LoadProgress
ListModelsResponse = _native.ListModelsResponse
SessionInfo = _native.SessionInfo
SessionStats = _native.SessionStats
WaitTotals = _native.WaitTotals
OpenSessionResponse = _native.OpenSessionResponse
Region = _native.Region
GroupLayout = _native.GroupLayout
TensorPlacement = _native.TensorPlacement
Staged = _native.Staged
BeginUploadResponse = _native.BeginUploadResponse
UploadTensor = _native.UploadTensor


def name_of(enum: dict[str, int], value: int) -> str:
    """The proto name of ``value`` in ``enum`` (e.g. ``name_of(FAULT_CODES, 6)``)."""
    for name, number in enum.items():
        if number == value:
            return name
    return str(value)
