"""What every part uses: the sizes, the models, one training step, determinism, bitwise
comparison of state dicts, and patching a function for a while."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import overlap

STEPS = 3  # steps per measurement after warm-up
TIMED_STEPS = 5
LR = 0.05
FP32, BF16, FP16 = torch.float32, torch.bfloat16, torch.float16
FLOATS = (FP32, BF16, FP16)
SHORT = {FP32: "f32", BF16: "bf16", FP16: "f16"}
FORMATS = [(8, "int", 256), (4, "int", 128), (8, "fp8", 256)]  # (bits, fmt, the codec's default block)


@dataclass(frozen=True)
class Sizes:
    layers: int
    d: int
    heads: int
    ff: int
    batch: int
    seq: int


# ws=1 parts (a step long enough to time) and the worlds (every parameter a multiple of 64
# elements, so that the unsharded views are as aligned as separate tensors: cuBLAS may choose
# its algorithm by alignment, and the reference has separate tensors)
SIZES = {"cuda": Sizes(6, 1024, 16, 4096, 8, 256), "cpu": Sizes(2, 32, 2, 64, 2, 8)}
WORLD_SIZES = {"cuda": Sizes(4, 256, 4, 1024, 4, 64), "cpu": Sizes(2, 32, 2, 64, 2, 8)}


def build_plain(sizes: Sizes, device: torch.device, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    layers = [
        nn.TransformerEncoderLayer(sizes.d, sizes.heads, sizes.ff, dropout=0.0, batch_first=True)
        for _ in range(sizes.layers)
    ]
    return nn.Sequential(*layers).to(device)


OVERFLOW_FACTOR = 1e4


class WorldNet(nn.Module):
    """The worlds' model: the layers, then `spare`, which only rank 0 uses (`uses_spare` set on
    each rank's copy), and `unused`, which no rank uses: a reduction whose used flags differ by
    rank (the host reads them back) and a parameter left without gradient everywhere. `probe`
    (one element, 0) is used only with `overflows` set: [Note: one shard overflows]."""

    def __init__(self, sizes: Sizes) -> None:
        super().__init__()
        self.layers = nn.Sequential(*build_plain(sizes, torch.device("cpu")))
        self.spare = nn.Linear(sizes.d, sizes.d)
        self.unused = nn.Linear(sizes.d, sizes.d)
        self.probe = nn.Parameter(torch.zeros(1))
        self.uses_spare = True
        self.overflows = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(x)
        x = x + self.spare(x) if self.uses_spare else x
        # [Note: one shard overflows]
        # probe is 0, so the output is unchanged; its gradient is OVERFLOW_FACTOR x the sum of the
        # output's gradient: under a loss scale, inf in fp16, in the one element of one rank's
        # shard, while every other gradient stays finite. The scaler's found-inf must reach every
        # rank: all skip the step (the same scale everywhere), or the ranks step apart.
        return x + self.probe * OVERFLOW_FACTOR if self.overflows else x


def build_world_model(sizes: Sizes, device: torch.device) -> WorldNet:
    torch.manual_seed(0)
    return WorldNet(sizes).to(device)


def make_input(sizes: Sizes, device: torch.device, batch: int | None = None, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch or sizes.batch, sizes.seq, sizes.d, generator=gen).to(device)


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
    """One step; returns the loss without reading it (no host sync here)."""
    loss = loss_of(model(x))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def optimizer_step(opt: torch.optim.Optimizer, scaler: Any, scales: list[float]) -> None:
    """`opt.step()`, or the scaler's step and update (skipped on every rank or on none: [Note:
    found-inf across ranks] in overlap/amp.py) with its scale after it appended to `scales`."""
    if scaler is None:
        opt.step()
    else:
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    opt.zero_grad(set_to_none=True)


def wrapped(sizes: Sizes, device: torch.device, **overrides: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = overlap.wrap(build_plain(sizes, device), **overrides)
    return model, torch.optim.SGD(model.parameters(), lr=LR)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def deterministic(device: torch.device) -> contextlib.ExitStack:
    """Deterministic algorithms (warn only) and, on CUDA, the math SDPA backend."""
    stack = contextlib.ExitStack()
    torch.use_deterministic_algorithms(True, warn_only=True)
    stack.callback(torch.use_deterministic_algorithms, False)
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        stack.enter_context(sdpa_kernel(SDPBackend.MATH))
    return stack


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        ints = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[a.element_size()]
        return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))
    return torch.equal(a, b)


def worst_difference(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Which tensors differ in their bits, and the largest absolute difference by name."""
    differing = [k for k in want if k not in got or not same_bits(got[k], want[k])]
    worst_name, worst = None, 0.0
    for k in differing:
        if k in got and got[k].shape == want[k].shape:
            d = (got[k].double() - want[k].double()).abs().max().item() if want[k].numel() else 0.0
            if not d <= worst:  # NaN counts as worst
                worst_name, worst = k, d
    return {"bitwise": not differing, "differing": differing[:8], "num_differing": len(differing),
            "worst_tensor": worst_name, "worst_abs_diff": worst}  # fmt: skip


def close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rtol: float = 1e-5, atol: float = 1e-6) -> bool:
    """Every tensor within fp32 rounding of a reordered sum (3 ranks: the collective's order is
    the backend's, not the reference's)."""
    return set(got) == set(want) and all(torch.allclose(got[k].double(), want[k].double(), rtol, atol) for k in want)


def sleep_cycles_per_ms() -> float:
    cycles = 10_000_000
    torch.cuda._sleep(cycles)  # warm-up
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / begin.elapsed_time(end)


@contextlib.contextmanager
def patched(patches: list[tuple[Any, str, Callable[[Callable[..., Any]], Any]]]) -> Iterator[None]:
    """Replace each `obj.name` (where it exists) by `wrap(original)`, and put them back."""
    originals = []
    try:
        for obj, name, wrap in patches:
            if hasattr(obj, name):
                original = getattr(obj, name)
                originals.append((obj, name, original))
                setattr(obj, name, wrap(original))
        yield
    finally:
        for obj, name, original in reversed(originals):
            setattr(obj, name, original)
