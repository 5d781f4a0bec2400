"""The symmetric-memory all-gather (overlap/transport/symm_mem.py) on NCCL at world size 1
(OVERLAP_FORCE_COLLECTIVES=1: real collectives): every all-gather's output comes from torch's
symmetric-memory pool, and training gives the default all-gather's losses bitwise. CUDA only: on
the CPU the setting is ignored with a warning (tests/engine/test_seam_symm_mem.py)."""

from __future__ import annotations

import pytest
import torch

from .helpers.common import STEPS, Sizes, make_input, synchronize, train_step, wrapped
from .helpers.report import PartRecord

pytestmark = pytest.mark.cuda


@pytest.mark.part("symm_mem")
@pytest.mark.usefixtures("world1")
def test_symm_mem(device: torch.device, sizes: Sizes, record: PartRecord) -> None:
    record.bar = "symmetric_memory=True: a SymmMemAllGather, and the default all-gather's losses bitwise"
    x = make_input(sizes, device)
    losses = {}
    for setting in (False, True):
        torch.manual_seed(0)
        model, opt = wrapped(sizes, device, symmetric_memory=setting)
        strategy = type(model._overlap_state.runtime.transport.all_gather).__name__
        losses[setting] = torch.stack([train_step(model, opt, x) for _ in range(STEPS)]).tolist()
        synchronize(device)
        record.progress({f"all_gather symmetric_memory={setting}": strategy, f"losses {setting}": losses[setting]})
    assert strategy == "SymmMemAllGather", strategy
    assert losses[True] == losses[False], losses
