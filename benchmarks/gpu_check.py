"""What one GPU can prove about the CUDA path in about 4 minutes; `--device cpu` dry-runs it.

On a machine with one CUDA GPU (README "What has run on a GPU"):

    PYTHONUNBUFFERED=1 timeout 420 python3 benchmarks/gpu_check.py --out gpu_check.json 2>&1 | tee gpu_check.log

Dry run (CI, tests/test_gpu_check.py), and a subset of parts:

    python benchmarks/gpu_check.py --device cpu --out /tmp/gpu_check.json
    python benchmarks/gpu_check.py --only numerics,world2

The JSON at `--out` holds the environment (torch, Triton, CUDA, NCCL, driver, GPU, the private
torch APIs tensor and expert parallelism use) and one entry
per part, written before the part starts (status "running") and rewritten whenever the part has
something new (a numerics case, a world's config, a bandwidth row) and when it ends, so a run cut
short by a part's budget, the watchdog or `timeout` keeps everything measured until then. Each part
has a budget (all together 240 s; the dry run twice each); one that raises or overruns records the error and the run goes
on; a watchdog ends the process 30 s past the whole budget. Entry: {"part", "status", "bar",
"measured", "seconds", "budget_s"}; status is "passed" / "failed" (held to its bar), "measured"
(no bar on this device), "skipped: why", "error" (with a traceback) or "running" (cut short).
Exit code 1 if any part errored, else 0: a failed bar is a result, not a crash.

The dry run runs every part it can on the CPU: the Triton kernels under Triton's interpreter
(TRITON_INTERPRET=1, set below before overlap is imported), the worlds on gloo with CPU tensors
(the delays are `time.sleep`), the world-size-1 parts on gloo, the bandwidth rows at a tiny size.

Parts, in order of what they prove per second:
  compile    first, on the CPU: the checks of tests/test_triton_compile.py on this machine's Triton
             (the repo's ran on another version; the environment records both torch's and
             Triton's), driven by benchmarks/gpu_compile.py (no pytest needed), split over
             COMPILE_PROCESSES processes: every kernel variant lowered to a cubin for sm_90 and
             sm_80, the PTX checks (no fused multiply-add, no flush-to-zero, 16-byte vectors, the
             fused count's atomic). The same processes then warm Triton's cache with the numerics
             part's launches ([Note: warm Triton cache] in gpu_compile.py). Bar: every check passes
             in every process. Run on a CUDA machine only (CI runs the file itself).
  numerics   every Triton kernel variant on the device against the torch reference on the CPU:
             quantize {int8, int4, fp8} x {nearest, stochastic (int)} x input {fp32, bf16, fp16};
             dequantize(-accumulate) x output {fp32, bf16, fp16}; error feedback (fp32 and int8
             residual); a bucket's rows in one launch (encode with each residual, the count,
             the decode-sum); inputs with zero, denormal, NaN and +-Inf blocks and a partial last block;
             copy-out / copy-in on the runtime's own layouts at world size 1 (untagged), 2 and 8
             (tagged) for every pair of fp32/bf16/fp16, with which copy variant (aligned or not)
             each layout gets. Each case records bitwise (NaN payloads aside), the bits exactly,
             mismatches and the largest distance in units in the last place. Bar: every case
             bitwise (NaN equal to NaN; a tag copied with its exact bits). Reports the kernels it
             still compiled (`triton_cache_new_entries`: 0 when the compile part warmed them all).
  world2     2 ranks spawned on the one GPU over gloo with CUDA tensors, so the runtime's streams
             and events move real data between ranks (gloo's CUDA work copies on its own streams),
             with reduce_scatter_impl / all_gather_impl "native" (the NCCL-shaped path: tags, the
             tagged copy-out, the CUDA fingerprint branch, division, used flags). The model has a
             parameter only rank 0 uses (used flags that differ by rank, read back on the host)
             and one no rank uses. Configs: plain fp32, bf16 params with no_sync micro-batches,
             int8 gradients + error feedback, int8 params (the encoded exchanges: all-to-all),
             fp16 with the ShardedGradScaler and an overflow in one rank's shard ([Note: one
             shard overflows]: every rank skips the step, the same scale everywhere);
             strict ZeRO-3 (backward gathers); SGD. Each config runs twice, the second time
             with delays injected ([Note: injected delays]); bar: the two runs bitwise equal on
             every rank, delays were injected, and plain fp32 bitwise equal to a one-process
             reference (both ranks' half-batches on the unsharded model, gradients summed in rank
             order and divided by 2, SGD). A probe first runs gloo's native reduce-scatter and
             all-gather on the device's tensors; one gloo refuses is replaced by "all_to_all" for
             every config, and the refusal is recorded (`probe`). Rank 0 records the copies the
             runtime issued in its first plain step with their Triton launch variants
             (`copy_plans`), and whether their row strides are the ones runtime_copy_out_layout /
             runtime_copy_in_layout give (`layout_mirror`: numerics and bandwidth use those).
  hsdp2x2    the same on 4 ranks as a 2x2 mesh (replicate x shard): the all-reduce stream too; the
             reference sums (g0 + g1) + (g2 + g3) and divides by 4, as the shard pairs and the
             all-reduce do.
  world3     3 ranks (a middle rank in every all-to-all, a non-power-of-two average): plain,
             int8 gradients + error feedback, fp16 with the scaler; plain within fp32 rounding of
             the reference (the backend's summation order is not the reference's).
  tp2x2, memory, autotune: benchmarks/gpu_worlds.py (dp x tp against one process; the worlds'
             allocator peaks against what is accounted; autotune under a tight memory cap).
  nccl_path  world size 1 on NCCL (OVERLAP_FORCE_COLLECTIVES=1 makes it issue real collectives):
             the c10d collectives per step under torch.profiler (and the NCCL kernels CUPTI saw).
  sync_free  steps 2-3 under torch.cuda.set_sync_debug_mode("warn") for plain, strict ZeRO-3,
             bucketed, int8 + error feedback and int8 params; also counts and times
             torch.cuda.Event.synchronize, which sync debug mode does not see. Bar: 0 sync
             warnings per config (the event waits are reported). CUDA only.
  overlap    median step with the real (world size 1) collectives, then with a stand-in
             torch.cuda._sleep before each collective adding up to half the step. Bar: hidden
             share >= 0.5. CUDA only.
  parity     overlap.wrap against the plain model, 3 SGD steps (not AdamW: its first update is
             +-lr for gradients near 0, so rounding flips signs), deterministic algorithms, math
             SDPA. Bar: bitwise; else the worst tensor by name.
  bandwidth  GB/s of every Triton kernel (and the torch reference) at 8M and 64M elements as a
             share of a device-to-device fp32 copy, a compressed reduce-scatter's codec work on
             one 8-rank bucket (one launch each against the per-row launches of before), the
             copies on the runtime's tagged layouts of
             a GPT block at world size 2 and 8; each row written as soon as it is measured. Bar:
             every Triton row at the largest size >= 0.8 of the copy. CPU: measured, no bar.
Peak memory against FSDP2 is not a part (at world size 1 it says little about sharding at
scale): `overlap bench memory --device cuda` measures it.

[Note: injected delays]
The second run of each world config wraps the runtime's collectives and waits: a delay before each
collective is issued (on the comm stream it is issued from), one after each wait on a collective
(on that comm stream, before its copy-out or decode), and one on the compute stream before each
Free and ReleaseReduce. On CUDA a delay is `torch.cuda._sleep` of 0.05, 0.3 or 1.5 ms (drawn from
a seeded generator per rank), so a missing stream wait or event lets a reader see data that is not
there yet, and the run differs from the undelayed one; on CPU it is `time.sleep`, which tests the
bookkeeping only. The count of each kind is reported: a run with none proves nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import gc
import importlib.util
import json
import multiprocessing
import os
import platform
import queue
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's `overlap`, installed or not
sys.path.insert(0, str(REPO / "benchmarks"))  # its sibling modules (gpu_worlds, gpu_compile)
# [Note: one gpu_check module]
# The sibling modules import `gpu_check` for its helpers; run as a script (or preloaded in the
# ranks' server) this module is `__main__`: they must get this one, not a second copy.
if __name__ in ("__main__", "__mp_main__"):
    sys.modules.setdefault("gpu_check", sys.modules[__name__])


def _wants_cpu(argv: list[str]) -> bool:
    for i, arg in enumerate(argv):
        if arg == "--device" and i + 1 < len(argv):
            return argv[i + 1] == "cpu"
        if arg.startswith("--device="):
            return arg.split("=", 1)[1] == "cpu"
    import torch

    return not torch.cuda.is_available()


# The dry run launches the Triton kernels under Triton's interpreter: triton reads the variable
# when a kernel is defined, i.e. when overlap is first imported below.
if __name__ == "__main__" and _wants_cpu(sys.argv[1:]):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.distributed as dist
from torch import nn

import overlap
import overlap.kernels as okernels
from overlap.kernels import (
    copy_in,
    copy_in_ref,
    copy_out,
    copy_out_ref,
    dequantize_blockwise,
    dequantize_blockwise_ref,
    num_blocks_for,
    quantize_blockwise,
    quantize_blockwise_ref,
    quantize_feedback_blockwise,
    quantize_feedback_int8res_blockwise,
    select_backend,
    select_copy_backend,
)

# =================================================================================================
# INTERNALS: the only imports of overlap's private modules (docs/architecture.md says where each
# lives); a move of the engine's modules changes these lines and nothing else here.
# isort: split
# the collectives and their wait ([Note: injected delays], part overlap); Free / ReleaseReduce
from overlap.engine.reduction import Reductions as _Reductions
from overlap.engine.reduction import flag_cols  # the padded used-flag columns of a reduction row
from overlap.engine.runtime import Runtime as _Runtime
from overlap.engine.units import CHUNK_ALIGN_NUMEL, ParamInfo, UnitLayout, make_layout
from overlap.kernels import triton_kernels
from overlap.kernels.reference import code_numel
from overlap.kernels.rows import decode_sum_rows, encode_rows, encode_rows_loop
from overlap.kernels.triton_copy import (  # which copy variant a layout gets
    _plan,
    _segments,
)
from overlap.transport import coded as _coded
from overlap.transport import collectives as _comm
from overlap.transport.fingerprint import TAG_NUMEL  # the tag slot after each gathered row


def runtime_copy_out_layout(layout: UnitLayout, n: int) -> tuple[list[int], list[int], int]:
    """(sizes, data_cols, tag columns) of the runtime's copy-out of `layout` gathered over `n`
    ranks: per parameter its padded chunk and its data columns, then the tag slot each rank's row
    ends in (tagged at world size > 1). Mirrors Runtime._copy_out: keep in step with it."""
    tag = TAG_NUMEL if n > 1 else 0
    sizes = [n * s.padded_chunk_numel for s in layout.slots] + ([n * tag] if tag else [])
    cols = [s.chunk_numel for s in layout.slots] + ([tag] if tag else [])
    return sizes, cols, tag


def runtime_copy_in_layout(layout: UnitLayout, n: int) -> tuple[list[int], list[int]]:
    """(sizes, data_cols) of the runtime's gradient copy-in of `layout` over `n` ranks (no codec):
    per trainable parameter its padded chunk, then the used-flag column of each parameter, padded
    to the chunk alignment. Mirrors Reductions.reduce: keep in step with it."""
    slots = layout.grad_slots
    sizes = [n * s.padded_chunk_numel for s in slots] + [n * flag_cols(len(slots))]
    return sizes, [s.chunk_numel for s in slots] + [len(slots)]


# isort: split
# =================================================================================================

TOTAL_BUDGET_S = 240.0
WATCHDOG_S = TOTAL_BUDGET_S + 30.0
CPU_BUDGET_SCALE = 2.0  # the dry run: the budgets are the GPU's, CI machines are slower and shared
ENV = {"OVERLAP_FORCE_COLLECTIVES": "1", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
SHARE_BAR = 0.8
HIDDEN_BAR = 0.5
STEPS = 3  # steps per measurement after warm-up
TIMED_STEPS = 5
LR = 0.05
DELAYS_MS = (0.05, 0.3, 1.5)  # [Note: injected delays]
WORLD_TIMEOUT_S = 30  # each collective of a spawned world
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
WORLD_CONFIGS: dict[str, dict[str, Any]] = {
    "plain": {},
    "bf16_no_sync": {"param_dtype": "bfloat16", "reduce_dtype": "float32", "micro_batches": 2},
    "int8_grads_ef": {"grad_compression": "int8", "error_feedback": True},
    "int8_params": {"param_compression": "int8"},
    # reduce in fp16 too; an overflow in one rank's shard ([Note: one shard overflows]): every rank skips
    "fp16_scaler": {"param_dtype": "float16", "scaler": True, "overflow_one_shard": True},
}
WORLD3_CONFIGS = {k: WORLD_CONFIGS[k] for k in ("plain", "int8_grads_ef", "fp16_scaler")}  # a middle rank


class PartTimeout(Exception):
    pass


@dataclass
class Check:
    """What every part gets: the device, the sizes, and `progress` to publish partial results."""

    device: torch.device
    sizes: Sizes
    out: Path
    report: dict[str, Any] = field(default_factory=lambda: {"environment": {}, "parts": []})
    entry: dict[str, Any] | None = None  # the part running now

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def progress(self, measured: dict[str, Any]) -> None:
        """The running part's results so far, on disk now (a timeout keeps them)."""
        if self.entry is not None:
            self.entry["measured"] = measured
            write_report(self.out, self.report)


