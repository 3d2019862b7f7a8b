"""Deprecated: ``weightstream.torch.host.optim`` (HostAdamW).
This path is that module, for one release."""

from weightstream import _deprecated
from weightstream.torch.host import optim

_deprecated.moved(__name__, optim)
