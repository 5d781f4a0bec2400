"""Moved to `overlap.step_model.calibration` (the step model sits below the engine, which
proposes with it); this path reads that module's names, kept for one release.

One name keeps its old form here: `default_world_calibration` took the `--link` text, where the
model's takes the link parsed (`overlap.tools.worlds.link.LinkSpec`).
"""

from __future__ import annotations

from typing import Any

from overlap.step_model import calibration as _module
from overlap.tools.moved import warn_moved
from overlap.tools.worlds.link import LinkSpec

warn_moved(__name__, _module.__name__)


def default_world_calibration(
    num_ranks: int, backend: str, link: str | None = None, **kwargs: Any
) -> _module.Calibration:
    """`overlap.step_model.calibration.default_world_calibration` with `link` as `--link` text."""
    return _module.default_world_calibration(
        num_ranks, backend, None if link is None else LinkSpec.parse(link), **kwargs
    )


def __getattr__(name: str) -> Any:
    return getattr(_module, name)
