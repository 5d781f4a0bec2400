"""First, on the CPU: the checks of test_triton_compile.py on this machine's Triton (the repo's ran
on another version; the environment records both torch's and Triton's), split over
COMPILE_PROCESSES worker processes (helpers/compile_worker.py): every kernel variant lowered to a
cubin for sm_90 and sm_80, the PTX checks (no fused multiply-add, no flush-to-zero, 16-byte
vectors, the fused count's atomic). The same workers then warm Triton's cache with the numerics
part's launches ([Note: warm Triton cache] in helpers/compile_worker.py). CUDA only (CI runs the
file itself)."""

from __future__ import annotations

import pytest
import torch

from .helpers.compile_worker import compile_in_processes
from .helpers.report import PartRecord
from .parts import PARTS

pytestmark = pytest.mark.cuda


@pytest.mark.part("compile")
def test_compile(device: torch.device, record: PartRecord, request: pytest.FixtureRequest) -> None:
    triton = pytest.importorskip("triton", reason="triton is not installed")
    record.bar = "every compile check of test_triton_compile.py passes on this Triton (warm-up reported)"
    timeout = request.node.get_closest_marker("timeout")  # the part's budget (conftest.py)
    budget_s = timeout.args[0] if timeout else PARTS["compile"].budget_s
    measured = {
        "triton": triton.__version__,
        **compile_in_processes("cuda" if device.type == "cuda" else "none", budget_s),
    }
    record.progress(measured)
    assert measured["all_exited_0"] and measured["checks_passed"] > 0, list(measured["checks_failed"])[:10]
