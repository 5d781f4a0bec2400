"""The bandwidth part's rows: GB/s of every Triton kernel (and the torch reference) as a share of
a device-to-device fp32 copy, each row on disk as soon as it is measured."""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from overlap.kernels import (
    dequantize_blockwise,
    num_blocks_for,
    quantize_blockwise,
    quantize_feedback_blockwise,
    select_backend,
    select_copy_backend,
)

from .common import BF16, FORMATS, FP32, SHORT
from .copies import block_layout, copy_job
from .internals import UnitLayout, decode_sum_rows, encode_rows, encode_rows_loop


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

    def __init__(self, device: torch.device, numels: list[int], progress: Callable[[dict[str, Any]], None]) -> None:
        self.dev, self.numels, self.progress = device, numels, progress
        self.fast = "triton" if device.type == "cuda" else "auto"  # CPU: the C++ extension where built
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
        self.progress(self.measured)
        return gbps

    def attempt(self, op: str, size: int, run: Callable[[], None]) -> None:
        try:
            run()
        except Exception as e:
            self.measured["errors"].append({"op": op, "numel": size, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            self.progress(self.measured)

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
                self.attempt(
                    op, numel, lambda k=kind, s=s, d=d, n=n, op=op, lay=layout: self.copy(op, numel, k, lay, n, s, d)
                )

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
            fn = functools.partial(
                dequantize_blockwise, codes, scales, bits, block, numel, out, True, fmt=fmt, backend=backend
            )
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
