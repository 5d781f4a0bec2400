"""Renamed `overlap.engine.late_checks` (the checks a step reports late, read before a checkpoint,
an export and at exit); this path is that module, kept for one release."""

import sys
import warnings

from overlap.engine import late_checks as _module

warnings.warn(
    "overlap.engine.deferred moved to overlap.engine.late_checks: import it from there "
    "(overlap.engine.deferred is an alias for one release)",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _module
