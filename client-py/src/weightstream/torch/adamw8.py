"""Deprecated: ``weightstream.torch.host.adamw8``.
This path is that module, for one release."""

from weightstream import _deprecated
from weightstream.torch.host import adamw8

_deprecated.moved(__name__, adamw8)
