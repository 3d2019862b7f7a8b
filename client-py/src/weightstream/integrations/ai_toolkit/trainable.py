"""Deprecated: ``weightstream.integrations.ai_toolkit.optimizer`` (trainable: host).
This path is that module, for one release."""

from weightstream import _deprecated
from weightstream.integrations.ai_toolkit import optimizer

_deprecated.moved(__name__, optimizer)
