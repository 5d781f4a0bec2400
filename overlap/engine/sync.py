"""Renamed `overlap.engine.source_values` (rank 0's values sent at wrap and at load); this path is
that module, kept for one release."""

import sys
import warnings

from overlap.engine import source_values as _module

warnings.warn(
    "overlap.engine.sync moved to overlap.engine.source_values: import it from there "
    "(overlap.engine.sync is an alias for one release)",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _module
