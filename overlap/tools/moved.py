"""Old import paths of modules that moved, kept for one release: an old module is the new
module object itself (as `overlap.comm` is), and importing it by the old path warns once."""

from __future__ import annotations

import sys
import warnings
from types import ModuleType


def warn_moved(old_name: str, new_name: str, stacklevel: int = 3) -> None:
    """The DeprecationWarning of importing `old_name`, called from that module's body: it points
    at the line that imports it (`warnings` skips the import machinery's frames)."""
    warnings.warn(
        f"{old_name} moved to {new_name}: import it from there ({old_name} is an alias for one release)",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def alias_module(old_name: str, module: ModuleType) -> None:
    """Make `old_name` (the module being imported) the same object as `module`, with a warning."""
    warn_moved(old_name, module.__name__, stacklevel=4)
    sys.modules[old_name] = module
