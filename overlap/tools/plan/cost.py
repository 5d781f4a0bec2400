"""Moved to `overlap.step_model.cost` (the step model sits below the engine, which proposes with
it); this path is that module, kept for one release."""

from overlap.step_model import cost as _module
from overlap.tools.moved import alias_module

alias_module(__name__, _module)
