"""weightstream: Python client of the weightstream daemon.

``weightstream.connect()`` gives a client; ``weightstream.torch.attach(model, device)`` streams
a model's frozen weights through the daemon. The wire protocol is in ``weightstream.v1``.
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
