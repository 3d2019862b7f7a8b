"""Deprecated: ``weightstream.torch.host`` (``stream_trainable``, ``TrainableError``, ...) and
its modules. This path re-exports them for one release."""

import warnings

from weightstream.sizes import size_text  # noqa: F401
from weightstream.torch.host.layers import TIMES, Slot, Trainable  # noqa: F401
from weightstream.torch.host.plan import HostPlan, stream_trainable  # noqa: F401
from weightstream.torch.host.sizing import (  # noqa: F401
    BOUNCE_GROUPS,
    MASTERS,
    OPTIMIZERS,
    check_host_fits,
    check_master,
    check_optimizer,
    group_names,
    has_master,
    host_bytes,
    host_room,
    layer_ring_bytes,
    ring_bytes,
    trainable_layers,
)
from weightstream.torch.host.storage import (  # noqa: F401
    ALIGN,
    BounceRing,
    Carver,
    HostStorage,
    TrainableError,
)

warnings.warn(
    "weightstream.torch.trainable is deprecated: import from weightstream.torch.host",
    DeprecationWarning,
    stacklevel=2,
)
