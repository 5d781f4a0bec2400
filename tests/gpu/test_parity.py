"""overlap.wrap against the plain model, 3 SGD steps (not AdamW: its first update is +-lr for
gradients near 0, so rounding flips signs), deterministic algorithms, math SDPA."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import overlap

from .helpers.common import (
    LR,
    STEPS,
    Sizes,
    build_plain,
    deterministic,
    make_input,
    same_bits,
    train_step,
    worst_difference,
)
from .helpers.report import PartRecord

pytestmark = pytest.mark.cuda


@pytest.mark.part("parity")
@pytest.mark.usefixtures("world1")
def test_parity(device: torch.device, sizes: Sizes, record: PartRecord) -> None:
    record.bar = f"bitwise losses and parameters after {STEPS} SGD steps (else: the worst tensor by name)"
    plain = build_plain(sizes, device)
    ours = overlap.wrap(copy.deepcopy(plain))
    opts = [torch.optim.SGD(m.parameters(), lr=LR, foreach=False) for m in (plain, ours)]
    x = make_input(sizes, device)
    losses: list[tuple[torch.Tensor, torch.Tensor]] = []
    with warnings.catch_warnings(record=True) as caught, deterministic(device):
        warnings.simplefilter("always")
        for _ in range(STEPS):
            losses.append((train_step(plain, opts[0], x), train_step(ours, opts[1], x)))
    full = overlap.full_state_dict(ours)
    params = worst_difference({k: v.cpu() for k, v in full.items()},
                              {k: v.detach().cpu() for k, v in plain.state_dict().items()})  # fmt: skip
    losses_bitwise = all(same_bits(a, b) for a, b in losses)
    nondeterministic = sorted({str(w.message)[:160] for w in caught if "determinis" in str(w.message)})
    measured = {"bitwise": losses_bitwise and params["bitwise"], "losses_bitwise": losses_bitwise, "params": params,
                "losses": [(a.item(), b.item()) for a, b in losses], "nondeterministic_op_warnings": nondeterministic}  # fmt: skip
    record.progress(measured)
    assert measured["bitwise"], f"worst tensor {params['worst_tensor']}: {params['worst_abs_diff']}"
