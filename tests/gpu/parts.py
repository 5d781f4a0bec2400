"""The parts of the GPU check, in the order they run, with their time budgets.

A part is one test in tests/gpu, marked `@pytest.mark.part(name)`. The order is what each part
proves per second, with two constraints: `compile` first (it warms Triton's cache for
`numerics`: [Note: warm Triton cache] in helpers/compile_worker.py) and `memory` after the
worlds (it reads their measurements). This module imports nothing heavy: the runner reads it.
"""

from __future__ import annotations

from typing import NamedTuple


class PartSpec(NamedTuple):
    budget_s: float  # on a GPU; the dry run gets CPU_BUDGET_SCALE x this
    cuda_only: bool = False  # nothing to dry-run on the CPU


PARTS: dict[str, PartSpec] = {
    "compile": PartSpec(45, cuda_only=True),  # first: the compile checks, and the numerics kernels warmed
    "numerics": PartSpec(25),  # warm: ~180 cases, each a launch and a CPU reference
    "world2": PartSpec(30),
    "hsdp2x2": PartSpec(22),
    "world3": PartSpec(18),
    "tp2x2": PartSpec(20),
    "memory": PartSpec(5),  # the worlds' own measurements: no run
    "autotune": PartSpec(15),
    "nccl_path": PartSpec(8),
    "sync_free": PartSpec(15, cuda_only=True),
    "overlap": PartSpec(12, cuda_only=True),
    "parity": PartSpec(7),
    "symm_mem": PartSpec(6, cuda_only=True),  # the symmetric-memory all-gather: never run before
    "bandwidth": PartSpec(12),
}
ENV = {"OVERLAP_FORCE_COLLECTIVES": "1", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
"""Set while the parts run, before CUDA initializes: world size 1 issues real collectives (the NCCL
path on one GPU), cuBLAS is deterministic (the parity and the worlds are bitwise)."""
TOTAL_BUDGET_S = 240.0  # the budgets above add up to it; a part never runs past what is left of it
GRACE_S = 30.0  # a part this far past its budget is stuck (in a C++ call, where its timeout cannot reach)
WATCHDOG_S = TOTAL_BUDGET_S + GRACE_S  # the runner ends a run that lasts longer, or a stuck part
CPU_BUDGET_SCALE = 2.0  # the dry run: the budgets are the GPU's, CI machines are slower and shared
MIN_BUDGET_S = 5.0  # a part with less left than this is skipped ("out of time")
