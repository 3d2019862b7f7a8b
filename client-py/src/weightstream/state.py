"""Deprecated: ``weightstream.regions`` (StateRegion).
This path is that module, for one release."""

from weightstream import _deprecated, regions

_deprecated.moved(__name__, regions)
