"""torchtitan's own Trainer with FSDP2 and with overlap as the data-parallel step, on CPU/gloo.

Each test module starts one world of fresh processes (torchrun's way: torchtitan initializes the
process group itself) and runs every case of the module in it, one Trainer after another; the
tests then compare what the runs logged. The CPU shims torchtitan needs live here
(titan_shims.py), applied to both implementations alike; the package has none of them.
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from titan_launch import WORLD_TIMEOUT_S, run_world


@pytest.fixture(scope="module")
def results(request):
    """The module's `RUNS`, run once on a fresh world of `WORLD_SIZE` ranks: per rank, what each
    run logged."""
    return run_world(request.module.WORLD_SIZE, request.module.RUNS, timeout_s=WORLD_TIMEOUT_S)