PartResult = tuple[str, str, dict[str, Any]]


# ---------------------------------------------------------------------------------------------
# shared pieces


def build_plain(sizes: Sizes, device: torch.device, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    layers = [
        nn.TransformerEncoderLayer(sizes.d, sizes.heads, sizes.ff, dropout=0.0, batch_first=True)
        for _ in range(sizes.layers)
    ]
    return nn.Sequential(*layers).to(device)


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


OVERFLOW_FACTOR = 1e4


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


def wrapped(c: Check, **overrides: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = overlap.wrap(build_plain(c.sizes, c.device), **overrides)
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


def patched_comm(wrap_fn: Callable[[Callable[..., Any]], Callable[..., Any]]) -> contextlib.AbstractContextManager:
    """overlap's two plain collectives replaced by `wrap_fn(original)` (the runtime calls them
    through the module)."""
    return patched([(_comm, n, wrap_fn) for n in ("all_gather_flat", "reduce_scatter_flat")])


COLLECTIVES = ((_comm, "all_gather_flat"), (_comm, "reduce_scatter_flat"), (_comm, "all_reduce_flat"),
               (_coded, "all_gather_encoded"), (_coded, "reduce_scatter_encoded"))


@contextlib.contextmanager
def injected_delays(device: torch.device, counts: Counter, seed: int) -> Iterator[None]:
    """[Note: injected delays]; `counts` gets the number of each kind."""
    rng = random.Random(seed)
    if device.type == "cuda":
        per_ms = sleep_cycles_per_ms()

        def delay() -> None:
            torch.cuda._sleep(int(rng.choice(DELAYS_MS) * per_ms))  # on the current stream
    else:

        def delay() -> None:
            time.sleep(rng.choice(DELAYS_MS) / 1e3)

    def before(kind: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
            def call(*a: Any, **k: Any) -> Any:
                counts[kind] += 1
                delay()
                return fn(*a, **k)

            return call

        return wrap

    def after_wait(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(result: Any, timeout: Any = None) -> Any:
            if result.work is not None:
                result.work.wait() if timeout is None else result.work.wait(timeout)
                counts["after_wait"] += 1
                delay()  # on the comm stream, before copy-out / decode (`finish`)
                result = result._replace(work=None)
            return fn(result, timeout)

        return call

    patches: list[tuple[Any, str, Any]] = [(module, n, before("before_collective")) for module, n in COLLECTIVES]
    patches += [(_comm, "wait", after_wait), (_Runtime, "free", before("before_free")),
                (_Reductions, "release_reduce", before("before_release_reduce"))]  # fmt: skip
    with patched(patches):
        yield


# ---------------------------------------------------------------------------------------------
# numerics: the comparison


_INT_VIEW = {FP32: (torch.int32, 0x7FFFFFFF), BF16: (torch.int16, 0x7FFF), FP16: (torch.int16, 0x7FFF)}


def compare(got: torch.Tensor, want: torch.Tensor) -> dict[str, Any]:
    """How `got` (any device) differs from `want` (the reference): bitwise with any NaN equal to
    any NaN, the exact bits, elements that differ, and for floats the largest distance in units in
    the last place (-0.0 and +0.0 one apart) and NaN where the other is not (`nan_mismatches`)."""
    got = got.detach().reshape(-1).cpu()
    want = want.detach().reshape(-1).cpu()
    if got.shape != want.shape or got.dtype != want.dtype:
        return {"bitwise": False, "error": f"{got.dtype} {tuple(got.shape)} vs {want.dtype} {tuple(want.shape)}"}
    if want.dtype not in _INT_VIEW:
        differ = got != want
        out: dict[str, Any] = {"bitwise": not bool(differ.any()), "mismatches": int(differ.sum())}
        if want.dtype == torch.int8 and out["mismatches"]:
            out["max_code_diff"] = int((got.int() - want.int()).abs().max())
        return out
    itype, mask = _INT_VIEW[want.dtype]
    gi, wi = got.view(itype).long(), want.view(itype).long()
    gnan, wnan = got.isnan(), want.isnan()
    differ = (gi != wi) & ~(gnan & wnan)
    nan_mismatches = int((gnan != wnan).sum())

    def ordered(i: torch.Tensor) -> torch.Tensor:
        mag = i & mask
        return torch.where(i < 0, -mag - 1, mag)

    finite_differ = differ & ~gnan & ~wnan
    ulps = (ordered(gi) - ordered(wi)).abs()[finite_differ]
    return {"bitwise": not bool(differ.any()), "exact_bits": torch.equal(gi, wi), "mismatches": int(differ.sum()),
            "max_ulp": int(ulps.max()) if ulps.numel() else 0, "nan_mismatches": nan_mismatches}  # fmt: skip


def classify(parts: dict[str, dict[str, Any]]) -> str:
    """A case from its tensors' comparisons: "bitwise", "within_1_ulp" (no NaN lost or made, every
    float within 1 ulp, every int8 code within 1) or "differs"."""
    if all(p.get("bitwise") for p in parts.values()):
        return "bitwise"
    close = all(
        "error" not in p and not p.get("nan_mismatches") and p.get("max_ulp", 0) <= 1 and p.get("max_code_diff", 0) <= 1
        and ("max_ulp" in p or "max_code_diff" in p or p.get("bitwise"))
        for p in parts.values()
    )  # fmt: skip
    return "within_1_ulp" if close else "differs"


def numerics_input(numel: int, block: int, dtype: torch.dtype, gen: torch.Generator, nonfinite: bool) -> torch.Tensor:
    """Magnitudes over many binades, zeros, a denormal; with `nonfinite`, NaN, +Inf and -Inf each
    in a block of its own, an all-zero block and a NaN in the (partial) last block."""
    x = torch.randn(numel, generator=gen) * torch.rand(numel, generator=gen).pow(6) * 100
    x[:: max(1, numel // 7)] = 0.0
    x[numel // 3] = 3e-41
    if nonfinite and num_blocks_for(numel, block) >= 6:
        x[block + 3] = float("nan")
        x[2 * block + 5] = float("inf")
        x[3 * block] = float("-inf")
        x[4 * block : 5 * block] = 0.0
        x[numel - 1] = float("nan")
    return x.to(dtype)


def numerics_layout(n: int) -> UnitLayout:
    """A unit of odd parameters laid out over `n` ranks as wrap does: padded chunks, a 1-element
    parameter, rows not divisible by `n`, a segment wider than one copy tile."""
    shapes = [(96, 33), (97,), (5, 7), (1,), (40, 64), (301,), (1500,)]
    params = [ParamInfo(f"p{i}", ((f"m{i}", "w"),), torch.Size(s), True) for i, s in enumerate(shapes)]
    return make_layout(0, "numerics", ("numerics",), params, n, CHUNK_ALIGN_NUMEL)


def block_layout(numel: int, n: int) -> UnitLayout:
    """One GPT block's parameters (~numel elements, d a multiple of 64) laid out over `n` ranks."""
    d = max(64, round((numel / 12) ** 0.5 / 64) * 64)
    shapes = [(3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,), (d,), (d,)]
    params = [ParamInfo(f"p{i}", ((f"m{i}", "w"),), torch.Size(s), True) for i, s in enumerate(shapes)]
    return make_layout(0, "block", ("block",), params, n, CHUNK_ALIGN_NUMEL)


def specials(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random values with NaN, +-Inf, -0.0 and a denormal sprinkled in (fp32, then cast)."""
    v = torch.randn(t.numel(), generator=gen) * 10
    for i, s in enumerate((float("nan"), float("inf"), float("-inf"), -0.0, 3e-41, 1e-40)):
        v[(i * 997 + 13) % max(1, v.numel())] = s
    return t.copy_(v.view(t.shape))


@dataclass
class CopyJob:
    """One copy-out or copy-in exactly as the runtime issues it. Copy-out writes views of one
    unsharded buffer (`owner`, at `spans`) and the tag slots; copy-in reads separate gradient
    tensors and the used flags. `to(device)` is the same job, copied, on `device`."""

    kind: str  # "out" | "in"
    flat: torch.Tensor
    tensors: list[torch.Tensor | None]
    sizes: list[int]
    cols: list[int]
    n: int
    owner: torch.Tensor | None = None  # copy-out: the unsharded buffer the outs are views of
    spans: list[tuple[int, int]] = field(default_factory=list)  # copy-out: (offset, numel) per view

    def to(self, device: torch.device) -> CopyJob:
        def moved(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, copy=True)

        if self.owner is None:
            return CopyJob(self.kind, moved(self.flat), [moved(t) for t in self.tensors], self.sizes, self.cols, self.n)  # type: ignore[arg-type]
        owner = moved(self.owner)
        assert owner is not None
        views: list[torch.Tensor | None] = [owner[o : o + k] for o, k in self.spans]
        extra = [moved(t) for t in self.tensors[len(self.spans) :]]
        return CopyJob(self.kind, moved(self.flat), views + extra, self.sizes, self.cols, self.n, owner, self.spans)  # type: ignore[arg-type]

    def run(self, backend: str) -> None:
        if self.kind == "out":
            copy_out(self.flat, self.tensors, sizes=self.sizes, data_cols=self.cols, num_rows=self.n, backend=backend)  # type: ignore[arg-type]
        else:
            copy_in(self.tensors, self.flat, sizes=self.sizes, data_cols=self.cols, num_rows=self.n, backend=backend)  # type: ignore[arg-type]

    def run_ref(self) -> None:
        if self.kind == "out":
            copy_out_ref(self.flat, self.tensors, self.sizes, self.n, self.cols)  # type: ignore[arg-type]
        else:
            copy_in_ref(self.tensors, self.flat, self.sizes, self.n, self.cols)

    def results(self) -> dict[str, torch.Tensor]:
        """What the copy wrote: the reduce buffer, or the unsharded buffer (padding included:
        nothing may write there) and the tags."""
        if self.kind == "in":
            return {"flat": self.flat}
        out = {"unsharded": self.owner if self.owner is not None else self.flat}
        if len(self.tensors) > len(self.spans):
            out["tags"] = self.tensors[-1]  # type: ignore[assignment]
        return out  # type: ignore[return-value]

    def moved_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [self.flat, *self.tensors] if t is not None)

    def plan(self) -> dict[str, Any]:
        """Which Triton copy launches this layout gets ([Note: copy alignment] in triton_copy.py)."""
        row_stride = self.flat.numel() // self.n
        segments = _segments(self.kind, self.tensors, self.sizes, self.cols, self.n)
        launches = _plan(self.kind, self.flat, self.tensors, segments, row_stride, self.n)
        return {"row_stride": row_stride, "row_stride_mod16": row_stride % 16, "segments": len(segments),
                "launches": [launch_plan(x) for x in launches]}  # fmt: skip


def launch_plan(launch: Any) -> dict[str, Any]:
    """One Triton copy launch: aligned (every segment on the vector branch), its tiles, and how
    many of its segments take the vector branch."""
    segments = int(getattr(launch, "num_segments", 1))
    aligned = int(getattr(launch, "num_aligned", segments if launch.aligned else 0))
    return {"aligned": bool(launch.aligned), "tiles": int(launch.num_tiles), "segments": segments, "aligned_segments": aligned}


def copy_job(kind: str, layout: UnitLayout, n: int, src: torch.dtype, dst: torch.dtype, gen: torch.Generator | None,
             unused: int | None = None, device: torch.device | str = "cpu") -> CopyJob:  # fmt: skip
    """The runtime's copy-out of `layout`'s gathered rows (dtype `src`) into the unsharded
    parameters (`dst`), or its copy-in of the gradients (`src`; parameter `unused` has none) into
    the reduce buffer (`dst`). Inputs drawn from `gen` with specials (None: left empty), outputs
    poisoned."""
    if kind == "out":
        sizes, cols, tag = runtime_copy_out_layout(layout, n)
        gathered = torch.empty(n, layout.shard_numel + tag, dtype=src, device=device)
        unsharded = torch.full((layout.unsharded_numel,), -7.0, dtype=dst, device=device)
        spans = [(s.unsharded_offset, n * s.chunk_numel) for s in layout.slots]
        outs: list[torch.Tensor | None] = [unsharded[o : o + k] for o, k in spans]
        if gen is not None:
            specials(gathered, gen)
        if tag:  # the tag slot keeps the gathered dtype (Runtime._copy_out); any bits, NaN patterns too
            if gen is not None:
                bits = torch.randint(-(2**62), 2**62, (n, tag * src.itemsize // 8), generator=gen)
                gathered[:, layout.shard_numel :] = bits.view(src).to(device)
            outs.append(torch.full((n * tag,), -7.0, dtype=src, device=device))
        return CopyJob("out", gathered.view(-1), outs, sizes, cols, n, unsharded, spans)
    sizes, cols = runtime_copy_in_layout(layout, n)
    grads: list[torch.Tensor | None] = []
    for i, s in enumerate(layout.grad_slots):
        g = None if i == unused else torch.empty(s.shape, dtype=src, device=device)
        if g is not None and gen is not None:
            specials(g, gen)
        grads.append(g)
    flags = torch.tensor([g is not None for g in grads], dtype=dst).repeat(n).to(device)
    full = torch.full((sum(sizes),), -7.0, dtype=dst, device=device)
    return CopyJob("in", full, [*grads, flags], sizes, cols, n)


# ---------------------------------------------------------------------------------------------
# parts: each returns (status, bar, measured)


COMPILE_PROCESSES = 14  # benchmarks/gpu_compile.py processes, each a share of the checks and of the warm-up
"""Measured cold on a loaded 2-core machine: a twelfth of the variants (both architectures) in
9 s; warming a case's kernel for sm_90 about 0.5 s. On 16 cores, 14 processes do the checks and
warm the numerics part's ~180 cases within the part's budget."""


def part_compile(c: Check, budget_s: float) -> PartResult:
    """On this machine's Triton, first: the compile checks of tests/test_triton_compile.py (the
    repo's ran on another version), then the numerics part's kernels warmed in the cache ([Note:
    warm Triton cache] in gpu_compile.py). Driven by benchmarks/gpu_compile.py, which needs no
    pytest; split over processes."""
    import triton

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))
    count = max(1, min(COMPILE_PROCESSES, (os.cpu_count() or 1)))
    base = [sys.executable, str(REPO / "benchmarks" / "gpu_compile.py"), "--warm", "cuda" if c.cuda else "none"]
    procs = []
    for index in range(count):  # shard 0 also runs the file's other checks
        procs.append(subprocess.Popen([*base, "--shard", f"{index}/{count}"], cwd=REPO, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))  # fmt: skip
    deadline = time.monotonic() + max(5.0, budget_s - 3)
    shards = []
    for index, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            rc, err = None, f"timed out after {budget_s - 3:.0f} s\n{err}"
        shards.append({"shard": f"{index}/{count}", "rc": rc, **compile_shard_result(out, err)})
    checks = [s.get("checks", {}) for s in shards]
    warmed = [s.get("warm", {}) for s in shards]
    measured = {
        "triton": triton.__version__, "cmd": " ".join(base[1:]), "processes": count,
        "checks_passed": sum(len(x.get("passed", [])) for x in checks),
        "checks_failed": {k: v for x in checks for k, v in x.get("failed", {}).items()},
        "checks_skipped": {k: v for x in checks for k, v in x.get("skipped", {}).items()},
        "warm_cases": sum(w.get("cases", 0) for w in warmed), "warm_compiled": sum(w.get("compiled", 0) for w in warmed),
        "warm_errors": {k: v for w in warmed for k, v in w.get("errors", {}).items()},
        "shards": shards,
    }  # fmt: skip
    passed = all(s["rc"] == 0 for s in shards) and measured["checks_passed"] > 0
    bar = "every compile check of tests/test_triton_compile.py passes on this Triton (warm-up reported)"
    return ("passed" if passed else "failed"), bar, measured


def compile_shard_result(out: str, err: str) -> dict[str, Any]:
    """A gpu_compile.py process's JSON line (its checks and warm-up), or what it printed instead."""
    for line in reversed(out.splitlines()):
        with contextlib.suppress(ValueError):
            result = json.loads(line)
            if isinstance(result, dict) and "checks" in result:
                return result
    return {"tail": (out + err)[-1500:]}


NumericsCase = tuple[int, str, Callable[[], dict[str, Any]]]  # (priority, name, the case)


def part_numerics(c: Check, _budget_s: float) -> PartResult:
    """Every Triton kernel variant on the device against the reference on the CPU."""
    dev = c.device
    interpreted = not c.cuda
    if importlib.util.find_spec("triton") is None:
        return "skipped: triton is not installed", "", {}
    measured: dict[str, Any] = {
        "kernels": "triton" + (" under TRITON_INTERPRET=1 on CPU tensors" if interpreted else f" on {dev}"),
        "reference": "the torch references (overlap.kernels.*_ref) on the CPU",
        "summary": {}, "plans": {}, "cases": {},
    }  # fmt: skip
    cases: dict[str, Any] = measured["cases"]
    since_write = [0]
    cache = triton_cache_entries()

    def run_case(name: str, fn: Callable[[], dict[str, Any]]) -> None:
        try:
            parts = fn()
            cases[name] = {"class": classify(parts), **parts}
        except PartTimeout:
            raise
        except Exception as e:  # noqa: BLE001  one case's crash is that case's result
            cases[name] = {"class": "error", "error": f"{type(e).__name__}: {str(e)[:300]}"}
        since_write[0] += 1
        if since_write[0] >= 12:
            since_write[0] = 0
            summarize()
            c.progress(measured)

    def summarize() -> None:
        by: dict[str, list[str]] = {}
        for name, r in cases.items():
            by.setdefault(r["class"], []).append(name)
        measured["summary"] = {"cases": len(cases), **{k: (len(v) if k == "bitwise" else v) for k, v in by.items()}}
        if not interpreted:  # [Note: warm Triton cache]: the kernels the compile part did not warm
            measured["triton_cache_new_entries"] = len(triton_cache_entries() - cache)

    pending, skipped = numerics_cases(dev, interpreted, measured["plans"])
    for _, name, fn in sorted(pending, key=lambda t: t[0]):
        run_case(name, fn)
    summarize()
    measured["skipped"] = skipped
    variants = {l["aligned"] for p in measured["plans"].values() for l in p["launches"]}
    measured["copy_variants_run"] = sorted("aligned" if v else "unaligned" for v in variants)
    ok = bool(cases) and all(r["class"] == "bitwise" for r in cases.values())
    bar = "every case bitwise against the CPU reference (any NaN equal to any NaN; tags exact)"
    return ("passed" if ok else "failed"), bar, measured


def triton_cache_entries() -> set[str]:
    """The entries of Triton's on-disk kernel cache, to count the compiles a part caused."""
    try:
        from triton import knobs

        folder = Path(knobs.cache.dir)
    except Exception:  # noqa: BLE001  an older Triton (or none): the default folder
        folder = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    return set(os.listdir(folder)) if folder.is_dir() else set()


def numerics_cases(dev: torch.device, interpreted: bool, plans: dict[str, Any]) -> tuple[list[NumericsCase], list[str]]:
    """The numerics part's cases in the order they are built, and what is skipped. The inputs
    come from one seeded generator, so every process builds the same cases with the same shapes:
    the compile part warms exactly these launches ([Note: warm Triton cache]). `plans` gets the
    Triton launches of each copy layout."""
    gen = torch.Generator().manual_seed(7)
    pending: list[NumericsCase] = []

    def case(name: str, fn: Callable[[], dict[str, Any]], priority: int = 0) -> None:
        """Queue a case: all of the first size first, then the copies, then the larger sizes (so
        that a cut-short run has compiled and checked every variant once)."""
        pending.append((priority, name, fn))

    # Sizes with a partial last block: first a multiple of 16 (Triton specializes integer arguments
    # on it, and the runtime's padded chunks are), then one that is not, then a larger one.
    numels = (lambda b: [5 * b + 48]) if interpreted else (lambda b: [5 * b + 48, 5 * b + 37, 1027 * b + 80])
    skipped = []
    for bits, fmt, block in FORMATS:
        fname = "fp8" if fmt == "fp8" else f"int{bits}"
        if fmt == "fp8" and interpreted:
            skipped.append(f"{fname}: the interpreter's fp32 -> fp8 cast is wrong (GPU only)")
            continue
        for numel in numels(block):
            later = 0 if numel == numels(block)[0] else 2
            for dtype in FLOATS:
                x = numerics_input(numel, block, dtype, gen, nonfinite=True)
                for stochastic in (False, True) if fmt == "int" else (False,):

                    def run_quantize(x: torch.Tensor = x, stochastic: bool = stochastic, bits: int = bits,
                                     fmt: str = fmt, block: int = block) -> dict[str, Any]:  # fmt: skip
                        xd = x.to(dev)
                        if not stochastic:
                            got = quantize_blockwise(xd, bits, block, fmt=fmt, backend="triton")  # type: ignore[arg-type]
                            want = quantize_blockwise_ref(x, bits, block, fmt=fmt)  # type: ignore[arg-type]
                        else:  # the same uniforms for both: quantize_blockwise draws num_blocks * block
                            got = quantize_blockwise(xd, bits, block, True, torch.Generator(dev).manual_seed(5),
                                                     backend="triton")  # fmt: skip
                            noise = torch.rand(num_blocks_for(x.numel(), block) * block,
                                               generator=torch.Generator(dev).manual_seed(5), device=dev)  # fmt: skip
                            want = quantize_blockwise_ref(x, bits, block, True, noise=noise.cpu())
                        return {"codes": compare(got[0], want[0]), "scales": compare(got[1], want[1])}

                    rounding = "sr" if stochastic else "rtn"
                    case(f"quantize {fname} {rounding} in={SHORT[dtype]} n={numel}", run_quantize, later)
            codes, scales = quantize_blockwise_ref(numerics_input(numel, block, FP32, gen, True), bits, block, fmt=fmt)  # type: ignore[arg-type]
            for out_dtype in FLOATS:
                base = (torch.randn(numel, generator=gen) * 3).to(out_dtype)
                for accumulate in (False, True):

                    def run_dequantize(codes: torch.Tensor = codes, scales: torch.Tensor = scales, base: torch.Tensor = base,
                                       accumulate: bool = accumulate, bits: int = bits, fmt: str = fmt,
                                       block: int = block, numel: int = numel) -> dict[str, Any]:  # fmt: skip
                        got = dequantize_blockwise(codes.to(dev), scales.to(dev), bits, block, numel, base.to(dev, copy=True),
                                                   accumulate, fmt=fmt, backend="triton")  # type: ignore[arg-type]  # fmt: skip
                        want = dequantize_blockwise_ref(codes, scales, bits, block, numel, base.clone(), accumulate, fmt)  # type: ignore[arg-type]
                        return {"out": compare(got, want)}

                    verb = "dequant_acc" if accumulate else "dequant"
                    case(f"{verb} {fname} out={SHORT[out_dtype]} n={numel}", run_dequantize, later)
        numel = numels(block)[0]
        for dtype in (FP32, BF16):
            x = numerics_input(numel, block, dtype, gen, nonfinite=False)
            residual = torch.randn(numel, generator=gen) * 0.01

            def run_feedback(x: torch.Tensor = x, residual: torch.Tensor = residual, bits: int = bits, fmt: str = fmt,
                             block: int = block) -> dict[str, Any]:  # fmt: skip
                r_dev, r_ref = residual.to(dev, copy=True), residual.clone()
                got = quantize_feedback_blockwise(x.to(dev), r_dev, bits, block, fmt=fmt, backend="triton")  # type: ignore[arg-type]
                want = quantize_feedback_blockwise(x, r_ref, bits, block, fmt=fmt, backend="ref")  # type: ignore[arg-type]
                return {"codes": compare(got[0], want[0]), "scales": compare(got[1], want[1]),
                        "residual": compare(r_dev, r_ref)}  # fmt: skip

            def run_int8res(x: torch.Tensor = x, residual: torch.Tensor = residual, bits: int = bits, fmt: str = fmt,
                            block: int = block) -> dict[str, Any]:  # fmt: skip
                rc, rs = quantize_blockwise_ref(residual, 8, block)
                rc_d, rs_d = rc.to(dev, copy=True), rs.to(dev, copy=True)
                got = quantize_feedback_int8res_blockwise(x.to(dev), rc_d, rs_d, bits, block, fmt=fmt, backend="triton")  # type: ignore[arg-type]
                want = quantize_feedback_int8res_blockwise(x, rc, rs, bits, block, fmt=fmt, backend="ref")  # type: ignore[arg-type]
                return {"codes": compare(got[0], want[0]), "scales": compare(got[1], want[1]),
                        "res_codes": compare(rc_d, rc), "res_scales": compare(rs_d, rs)}  # fmt: skip

            case(f"feedback {fname} in={SHORT[dtype]} n={numel}", run_feedback)
            case(f"feedback_int8res {fname} in={SHORT[dtype]} n={numel}", run_int8res)
        # [Note: rows per launch]: a bucket's rows in one launch (4 ranks, this rank 1) against the
        # CPU loop of single-row ops that defines them; NaN and Inf blocks in the rows
        rows_x = torch.stack([numerics_input(numel, block, FP32, gen, nonfinite=r == 2) for r in range(4)])
        for mode in ("none", "fp32", "bf16", "int8") + (("sr",) if fmt == "int" else ()):

            def run_rows(mode: str = mode, bits: int = bits, fmt: str = fmt, block: int = block,
                         x: torch.Tensor = rows_x) -> dict[str, Any]:  # fmt: skip
                numel, nb = x.shape[1], num_blocks_for(x.shape[1], block)
                g = torch.Generator().manual_seed(11)
                res: Any = None
                if mode in ("fp32", "bf16"):
                    res = (torch.randn(3, numel, generator=g) * 0.01).to(FP32 if mode == "fp32" else BF16)
                elif mode == "int8":
                    res = (torch.randint(-127, 128, (3, nb * block), generator=g, dtype=torch.int8), torch.rand(3, nb, generator=g) * 1e-3)
                noise = torch.rand(3, nb * block, generator=g) if mode == "sr" else None
                outs = []
                for where in (dev, torch.device("cpu")):
                    codes = torch.zeros(4, code_numel(numel, bits, block), dtype=torch.int8 if bits == 8 and fmt == "int" else torch.uint8, device=where)
                    scales = torch.zeros(4, nb, device=where)
                    count = torch.zeros((), dtype=torch.int64, device=where)
                    r = None if res is None else (tuple(t.to(where, copy=True) for t in res) if isinstance(res, tuple) else res.to(where, copy=True))
                    kw = {"fmt": fmt, "skip": 1, "noise": None if noise is None else noise.to(where), "residual": r, "count": count}
                    if where == dev:
                        triton_kernels.encode_rows(x.to(dev), codes, scales, bits, block, **kw)  # type: ignore[arg-type]
                    else:
                        encode_rows_loop(x, codes, scales, bits, block, backend="ref", **kw)  # type: ignore[arg-type]
                    summed = decode_sum_rows(codes, scales, x[1].to(where), 1, 4, bits, block, torch.empty(numel, device=where),
                                             fmt=fmt, backend="triton" if where == dev else "ref")  # type: ignore[arg-type]  # fmt: skip
                    outs.append({"codes": codes, "scales": scales, "count": count.reshape(1).float(), "decode_sum": summed,
                                 **({"residual": r} if isinstance(r, torch.Tensor) else {} if r is None else {"res_codes": r[0], "res_scales": r[1]})})  # fmt: skip
                return {k: compare(outs[0][k], outs[1][k]) for k in outs[1]}

            case(f"rows {fname} {mode} ws=4 n={numel}", run_rows)

    for n in (1, 2, 8):
        layout = numerics_layout(n)
        for kind in ("out", "in"):
            for src in FLOATS:
                for dst in FLOATS:
                    job = copy_job(kind, layout, n, src, dst, gen, unused=2)

                    def run_copy(job: CopyJob = job, kind: str = kind, n: int = n) -> dict[str, Any]:
                        on_device = job.to(dev)
                        key = f"copy_{kind} ws={n}"
                        if key not in plans:
                            plans[key] = {"dtypes": f"{SHORT[job.flat.dtype]} flat", **on_device.plan()}
                        on_device.run("triton")
                        job.run_ref()
                        got, want = on_device.results(), job.results()
                        parts = {k: compare(got[k], want[k]) for k in want}
                        if "tags" in parts:  # the tags: exact bits, NaN patterns included
                            parts["tags"]["bitwise"] = parts["tags"].get("exact_bits", parts["tags"]["bitwise"])
                        return parts

                    case(f"copy_{kind} ws={n} {SHORT[src]}>{SHORT[dst]}", run_copy, 1)
    return pending, skipped


# ------------------------------------------------------------------ worlds on one device


def world_rank(rank: int, nproc: int, spec: dict[str, Any], send: Callable[..., None]) -> None:
    """One rank of a spawned world (gloo; CUDA tensors on the one GPU, or CPU tensors): the
    reference, then each config twice, results sent to the parent config by config."""
    cuda = spec["device"] == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    sizes = Sizes(**spec["sizes"])
    impls = probe_native(device)
    if rank == 0:
        send("probe", impls)
    group: Any = None
    if spec["hsdp"]:
        from torch.distributed.device_mesh import init_device_mesh

        group = init_device_mesh(device.type, (2, nproc // 2), mesh_dim_names=("replicate", "shard"))
    base = build_world_model(sizes, device)
    gen = torch.Generator().manual_seed(11)
    batches = [torch.randn(nproc, sizes.batch, sizes.seq, sizes.d, generator=gen) for _ in range(STEPS)]
    if rank == 0 and cuda:
        send("plain_step", plain_step_bytes(base, batches[0][0].to(device), device))
    with deterministic(device):
        ref_losses, ref_state = reference_run(base, batches, nproc, spec["hsdp"], device)

    def one(name: str, overrides: dict[str, Any]) -> dict[str, Any]:
        runs = []
        for delayed in (False, True):
            plans: list[dict[str, Any]] | None = [] if (name == "plain" and not delayed and rank == 0) else None
            runs.append(config_run(base, group, overrides, impls["overrides"], batches, rank, device, delayed, plans))
        (l1, s1, _, stats, plans_seen, rest), (l2, s2, counts, _, _, rest2) = runs
        summary = delayed_summary((l1, s1, rest["scales"]), (l2, s2, rest2["scales"]), counts)
        summary.update(stats=stats, memory=rest["memory"])
        if plans_seen is not None:
            summary["copy_plans"] = plans_seen
            summary["layout_mirror"] = layout_mirror(base, 2 if spec["hsdp"] else nproc, plans_seen)
        if name == "plain":
            summary["vs_reference"] = worst_difference(s1, ref_state)
            summary["losses_vs_reference"] = same_bits(l1, ref_losses[:, rank].contiguous())
            summary["bitwise_vs_reference"] = summary["vs_reference"]["bitwise"] and summary["losses_vs_reference"]
            summary["close_vs_reference"] = close(s1, ref_state) and close({"l": l1}, {"l": ref_losses[:, rank]})
        return summary

    run_configs(spec["configs"], nproc, send, one)


Run = tuple[torch.Tensor, dict[str, torch.Tensor], list[float]]  # losses, full state, the scaler's scales


def delayed_summary(plain: Run, delayed: Run, counts: Counter) -> dict[str, Any]:
    """A config's two runs compared ([Note: injected delays]): bitwise, and the delays counted."""
    (l1, s1, scales1), (l2, s2, scales2) = plain, delayed
    summary = {"bitwise_delayed": same_bits(l1, l2) and all(same_bits(s1[k], s2[k]) for k in s1) and scales1 == scales2,
               "delayed_vs_plain": worst_difference(s2, s1), "delays": dict(counts), "losses": l1.tolist()}  # fmt: skip
    if scales1:
        summary["scales"] = scales1
    return summary


def run_configs(configs: dict[str, dict[str, Any]], nproc: int, send: Callable[..., None],
                one: Callable[[str, dict[str, Any]], dict[str, Any]]) -> None:  # fmt: skip
    """Each config's summary `one(name, overrides)` (a raise is its result), sent to the parent;
    the ranks stop together when some but not all failed (they may have desynced)."""
    for name, overrides in configs.items():
        t0 = time.monotonic()
        try:
            summary = one(name, overrides)
        except Exception:  # noqa: BLE001  this config's result
            summary = {"error": traceback.format_exc()[-3000:]}
        summary["seconds"] = round(time.monotonic() - t0, 2)
        send("config", {"name": name, **summary})
        failed = torch.tensor([1 if "error" in summary else 0])
        dist.all_reduce(failed)
        if 0 < failed.item() < nproc:
            break


def plain_step_bytes(base: nn.Module, x: torch.Tensor, device: torch.device) -> dict[str, int]:
    """What one rank's step allocates on the unwrapped model, above its parameters: activations
    and the full gradients at their peak (the memory part's yardstick)."""
    model = copy.deepcopy(base)
    model.uses_spare = True
    synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    grads = torch.autograd.grad(loss_of(model(x)), list(model.parameters()), allow_unused=True)
    synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del grads, model
    return {"step_peak_bytes": peak, "param_bytes": sum(p.numel() * p.element_size() for p in base.parameters())}


def layout_mirror(base: nn.Module, n: int, plans: list[dict[str, Any]]) -> dict[str, Any]:
    """Whether the copies the runtime issued have the row strides that runtime_copy_out_layout /
    runtime_copy_in_layout (which the numerics and bandwidth parts use) give for a layer's unit
    and the root's (`spare`, `unused`) over `n` ranks: the mirror of the runtime's layout checked
    against the runtime itself."""
    expected: dict[str, list[int]] = {"copy_out": [], "copy_in": []}
    root = [(name, p) for name, p in base.named_parameters() if not name.startswith("layers.")]
    for unit in (list(base.layers[0].named_parameters()), root):
        params = [ParamInfo(name, ((name, "w"),), p.shape, True) for name, p in unit]
        layout = make_layout(0, "unit", ("unit",), params, n, CHUNK_ALIGN_NUMEL)
        expected["copy_out"].append(sum(runtime_copy_out_layout(layout, n)[0]) // n)
        expected["copy_in"].append(sum(runtime_copy_in_layout(layout, n)[0]) // n)
    seen = sorted({(p["kind"], p["row_stride"]) for p in plans if "row_stride" in p})
    layer_seen = {(kind, strides[0]) for kind, strides in expected.items()} <= set(seen)
    matches = layer_seen and all(stride in expected.get(kind, []) for kind, stride in seen)
    return {"expected_row_strides": expected, "seen": seen, "matches": matches}


def probe_native(device: torch.device) -> dict[str, Any]:
    """Whether gloo runs the native reduce-scatter and all-gather on `device` tensors (the same
    answer on every rank); "all_to_all" replaces one that does not, with the error reported."""
    ws, errors = dist.get_world_size(), {}
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    ok = []
    for name, run in (("reduce_scatter", lambda: rs(torch.empty(2, device=device), torch.ones(2 * ws, device=device))),
                      ("all_gather", lambda: ag(torch.empty(2 * ws, device=device), torch.ones(2, device=device)))):  # fmt: skip
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                run()
            synchronize(device)
            ok.append(1)
        except Exception as e:  # noqa: BLE001
            errors[name] = f"{type(e).__name__}: {str(e)[:300]}"
            ok.append(0)
    flags = torch.tensor(ok)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    rs_ok, ag_ok = (bool(v) for v in flags.tolist())
    overrides = {"reduce_scatter_impl": "native" if rs_ok else "all_to_all",
                 "all_gather_impl": "native" if ag_ok else "all_to_all"}  # fmt: skip
    return {"overrides": overrides, "errors": errors}


def reference_run(
    base: nn.Module, batches: list[torch.Tensor], nproc: int, hsdp: bool, device: torch.device
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One process, the unsharded model: every rank's half-batch, gradients summed in the order the
    collectives sum them (at 2 ranks a + b; HSDP (g0 + g1) + (g2 + g3)), divided by the ranks, SGD."""
    model = copy.deepcopy(base)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=LR, foreach=False)
    losses = torch.empty(len(batches), nproc)
    used: list[bool] = []
    for step, x in enumerate(batches):
        grads = []
        for r in range(nproc):
            model.uses_spare = r == 0
            loss = loss_of(model(x[r].to(device)))
            got = torch.autograd.grad(loss, params, allow_unused=True)  # a parameter a rank left: zeros
            used = [u or g is not None for u, g in zip(used, got)] if grads else [g is not None for g in got]
            grads.append([torch.zeros_like(p) if g is None else g for p, g in zip(params, got)])
            losses[step, r] = loss.detach().cpu()
        if hsdp:
            pairs = [[a + b for a, b in zip(grads[i], grads[i + 1])] for i in range(0, nproc, 2)]
            total = [sum_in_order(p) for p in zip(*pairs)]
        else:
            total = [sum_in_order(g) for g in zip(*grads)]
        for p, g, u in zip(params, total, used):
            p.grad = g.div_(nproc) if u else None  # no rank used it: no gradient
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, {k: v.detach().cpu() for k, v in model.state_dict().items()}


def close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rtol: float = 1e-5, atol: float = 1e-6) -> bool:
    """Every tensor within fp32 rounding of a reordered sum (3 ranks: the collective's order is
    the backend's, not the reference's)."""
    return set(got) == set(want) and all(torch.allclose(got[k].double(), want[k].double(), rtol, atol) for k in want)


def sum_in_order(tensors: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> torch.Tensor:
    """Left to right, in a new tensor."""
    total = tensors[0] + tensors[1] if len(tensors) > 1 else tensors[0].clone()
    for t in tensors[2:]:
        total = total + t
    return total


def config_run(
    base: nn.Module, group: Any, overrides: dict[str, Any], impls: dict[str, str], batches: list[torch.Tensor],
    rank: int, device: torch.device, delayed: bool, plans: list[dict[str, Any]] | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], Counter, dict[str, Any], list[dict[str, Any]] | None, dict[str, Any]]:  # fmt: skip
    """One config's steps: (losses, full state dict on CPU, delays injected, step counts, copy
    plans, and the rest: the scaler's scale after each step, the memory measured)."""
    options = dict(overrides)
    micro = options.pop("micro_batches", 1)
    scaled = options.pop("scaler", False)
    overflows = options.pop("overflow_one_shard", False)
    for key in ("param_dtype", "reduce_dtype"):
        if key in options:
            options[key] = getattr(torch, options[key])
    local = copy.deepcopy(base)
    local.uses_spare = rank == 0
    local.overflows = overflows
    if device.type == "cuda":
        synchronize(device)
        before_wrap = torch.cuda.memory_allocated(device)
    model = overlap.wrap(local, group=group, keep_for_backward_bytes=0, **impls, **options)
    opt = torch.optim.SGD(model.parameters(), lr=LR, foreach=False)
    scaler = overlap.ShardedGradScaler(model=model) if scaled else None
    counts: Counter = Counter()
    losses, scales = [], []
    if device.type == "cuda":
        synchronize(device)
        after_wrap = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    overlap.memory_stats(model, reset_peak=True)
    with contextlib.ExitStack() as stack:
        stack.enter_context(deterministic(device))
        if delayed:
            stack.enter_context(injected_delays(device, counts, seed=rank))
        for step, x in enumerate(batches):
            x = x[rank].to(device)
            capture = plans is not None and step == 0
            with captured_copy_plans(plans) if capture else contextlib.nullcontext():  # type: ignore[arg-type]
                for part in x.chunk(micro)[:-1]:
                    with overlap.no_sync(model):
                        loss_of(model(part)).backward()
                loss = loss_of(model(x.chunk(micro)[-1]))
                (loss if scaler is None else scaler.scale(loss)).backward()
            if scaler is None:
                opt.step()
            else:  # skipped on every rank or on none ([Note: found-inf across ranks] in overlap/amp.py)
                scaler.step(opt)
                scaler.update()
                scales.append(scaler.get_scale())
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
    synchronize(device)
    library = overlap.memory_stats(model)
    memory: dict[str, Any] = {"library_peak_bytes": library.peak_total_bytes, "library_peak": library.peak,
                              "sharded_param_bytes": library.bytes["sharded_params"]}  # fmt: skip
    if device.type == "cuda":
        memory.update(before_wrap_bytes=before_wrap, after_wrap_bytes=after_wrap,
                      steps_peak_bytes=torch.cuda.max_memory_allocated(device))  # fmt: skip
    stats = overlap.step_stats(model)
    counted = {k: getattr(stats, k) for k in ("num_allgathers", "num_reduce_scatters", "num_allreduces") if hasattr(stats, k)}
    state = overlap.full_state_dict(model, rank0_only=False)
    del model, opt
    rest = {"scales": scales, "memory": memory}
    return torch.stack(losses).cpu(), {k: v.detach().cpu() for k, v in state.items()}, counts, counted, plans, rest


@contextlib.contextmanager
def captured_copy_plans(plans: list[dict[str, Any]]) -> Iterator[None]:
    """The copy layouts the runtime really issues (through overlap.kernels.copy_out / copy_in,
    before it binds them) and the Triton launches each gets."""

    def record(kind: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
            def call(a: Any, b: Any, *, sizes: Any = None, num_rows: int = 1, data_cols: Any = None, **k: Any) -> Any:
                flat, tensors = (a, list(b)) if kind == "out" else (b, list(a))
                try:
                    if len(plans) < 8 and sizes is not None and data_cols is not None:
                        job = CopyJob(kind, flat.contiguous().view(-1), tensors, list(sizes), list(data_cols), num_rows)
                        dtypes = sorted({SHORT.get(t.dtype, str(t.dtype)) for t in tensors if t is not None})
                        entry = {"kind": f"copy_{kind}", "num_rows": num_rows, "flat": SHORT.get(flat.dtype, str(flat.dtype)),
                                 "tensors": dtypes, **job.plan()}  # fmt: skip
                        if entry not in plans:
                            plans.append(entry)
                except Exception as e:  # noqa: BLE001  a report, never a failure of the run
                    plans.append({"kind": f"copy_{kind}", "error": f"{type(e).__name__}: {e}"})
                return fn(a, b, sizes=sizes, num_rows=num_rows, data_cols=data_cols, **k)

            return call

        return wrap

    with patched([(okernels, "copy_out", record("out")), (okernels, "copy_in", record("in"))]):
        yield


_RANKS: list[Any] = []  # live rank processes (the watchdog ends them)


def _rank_entry(rank: int, nproc: int, port: int, spec: dict[str, Any], results: Any) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nproc,
                                timeout=timedelta(seconds=WORLD_TIMEOUT_S))  # fmt: skip
        target = spec.get("target", world_rank)  # a rank's work (gpu_worlds has its own)
        target(rank, nproc, spec, lambda kind, payload: results.put((rank, kind, payload)))
        results.put((rank, "done", None))
    except BaseException:  # noqa: BLE001
        results.put((rank, "error", traceback.format_exc()[-3000:]))
    finally:
        gc.collect()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        results.close()
        results.join_thread()
        os._exit(0)  # no interpreter finalization (gloo threads): [Note: rank exit] in overlap/launch.py


def run_world(nproc: int, spec: dict[str, Any], on_message: Callable[[int, str, Any], None]) -> None:
    """`world_rank` on `nproc` ranks forked from a forkserver that has torch and overlap imported
    (a fresh interpreter per rank costs seconds; the server starts once, without CUDA).
    Returns when every rank is done; raises when one fails or dies. The caller's budget
    (PartTimeout) ends the ranks."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "overlap", "__main__"])
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_entry, args=(r, nproc, port, spec, results), daemon=True) for r in range(nproc)]
    _RANKS.extend(procs)
    done: set[int] = set()
    try:
        for p in procs:
            p.start()
        while len(done) < nproc:
            try:
                rank, kind, payload = results.get(timeout=0.5)
            except queue.Empty:
                dead = [f"rank {r} (exit code {p.exitcode})" for r, p in enumerate(procs)
                        if p.exitcode is not None and r not in done]  # fmt: skip
                if dead:
                    with contextlib.suppress(queue.Empty):  # a last report may still be in the pipe
                        rank, kind, payload = results.get(timeout=2.0)
                        on_message(rank, kind, payload) if kind not in ("done", "error") else None
                    raise RuntimeError(f"{', '.join(dead)} ended without reporting done")
                continue
            if kind == "done":
                done.add(rank)
            elif kind == "error":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            else:
                on_message(rank, kind, payload)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
            with contextlib.suppress(ValueError):
                _RANKS.remove(p)


def part_world(c: Check, nproc: int, hsdp: bool, configs: dict[str, dict[str, Any]] = WORLD_CONFIGS) -> PartResult:
    kind = c.device.type
    spec = {"device": kind, "hsdp": hsdp, "sizes": asdict(WORLD_SIZES[kind]), "configs": configs}
    measured: dict[str, Any] = {
        "world": f"{nproc} ranks" + (" as a 2x2 mesh (replicate x shard)" if hsdp else "")
        + f", gloo, {kind} tensors" + (" on one GPU" if c.cuda else ""),
        "sizes": spec["sizes"], "steps": STEPS, "optimizer": f"SGD(lr={LR}, foreach=False)",
        "delays_ms": DELAYS_MS if c.cuda else f"time.sleep of {DELAYS_MS} ms", "configs": {},
    }  # fmt: skip

    def on_message(rank: int, kind: str, payload: Any) -> None:
        if kind in ("probe", "plain_step"):
            measured[kind] = payload
        elif kind == "config":
            name = payload.pop("name")
            measured["configs"].setdefault(name, {"ranks": {}})["ranks"][str(rank)] = payload
            skip_below = 2.0**16 if configs[name].get("overflow_one_shard") else None  # the scaler's default
            judge(measured["configs"][name], name, nproc, exact=nproc != 3, skip_below=skip_below)
        c.progress(measured)

    run_world(nproc, spec, on_message)
    verdicts = [measured["configs"].get(name, {}).get("ok", False) for name in configs]
    ok = all(verdicts)
    bar = ("every config on every rank: the delayed run bitwise equal to the plain run, delays injected "
           "(before collectives and after their waits), plain fp32 bitwise equal to the one-process reference")  # fmt: skip
    return ("passed" if ok else "failed"), bar, measured


def judge(entry: dict[str, Any], name: str, nproc: int, exact: bool = True, skip_below: float | None = None) -> None:
    """A config's verdict from its ranks' summaries; `exact`: plain fp32 bitwise equal to the
    reference (where it sums in the collective's order), else within fp32 rounding of it;
    `skip_below`: the scaler's initial scale, where an overflow was injected."""
    ranks = entry["ranks"].values()
    ok = len(entry["ranks"]) == nproc and all("error" not in r for r in ranks)
    ok = ok and all(r["bitwise_delayed"] and r["delays"].get("before_collective", 0) > 0
                    and r["delays"].get("after_wait", 0) > 0 for r in ranks)  # fmt: skip
    if name == "plain":
        ok = ok and all(r.get("bitwise_vs_reference" if exact else "close_vs_reference") for r in ranks)
    scales = [r.get("scales") for r in ranks]
    if any(scales):  # every rank stepped (or skipped) alike: the same scale after every step
        ok = ok and all(s == scales[0] for s in scales)
    if skip_below is not None:  # the injected overflow happened: a step skipped, the scale below its start
        ok = ok and all(s and min(s) < skip_below for s in scales)
    entry["ok"] = bool(ok)


def part_world2(c: Check, _budget_s: float) -> PartResult:
    return part_world(c, 2, hsdp=False)


def part_hsdp(c: Check, _budget_s: float) -> PartResult:
    return part_world(c, 4, hsdp=True)


def part_world3(c: Check, _budget_s: float) -> PartResult:
    return part_world(c, 3, hsdp=False, configs=WORLD3_CONFIGS)


# ------------------------------------------------------------------ world size 1


def part_nccl_path(c: Check, _budget_s: float) -> PartResult:
    model, opt = wrapped(c)
    x = make_input(c.sizes, c.device)
    for _ in range(2):  # step 1 records the unit order
        train_step(model, opt, x)
    synchronize(c.device)
    acts = [torch.profiler.ProfilerActivity.CPU]
    if c.cuda:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(STEPS):
            train_step(model, opt, x)
        synchronize(c.device)
    events = prof.events()
    issued = Counter(e.name for e in events if e.name.startswith("c10d::") and "barrier" not in e.name)
    ran = Counter(e.name for e in events if e.name.startswith(("nccl:", "gloo:")))
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    nccl_kernels = Counter(e.name.split("(")[0] for e in kernels if "nccl" in e.name.lower())
    backend = str(dist.get_backend())
    per_step = sum(issued.values()) / STEPS
    ok = per_step > 0 and (not c.cuda or backend == "nccl")
    if c.cuda and kernels:  # CUPTI works here: the collectives must show as NCCL kernels too
        ok = ok and sum(nccl_kernels.values()) > 0
    measured = {"backend": backend, "OVERLAP_FORCE_COLLECTIVES": os.environ.get("OVERLAP_FORCE_COLLECTIVES"),
                "collectives_per_step": per_step, "issued": dict(issued), "backend_events": dict(ran),
                "num_kernel_events": len(kernels), "nccl_kernels": dict(nccl_kernels)}  # fmt: skip
    bar = "> 0 c10d collectives issued per step (CUDA: on nccl, and NCCL kernels if CUPTI sees kernels)"
    return ("passed" if ok else "failed"), bar, measured


@contextlib.contextmanager
def counted_event_waits(waits: list[float]) -> Iterator[None]:
    """torch.cuda.Event.synchronize timed (sync debug mode does not see it): host ms per call."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(self: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(self)
            finally:
                waits.append((time.perf_counter() - t0) * 1e3)

        return call

    with patched([(torch.cuda.Event, "synchronize", wrap)]):
        yield


def sync_warnings(c: Check, overrides: dict[str, Any]) -> dict[str, Any]:
    model, opt = wrapped(c, **overrides)
    x = make_input(c.sizes, c.device)
    train_step(model, opt, x)  # step 1: allowed to sync (order recording, first allocations)
    synchronize(c.device)
    waits: list[float] = []
    with warnings.catch_warnings(record=True) as caught, counted_event_waits(waits):
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(2):
                train_step(model, opt, x)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    synchronize(c.device)
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    where = Counter(f"{Path(w.filename).as_posix().split('site-packages/')[-1]}:{w.lineno}" for w in syncs)
    return {"sync_warnings": len(syncs), "in_overlap": sum(n for k, n in where.items() if "overlap/" in k),
            "where": dict(where.most_common(12)), "event_synchronize_calls": len(waits),
            "event_synchronize_ms": round(sum(waits), 3)}  # fmt: skip


def part_sync_free(c: Check, _budget_s: float) -> PartResult:
    s = c.sizes
    layer_bytes = sum(p.numel() for p in nn.TransformerEncoderLayer(s.d, s.heads, s.ff).parameters()) * 4
    configs = {
        "plain": {},
        "strict-zero3": {"keep_for_backward_bytes": 0},  # backward gathers too
        "bucketed": {"reduce_scatter_bucket_bytes": 3 * layer_bytes},
        "int8+ef": {"grad_compression": "int8", "error_feedback": True},  # encodes nothing at ws=1 (own row)
        "int8-params": {"param_compression": "int8"},  # encodes and decodes every gather at ws=1
    }
    measured: dict[str, Any] = {}
    for name, overrides in configs.items():
        try:
            measured[name] = {"overrides": overrides, **sync_warnings(c, overrides)}
        except PartTimeout:
            raise
        except Exception:  # noqa: BLE001  one config's crash is that config's result
            measured[name] = {"overrides": overrides, "error": traceback.format_exc()[-3000:]}
        c.progress(measured)
    ok = all(m.get("sync_warnings") == 0 for m in measured.values())
    bar = "0 sync warnings in steps 2-3, per config (Event.synchronize calls reported, not held to a bar)"
    return ("passed" if ok else "failed"), bar, measured


def median_step_ms(device: torch.device, step: Callable[[], Any], n: int = TIMED_STEPS) -> float:
    times = []
    for _ in range(n):
        synchronize(device)
        t0 = time.perf_counter()
        step()
        synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def part_overlap(c: Check, _budget_s: float) -> PartResult:
    model, opt = wrapped(c)
    x = make_input(c.sizes, c.device)
    calls: Counter = Counter()

    def counting(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*a: Any, **k: Any) -> Any:
            calls[fn.__name__] += 1
            return fn(*a, **k)

        return call

    for _ in range(2):
        train_step(model, opt, x)
    with patched_comm(counting):
        train_step(model, opt, x)
    num_collectives = sum(calls.values())
    real_ms = median_step_ms(c.device, lambda: train_step(model, opt, x))
    standin_total_ms = 0.5 * real_ms
    per_collective_ms = standin_total_ms / max(1, num_collectives)
    cycles = int(per_collective_ms * sleep_cycles_per_ms())

    def with_sleep(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*a: Any, **k: Any) -> Any:
            torch.cuda._sleep(cycles)  # on the stream the runtime issues the collective from
            return fn(*a, **k)

        return call

    with patched_comm(with_sleep):
        train_step(model, opt, x)
        standin_ms = median_step_ms(c.device, lambda: train_step(model, opt, x))
    hidden = 1.0 - (standin_ms - real_ms) / standin_total_ms
    measured = {"collectives_per_step": dict(calls), "real_step_ms": real_ms, "standin_step_ms": standin_ms,
                "standin_comm_ms_per_step": standin_total_ms, "standin_ms_per_collective": per_collective_ms,
                "serial_would_be_ms": real_ms + standin_total_ms, "hidden_share": hidden}  # fmt: skip
    bar = f"hidden share of the stand-in comm >= {HIDDEN_BAR} (1.0 = all hidden, 0 = none)"
    return ("passed" if hidden >= HIDDEN_BAR else "failed"), bar, measured


def part_parity(c: Check, _budget_s: float) -> PartResult:
    plain = build_plain(c.sizes, c.device)
    ours = overlap.wrap(copy.deepcopy(plain))
    opts = [torch.optim.SGD(m.parameters(), lr=LR, foreach=False) for m in (plain, ours)]
    x = make_input(c.sizes, c.device)
    losses: list[tuple[torch.Tensor, torch.Tensor]] = []
    with warnings.catch_warnings(record=True) as caught, deterministic(c.device):
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
    bar = f"bitwise losses and parameters after {STEPS} SGD steps (else: the worst tensor by name)"
    return ("passed" if measured["bitwise"] else "failed"), bar, measured


# ------------------------------------------------------------------ bandwidth


def bench_ms(fn: Callable[[], Any], device: torch.device) -> float:
    """Median milliseconds per call: triton.testing.do_bench (CUDA events, many calls) on CUDA;
    three host-timed calls after a warm-up elsewhere."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


class Bandwidth:
    """The rows of part bandwidth, each on disk as soon as it is measured."""

    def __init__(self, c: Check, numels: list[int]) -> None:
        self.c, self.dev, self.numels = c, c.device, numels
        self.fast = "triton" if c.cuda else "auto"  # CPU: the C++ extension where built
        self.measured: dict[str, Any] = {"numels": numels, "rows": [], "errors": [], "plans": {}}
        self.copy_gbps = 0.0

    def add(self, op: str, size: int, numel: int, backend: str, fn: Callable[[], Any], moved: int) -> float:
        """One row; `size` is the nominal size it belongs to, `numel` the elements it moves."""
        ms = bench_ms(fn, self.dev)
        gbps = moved / (ms * 1e-3) / 1e9
        share = float(f"{gbps / self.copy_gbps:.3g}") if self.copy_gbps else None
        self.measured["rows"].append({"op": op, "numel": numel, "backend": backend, "ms": float(f"{ms:.4g}"),
                                      "gbps": float(f"{gbps:.4g}"), "share_of_d2d_copy": share,
                                      "largest_size": size == self.numels[-1]})  # fmt: skip
        self.c.progress(self.measured)
        return gbps

    def attempt(self, op: str, size: int, run: Callable[[], None]) -> None:
        try:
            run()
        except PartTimeout:
            raise
        except Exception as e:  # noqa: BLE001  a benchmark reports, it does not stop
            self.measured["errors"].append({"op": op, "numel": size, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            self.c.progress(self.measured)

    def size(self, numel: int) -> None:
        src = torch.randn(numel, device=self.dev)
        dst = torch.empty_like(src)
        self.copy_gbps = 0.0
        self.copy_gbps = self.add("memcpy f32", numel, numel, "torch", lambda: dst.copy_(src), 8 * numel)
        for bits, fmt, block in FORMATS:
            fname = "fp8" if fmt == "fp8" else f"int{bits}"
            self.attempt(f"quantize {fname}", numel, lambda b=bits, f=fmt, k=block: self.quantize(src, b, f, k))
            self.attempt(f"dequant_acc {fname}", numel, lambda b=bits, f=fmt, k=block: self.dequantize(src, b, f, k))
        self.attempt("feedback int8", numel, lambda: self.feedback(src))
        self.attempt("bucket int8 ws=8", numel, lambda: self.bucket(src))
        for n in (2, 8):
            layout = block_layout(numel, n)
            for kind, s, d in (("out", FP32, FP32), ("out", BF16, BF16), ("in", BF16, FP32), ("in", FP32, FP32)):
                op = f"copy_{kind} ws={n} {SHORT[s]}>{SHORT[d]}"
                self.attempt(op, numel, lambda k=kind, s=s, d=d, n=n, op=op, lay=layout: self.copy(op, numel, k, lay, n, s, d))

    def quantize(self, src: torch.Tensor, bits: int, fmt: str, block: int) -> None:
        numel = src.numel()
        moved = 4 * numel + (numel // 2 if bits == 4 else numel) + 4 * num_blocks_for(numel, block)
        for backend in (self.fast, "ref"):
            name = select_backend(self.dev, block, backend, fmt=fmt)  # type: ignore[arg-type]
            fn = functools.partial(quantize_blockwise, src, bits, block, fmt=fmt, backend=backend)
            self.add(f"quantize {'fp8' if fmt == 'fp8' else f'int{bits}'}", numel, numel, name, fn, moved)

    def dequantize(self, src: torch.Tensor, bits: int, fmt: str, block: int) -> None:
        numel = src.numel()
        codes, scales = quantize_blockwise(src, bits, block, fmt=fmt)  # type: ignore[arg-type]
        out = torch.zeros(numel, device=self.dev)
        moved = codes.numel() + 4 * scales.numel() + 8 * numel
        for backend in (self.fast, "ref"):
            name = select_backend(self.dev, block, backend, fmt=fmt)  # type: ignore[arg-type]
            fn = functools.partial(dequantize_blockwise, codes, scales, bits, block, numel, out, True, fmt=fmt, backend=backend)
            self.add(f"dequant_acc {'fp8' if fmt == 'fp8' else f'int{bits}'}", numel, numel, name, fn, moved)

    def feedback(self, src: torch.Tensor) -> None:
        numel = src.numel()
        residual = torch.zeros(numel, device=self.dev)
        moved = 12 * numel + numel + 4 * num_blocks_for(numel, 256)  # x, residual in and out; codes, scales
        for backend in (self.fast, "ref"):
            name = select_backend(self.dev, 256, backend)  # type: ignore[arg-type]
            fn = functools.partial(quantize_feedback_blockwise, src, residual, 8, 256, backend=backend)
            self.add("feedback int8", numel, numel, name, fn, moved)

    def bucket(self, src: torch.Tensor, ranks: int = 8, block: int = 256) -> None:
        """A compressed reduce-scatter's codec work on one bucket ([Note: rows per launch]):
        7 of 8 rows encoded with fp32 error feedback and counted, then 8 decode-summed. The fast
        backend is one launch each; "loop" the per-row launches CUDA ran before."""
        n = src.numel() // ranks // block * block
        grads = src[: ranks * n].view(ranks, n)
        residual = torch.zeros(ranks - 1, n, device=self.dev)
        codes = torch.empty(ranks, n, dtype=torch.int8, device=self.dev)
        scales = torch.empty(ranks, n // block, device=self.dev)
        count = torch.zeros((), dtype=torch.int64, device=self.dev)
        out = torch.empty(n, device=self.dev)
        peer = (ranks - 1) * n
        moved = peer * (12 + 1) + 2 * 4 * (peer // block) + peer + 4 * n + 4 * n  # encode, then decode-sum
        for backend in (self.fast, "loop"):

            def run(backend: str = backend) -> None:
                if backend == "loop":  # a launch (or more) per row, as reduce_scatter_encoded did
                    encode_rows_loop(grads, codes, scales, 8, block, skip=0, residual=residual, count=count)
                    out.copy_(grads[0])
                    for r in range(1, ranks):
                        dequantize_blockwise(codes[r], scales[r], 8, block, n, out, True)
                else:
                    encode_rows(grads, codes, scales, 8, block, skip=0, residual=residual, count=count, backend=backend)  # type: ignore[arg-type]
                    decode_sum_rows(codes, scales, grads[0], 0, ranks, 8, block, out, backend=backend)  # type: ignore[arg-type]

            name = select_backend(self.dev, block, self.fast) if backend != "loop" else "loop"  # type: ignore[arg-type]
            self.add("bucket int8 ws=8", src.numel(), ranks * n, name, run, moved)

    def copy(self, op: str, size: int, kind: str, layout: UnitLayout, n: int, s: torch.dtype, d: torch.dtype) -> None:
        job = copy_job(kind, layout, n, s, d, None, device=self.dev)
        for t in [job.flat] if kind == "out" else job.tensors[:-1]:
            if t is not None:
                t.normal_()  # real values, not zeros
        self.measured["plans"][op] = job.plan()
        dtypes = {job.flat.dtype, *(t.dtype for t in job.tensors if t is not None)}
        for backend in (self.fast, "ref"):
            name = select_copy_backend(self.dev, dtypes, backend)  # type: ignore[arg-type]
            self.add(op, size, layout.numel, name, functools.partial(job.run, backend), job.moved_bytes())


def part_bandwidth(c: Check, _budget_s: float) -> PartResult:
    bench = Bandwidth(c, [8 << 20, 64 << 20] if c.cuda else [64 << 10])
    for numel in bench.numels:
        bench.size(numel)
        gc.collect()
        if c.cuda:
            torch.cuda.empty_cache()
    measured = bench.measured
    bar = f"every Triton row at the largest size >= {SHARE_BAR} of the device-to-device copy's GB/s"
    fast_rows = [r for r in measured["rows"] if r["backend"] == "triton" and r["largest_size"]]
    measured["below_bar"] = [f"{r['op']}: {r['share_of_d2d_copy']}" for r in fast_rows if not r["share_of_d2d_copy"] >= SHARE_BAR]
    if not c.cuda:
        return "measured", bar + " (CUDA only)", measured
    ok = bool(fast_rows) and not measured["below_bar"] and not measured["errors"]
    return ("passed" if ok else "failed"), bar, measured


# ---------------------------------------------------------------------------------------------
# running the parts


@dataclass
class Part:
    name: str
    run: Callable[[Check, float], PartResult]
    budget_s: float
    cuda_only: bool = False


import gpu_worlds  # noqa: E402  here: it imports this module's helpers ([Note: one gpu_check module])

PARTS = [
    Part("compile", part_compile, 45, cuda_only=True),  # first: the checks, and the numerics kernels warmed
    Part("numerics", part_numerics, 25),  # warm: ~180 cases, each a launch and a CPU reference
    Part("world2", part_world2, 30),
    Part("hsdp2x2", part_hsdp, 22),
    Part("world3", part_world3, 18),
    Part("tp2x2", gpu_worlds.part_tp, 20),
    Part("memory", gpu_worlds.part_memory, 5),  # the worlds' own measurements: no run
    Part("autotune", gpu_worlds.part_autotune, 15),
    Part("nccl_path", part_nccl_path, 8),
    Part("sync_free", part_sync_free, 15, cuda_only=True),
    Part("overlap", part_overlap, 12, cuda_only=True),
    Part("parity", part_parity, 7),
    Part("bandwidth", part_bandwidth, 18),
]
"""Budgets add up to TOTAL_BUDGET_S (240 s); a part never runs past what is left of it."""


@contextlib.contextmanager
def time_budget(seconds: float) -> Iterator[None]:
    """Raise PartTimeout in this (main) thread after `seconds`."""

    def expire(_signum: int, _frame: Any) -> None:
        raise PartTimeout(f"ran past its budget of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


_write_lock = threading.Lock()


def write_report(path: Path, report: dict[str, Any]) -> None:
    """Atomically: a reader (or a crash) never sees half a file."""
    with _write_lock:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
        tmp.replace(path)


def run_parts(check: Check, parts: list[Part], total_s: float = TOTAL_BUDGET_S, scale: float = 1.0) -> dict[str, Any]:
    """Run `parts` in order, each within `scale` x its budget; each entry is on disk before its
    part starts and after it ends."""
    report = check.report
    start = time.monotonic()
    for part in parts:
        left = total_s * scale - (time.monotonic() - start)
        budget = min(part.budget_s * scale, left)
        entry: dict[str, Any] = {"part": part.name, "status": "running", "budget_s": round(budget, 1),
                                 "bar": None, "measured": None}  # fmt: skip
        report["parts"].append(entry)
        t0 = time.monotonic()
        if part.cuda_only and not check.cuda:
            entry["status"] = "skipped: no CUDA"
        elif budget < 5:
            entry["status"] = "skipped: out of time"
        else:
            write_report(check.out, report)
            check.entry = entry
            try:
                with time_budget(budget):
                    status, bar, measured = part.run(check, budget)
                entry.update(status=status, bar=bar, measured=measured)
            except Exception as e:  # noqa: BLE001  a part's failure is its result
                entry.update(status="error", error=f"{type(e).__name__}: {str(e)[:2000]}",
                             traceback=traceback.format_exc()[-4000:])  # fmt: skip
            finally:
                check.entry = None
        entry["seconds"] = round(time.monotonic() - t0, 2)
        write_report(check.out, report)
        shown = json.dumps(entry.get("measured"), default=str)[:400]
        print(f"[gpu_check] {part.name}: {entry['status']} ({entry['seconds']} s) {shown} "
              f"{entry.get('error', '')[:300]}", flush=True)  # fmt: skip
        gc.collect()
        if check.cuda:
            torch.cuda.empty_cache()
    return report


def give_up(check: Check) -> None:
    """The watchdog: a part stuck inside a C++ call never sees its SIGALRM."""
    for p in _RANKS[:]:
        with contextlib.suppress(Exception):
            p.kill()
    check.report["summary"] = {"error": f"watchdog: a part hung past {WATCHDOG_S:.0f} s"}
    write_report(check.out, check.report)
    print(f"[gpu_check] watchdog: a part hung; wrote {check.out}", flush=True)
    os._exit(2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment(check: Check) -> dict[str, Any]:
    env: dict[str, Any] = {"device": check.device.type, "torch": torch.__version__, "python": platform.python_version(),
                           "env": ENV, "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET"),
                           "sizes": asdict(check.sizes), "world_sizes": asdict(WORLD_SIZES[check.device.type]),
                           "cpus": os.cpu_count()}  # fmt: skip
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    try:  # the private torch APIs tensor and expert parallelism reach, on this torch
        from overlap.engine.torch_compat import probe

        env["torch_private_api"] = probe()
    except Exception as e:  # noqa: BLE001  recorded, not fatal
        env["torch_private_api"] = f"unknown ({type(e).__name__}: {e})"
    with contextlib.suppress(Exception):
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=5, check=False)
        env["git_head"] = head.stdout.strip() or None
    if check.cuda:
        facts: dict[str, Callable[[], Any]] = {
            "gpu": lambda: torch.cuda.get_device_name(check.device),
            "capability": lambda: torch.cuda.get_device_capability(check.device),
            "multiprocessors": lambda: torch.cuda.get_device_properties(check.device).multi_processor_count,
            "memory_bytes": lambda: torch.cuda.get_device_properties(check.device).total_memory,
            "cuda": lambda: torch.version.cuda,
            "nccl": lambda: str(torch.cuda.nccl.version()),
            "nvidia_smi": lambda: subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm,memory.total", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=10, check=False).stdout.strip(),
        }
        for key, fact in facts.items():
            try:
                env[key] = fact()
            except Exception as e:  # noqa: BLE001  a missing fact is recorded, not fatal
                env[key] = f"unknown ({type(e).__name__}: {e})"
        smi = str(env.get("nvidia_smi", "")).split(",")
        env["driver"] = smi[1].strip() if len(smi) > 1 else None
    return env


def main() -> int:
    os.environ.update(ENV)  # before CUDA initializes and before the ranks' server starts
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "gpu_results" / "gpu_check.json")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--only", default=",".join(p.name for p in PARTS), help="comma list of parts")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: --device cuda but CUDA is not available (use --device cpu for the dry run)")
    wanted = args.only.split(",")
    unknown = set(wanted) - {p.name for p in PARTS}
    if unknown:
        raise SystemExit(f"gpu_check: unknown parts {sorted(unknown)}; parts: {[p.name for p in PARTS]}")
    cuda = args.device == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    check = Check(device, SIZES[args.device], args.out)
    check.report["environment"] = environment(check)
    write_report(check.out, check.report)
    print(f"[gpu_check] {json.dumps(check.report['environment'], default=str)}", flush=True)
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
        timeout=timedelta(seconds=120), device_id=device if cuda else None,
    )  # fmt: skip
    scale = 1.0 if cuda else CPU_BUDGET_SCALE
    watchdog = threading.Timer(WATCHDOG_S * scale, give_up, args=(check,))
    watchdog.daemon = True
    watchdog.start()
    try:
        run_parts(check, [p for p in PARTS if p.name in wanted], scale=scale)
    finally:
        watchdog.cancel()
        dist.destroy_process_group()
    statuses = Counter(p["status"].split(":")[0] for p in check.report["parts"])
    check.report["summary"] = dict(statuses)
    write_report(check.out, check.report)
    for p in check.report["parts"]:
        print(f"[gpu_check] {p['part']:<10} {p['status']:<18} {p.get('seconds', 0):>7.1f} s", flush=True)
    print(f"[gpu_check] {dict(statuses)}; wrote {check.out}", flush=True)
    return 1 if statuses.get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
