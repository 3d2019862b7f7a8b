"""weightstream: Python client of the weightstream daemon.

``weightstream.connect()`` gives a client; ``weightstream.torch.attach(model, device)`` streams
a model's frozen weights through the daemon. The protocol is spoken by the native extension
``weightstream._native`` (client-rs, through PyO3); its enums and records are in
``weightstream.protocol``.
"""

from weightstream.client import Client, connect
from weightstream.errors import (
    DaemonUnavailable,
    RequestRejected,
    SessionFault,
    WeightstreamError,
)

__version__ = "0.1.0"

__all__ = [
    "Client",
    "DaemonUnavailable",
    "RequestRejected",
    "SessionFault",
    "WeightstreamError",
    "__version__",
    "connect",
]
