"""Blockwise quantize / dequantize-accumulate throughput: torch reference vs compiled backends.

    python benchmarks/kernels.py                          # CPU: ref vs cpp, 3 sizes, 7 rounds
    python benchmarks/kernels.py --sizes 1M,16M --rounds 11 --compile --json out/kernels.json

Rounds interleave the backends (order rotated each round); each round times one call per
backend after one untimed warm-up call per (op, size, backend). Reported: median and min-max
over rounds. GB/s counts bytes moved: quantize reads the fp32 input and writes codes + scales;
dequantize-accumulate reads codes + scales + out and writes out (fp32).
Backends: "ref" (eager torch reference), "cpp" (the C++ extension, on CPU), "compiled"
(torch.compile of the reference, with --compile), "triton" (on CUDA).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import torch

from overlap.kernels import (
    code_numel,
    cpu,
    dequantize_blockwise,
    dequantize_blockwise_ref,
    num_blocks_for,
    quantize_blockwise,
    quantize_blockwise_ref,
)
from overlap.kernels.reference import CodeFormat

Contender = Literal["ref", "cpp", "triton", "compiled"]
OPS: list[tuple[str, int, CodeFormat]] = [("quantize", 8, "int"), ("quantize", 4, "int"), ("quantize", 8, "fp8"), ("dequant_acc", 8, "int"),
       ("dequant_acc", 4, "int")]  # fmt: skip


def parse_size(text: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * mult[text[-1]]) if text[-1] in mult else int(text)


def bytes_moved(op: str, bits: int, numel: int, block: int) -> int:
    code_bytes = code_numel(numel, bits, block) + 4 * num_blocks_for(numel, block)
    return 4 * numel + code_bytes if op == "quantize" else code_bytes + 8 * numel


def make_call(
    op: str, bits: int, fmt: CodeFormat, backend: Contender, numel: int, block: int, device: str
) -> Callable[[], object]:
    x = torch.randn(numel, device=device)
    codes, scales = quantize_blockwise_ref(x, bits, block, fmt=fmt)
    out = torch.zeros(numel, device=device)
    if backend == "compiled":
        if op == "quantize":
            quantize = torch.compile(quantize_blockwise_ref, dynamic=False)
            return lambda: quantize(x, bits, block, fmt=fmt)
        dequantize = torch.compile(dequantize_blockwise_ref, dynamic=False)
        return lambda: dequantize(codes, scales, bits, block, numel, out, True, fmt)
    if op == "quantize":
        return lambda: quantize_blockwise(x, bits, block, fmt=fmt, backend=backend)
    return lambda: dequantize_blockwise(
        codes, scales, bits, block, numel, out, True, fmt=fmt, backend=backend
    )


def time_call(fn: Callable[[], object], device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1M,8M,32M", help="elements per tensor, comma-separated")
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--compile", action="store_true", help="also time torch.compile(reference)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args()

    device = args.device
    backends: list[Contender] = ["ref"]
    if device == "cpu" and cpu.load_extension() is not None:
        backends.append("cpp")
    if device == "cuda":
        backends.append("triton")
    if args.compile:
        backends.append("compiled")
    print(f"device={device} threads={torch.get_num_threads()} block={args.block} backends={backends}"
          f" cpp_load_s={cpu.build_seconds}")  # fmt: skip

    rows = []
    for numel in [parse_size(s) for s in args.sizes.split(",")]:
        for op, bits, fmt in OPS:
            calls = {b: make_call(op, bits, fmt, b, numel, args.block, device) for b in backends}
            for fn in calls.values():
                fn()  # warm-up (and compile)
            times: dict[Contender, list[float]] = {b: [] for b in backends}
            for r in range(args.rounds):
                order = backends[r % len(backends) :] + backends[: r % len(backends)]
                for b in order:
                    times[b].append(time_call(calls[b], device))
            moved = bytes_moved(op, bits, numel, args.block)
            ref_median = statistics.median(times["ref"])
            for b in backends:
                med = statistics.median(times[b])
                rows.append({
                    "op": f"{op} {fmt if fmt == 'fp8' else f'int{bits}'}", "numel": numel, "backend": b,
                    "median_ms": med * 1e3, "min_ms": min(times[b]) * 1e3, "max_ms": max(times[b]) * 1e3,
                    "gbps": moved / med / 1e9, "speedup_vs_ref": ref_median / med,
                })  # fmt: skip

    header = f"{'op':<18}{'numel':>10}  {'backend':<9}{'median ms':>10}{'min-max ms':>18}{'GB/s':>8}{'x ref':>7}"
    print(header)
    print("-" * len(header))
    for row in rows:
        spread = f"{row['min_ms']:.2f}-{row['max_ms']:.2f}"
        print(
            f"{row['op']:<18}{row['numel']:>10}  {row['backend']:<9}{row['median_ms']:>10.2f}{spread:>18}"
            f"{row['gbps']:>8.2f}{row['speedup_vs_ref']:>7.1f}"
        )
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"device": device, "block": args.block, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
