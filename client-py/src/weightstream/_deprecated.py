"""Old import paths kept for one release: ``moved(__name__, module)`` at the end of the old
module makes importing it warn (``DeprecationWarning``) and give ``module`` itself, private
names and all."""

import sys
import warnings


def moved(old: str, module) -> None:
    """Makes the module being imported as ``old`` be ``module``, with a warning naming both."""
    warnings.warn(
        f"{old} is deprecated: import {module.__name__}", DeprecationWarning, stacklevel=3
    )
    sys.modules[old] = module
