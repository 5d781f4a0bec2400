"""The numerics part's cases: every Triton kernel variant against the torch reference.

Built from one seeded generator, so every process builds the same cases with the same shapes:
the compile part warms exactly these launches ([Note: warm Triton cache] in compile_worker.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from overlap.kernels.quantize import (
    dequantize_blockwise,
    quantize_blockwise,
    quantize_feedback_blockwise,
    quantize_feedback_int8res_blockwise,
)
from overlap.kernels.reference import dequantize_blockwise_ref, num_blocks_for, quantize_blockwise_ref

from .common import BF16, FLOATS, FORMATS, FP32, SHORT
from .compare import compare
from .copies import CopyJob, copy_job, numerics_layout
from .internals import code_numel, decode_sum_rows, encode_rows_loop, triton_kernels

NumericsCase = tuple[int, str, Callable[[], dict[str, Any]]]  # (priority, name, the case)


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
                        want = dequantize_blockwise_ref(
                            codes, scales, bits, block, numel, base.clone(), accumulate, fmt
                        )  # type: ignore[arg-type]
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
                    res = (
                        torch.randint(-127, 128, (3, nb * block), generator=g, dtype=torch.int8),
                        torch.rand(3, nb, generator=g) * 1e-3,
                    )
                noise = torch.rand(3, nb * block, generator=g) if mode == "sr" else None
                outs = []
                for where in (dev, torch.device("cpu")):
                    codes = torch.zeros(
                        4,
                        code_numel(numel, bits, block),
                        dtype=torch.int8 if bits == 8 and fmt == "int" else torch.uint8,
                        device=where,
                    )
                    scales = torch.zeros(4, nb, device=where)
                    count = torch.zeros((), dtype=torch.int64, device=where)
                    r = (
                        None
                        if res is None
                        else (
                            tuple(t.to(where, copy=True) for t in res)
                            if isinstance(res, tuple)
                            else res.to(where, copy=True)
                        )
                    )
                    kw = {
                        "fmt": fmt,
                        "skip": 1,
                        "noise": None if noise is None else noise.to(where),
                        "residual": r,
                        "count": count,
                    }
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
