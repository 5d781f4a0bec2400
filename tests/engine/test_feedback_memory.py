"""What error feedback's float32 residual costs, said at wrap where it matters: on an accelerator,
`wrap` warns the bytes the residuals will take and the knob that shrinks them
(`error_feedback_dtype`), and changes nothing; on the CPU, or with a bf16 / int8 residual, it says
nothing. The bytes warned are checked against what a step then allocates (`memory_stats`), on two
gloo ranks: the warning is computed from the same sizes on any device, only shown off the CPU.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers.models import batch, loss_of, tiny_lm

import overlap
from overlap.compression.feedback import warn_residual_memory
from overlap.config import OverlapConfig

CUDA = torch.device("cuda")  # never allocated on: only its type is read


def test_warns_bytes_and_knob_on_an_accelerator():
    with pytest.warns(UserWarning, match="error_feedback_dtype=torch.bfloat16") as caught:
        message = warn_residual_memory(torch.float32, 8, 875_000_000, CUDA)
    assert message is not None and str(caught[0].message) == message
    assert f"({7 * 875_000_000 * 4} bytes)" in message, message  # a 7B model at 8 ranks: 24.5 GB


@pytest.mark.parametrize(
    "dtype, world_size, device",
    [
        (torch.bfloat16, 8, CUDA),
        (torch.int8, 8, CUDA),
        (None, 8, CUDA),
        (torch.float32, 8, torch.device("cpu")),
        (torch.float32, 1, CUDA),
    ],
    ids=["bf16", "int8", "off", "cpu", "one-rank"],
)
def test_silent_where_nothing_is_at_stake(dtype, world_size, device):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_residual_memory(dtype, world_size, 1 << 20, device) is None


def check_warned_bytes(rank: int, world_size: int) -> dict:
    """Wrap int8 + float32 feedback on the CPU: no warning; the same sizes on an accelerator
    would warn the residual bytes one step then holds."""
    import overlap.engine.state as state_module

    seen: list[tuple] = []
    real = state_module.warn_residual_memory
    state_module.warn_residual_memory = lambda *args: seen.append(args) or real(*args)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            config = OverlapConfig(grad_compression="int8", error_feedback=True)
            model = overlap.wrap(tiny_lm(), config=config)
    finally:
        state_module.warn_residual_memory = real
    loss_of(model(batch(model, rank, 0))).backward()
    held = overlap.memory_stats(model).bytes["residuals"]
    ((dtype, size, shard_numel, device),) = seen
    with pytest.warns(UserWarning) as on_accelerator:
        real(dtype, size, shard_numel, CUDA)
    warned = int(str(on_accelerator[0].message).split("(")[1].split(" bytes")[0])
    return {
        "cpu warnings": [str(w.message) for w in caught if "error feedback" in str(w.message)],
        "device": device.type,
        "warned": warned,
        "held": held,
    }


def test_warned_bytes_match_what_a_step_holds(world2):
    for rank, got in enumerate(world2.run(check_warned_bytes, timeout_s=120)):
        assert got["cpu warnings"] == [] and got["device"] == "cpu", (rank, got)
        assert got["warned"] == got["held"] > 0, (rank, got)  # every unit trains: "up to" is exact
