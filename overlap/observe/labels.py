"""Profiler labels of the engine's phases: `record_function("overlap::<verb> <what>")`."""

from __future__ import annotations

import contextlib

import torch.autograd.profiler as _profiler
from torch.profiler import record_function

_NO_LABEL = contextlib.nullcontext()


def phase(verb: str, what: str) -> contextlib.AbstractContextManager:
    """`record_function("overlap::<verb> <what>")` while a profiler records (tests, benchmarks and
    `overlap report` find phases by these labels); nothing otherwise, since entering a
    record_function costs microseconds per call and the hooks run several per unit and step."""
    if _profiler._is_profiler_enabled:  # a module global, set by every torch profiler
        return record_function(f"overlap::{verb} {what}")
    return _NO_LABEL
