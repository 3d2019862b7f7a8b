"""weightstream: Python client of the weightstream daemon.

The generated wire protocol lives in ``weightstream.v1``; the client and the PyTorch
integration are built on it.
"""

__version__ = "0.1.0"
