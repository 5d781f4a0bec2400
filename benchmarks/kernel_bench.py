"""Kernel throughput: blockwise quantize / dequantize-accumulate, fused copy-out / copy-in.

    python benchmarks/kernel_bench.py                          # CPU: every op, 3 sizes, 7 rounds
    python benchmarks/kernel_bench.py --sizes 1M,16M --rounds 11 --compile --json out/kernels.json
    python benchmarks/kernel_bench.py --ops copy_out,copy_in,memcpy --sizes 4M --rounds 5

Rounds interleave the backends (order rotated each round); each round times one call per
backend after one untimed warm-up call per (op, size, backend), which compiles the kernels and
fills the copy-table cache, so that the timed calls are the steady state (no host work beyond
the launches, [Note: copy tables] in overlap/kernels/triton_copy.py); on CUDA a call is timed
with events over 5 back-to-back launches, and the device is synchronized only outside the timed
region. Reported: median and min-max over rounds, GB/s of bytes moved, speedup over the op's
first backend, and the share of a plain same-size fp32 copy's GB/s (`memcpy` row:
`dst.copy_(src)`, the device-to-device copy bandwidth on a GPU). An op that fails (e.g. fp8 on
a GPU below sm_89) is reported and skipped; the others still run.
"bucket": a compressed reduce-scatter's codec work on one 8-rank bucket ([Note: rows per launch]
in overlap/kernels/triton_kernels.py): 7 rows encoded with fp32 error feedback, 8 decode-summed;
"triton" is one launch each, the others the per-row loop that defines them (CUDA's path before).
Bytes moved: quantize reads the fp32 input and writes codes + scales; dequantize-accumulate reads
codes + scales + out and writes out (fp32); copies read every source and write every destination
element (padding included).
Backends: "ref" (eager torch reference), "cpp" (the C++ extension, on CPU), "compiled"
(torch.compile of the reference, with --compile), "triton" (on CUDA). Copy ops compare against
"eager": plain torch ops on a unit laid out as in overlap/engine/units.py (a GPT block of about numel
elements over `--rows` ranks, chunks padded to `--align` elements as wrap lays them out; `--rows
3` also pads dim 0): `split_with_sizes_copy` (or per-tensor `copy_` when it casts or drops
padding) for copy-out, pad + `torch.cat` for copy-in. On CPU the allocator keeps freed blocks
as the runtime sets it ([Note: CPU page faults] in transport/host.py).

JSON (`--json PATH`, read by benchmarks/gpu_check.py): {"device", "block", "copy_rows",
"copy_align", "rows": [...], "errors": [...]}. Each row: op, numel, backend, median_ms, min_ms,
max_ms, gbps, speedup_vs_base, host_syncs (synchronizing calls during its timed calls, counted
by torch's sync debug mode on CUDA; 0 on CPU), share_of_memcpy and share_of_d2d_copy (the same
number: GB/s over the memcpy row's). Each error: op, numel, error (the exception, one line).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F

from overlap.engine.units import CHUNK_ALIGN_NUMEL, ParamInfo, UnitLayout, make_layout
from overlap.kernels import copy_in, copy_out, cpu
from overlap.kernels import rows as row_ops
from overlap.kernels.quantize import dequantize_blockwise, quantize_blockwise, quantize_feedback_blockwise
from overlap.kernels.reference import (
    CodeFormat,
    code_numel,
    dequantize_blockwise_ref,
    num_blocks_for,
    quantize_blockwise_ref,
)
from overlap.transport.host import keep_freed_cpu_memory

Contender = Literal["ref", "cpp", "triton", "compiled"]
CopyContender = Literal["eager", "cpp", "triton"]
OPS: list[tuple[str, int, CodeFormat]] = [("quantize", 8, "int"), ("quantize", 4, "int"), ("quantize", 8, "fp8"), ("dequant_acc", 8, "int"),
       ("dequant_acc", 4, "int"), ("feedback", 8, "int"), ("bucket", 8, "int")]  # fmt: skip
BUCKET_RANKS = 8  # "bucket": a reduce-scatter bucket of 8 ranks' rows
BF16, FP32 = torch.bfloat16, torch.float32
# (op, source dtype, destination dtype): gathered fp32 -> bf16 params (mixed precision), a bf16
# gather, bf16 grads -> fp32 reduce buffer, fp32 throughout
COPY_OPS: list[tuple[str, torch.dtype, torch.dtype]] = [
    ("copy_out", FP32, BF16), ("copy_out", BF16, BF16), ("copy_in", BF16, FP32), ("copy_in", FP32, FP32),
]  # fmt: skip
_SHORT = {FP32: "f32", BF16: "bf16"}


def parse_size(text: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * mult[text[-1]]) if text[-1] in mult else int(text)


def bytes_moved(op: str, bits: int, numel: int, block: int) -> int:
    code_bytes = code_numel(numel, bits, block) + 4 * num_blocks_for(numel, block)
    if op == "feedback":  # read x and the residual, write the residual and the codes
        return 12 * numel + code_bytes
    if op == "bucket":  # encode 7 of 8 rows with feedback, then decode-sum: as feedback + a decode
        return 12 * numel + 2 * code_bytes + 8 * numel // BUCKET_RANKS
    return 4 * numel + code_bytes if op == "quantize" else code_bytes + 8 * numel


def make_call(
    op: str, bits: int, fmt: CodeFormat, backend: Contender, numel: int, block: int, device: str
) -> Callable[[], object]:
    x = torch.randn(numel, device=device)
    codes, scales = quantize_blockwise_ref(x, bits, block, fmt=fmt)
    out = torch.zeros(numel, device=device)
    if op == "bucket":  # [Note: rows per launch]: the rows of one bucket, encoded then decode-summed
        return bucket_call(bits, fmt, backend, numel, block, device)
    if op == "feedback":  # error feedback: "ref" is the composition of four passes
        residual = torch.zeros(numel, device=device)
        if backend == "compiled":
            raise ValueError("no torch.compile contender for feedback")
        return lambda: quantize_feedback_blockwise(x, residual, bits, block, fmt=fmt, backend=backend)
    if backend == "compiled":
        if op == "quantize":
            quantize = torch.compile(quantize_blockwise_ref, dynamic=False)
            return lambda: quantize(x, bits, block, fmt=fmt)
        dequantize = torch.compile(dequantize_blockwise_ref, dynamic=False)
        return lambda: dequantize(codes, scales, bits, block, numel, out, True, fmt)
    if op == "quantize":
        return lambda: quantize_blockwise(x, bits, block, fmt=fmt, backend=backend)
    return lambda: dequantize_blockwise(codes, scales, bits, block, numel, out, True, fmt=fmt, backend=backend)


def bucket_call(
    bits: int, fmt: CodeFormat, backend: Contender, numel: int, block: int, device: str
) -> Callable[[], object]:
    """A compressed reduce-scatter's codec work on one bucket of `numel` elements over
    BUCKET_RANKS ranks, this rank 0: the 7 peer rows encoded with fp32 error feedback and the
    count, then the 8 rows decode-summed in rank order. "triton": one launch each ([Note: rows per
    launch]); otherwise the loop of single-row ops that defines them (what CUDA ran before)."""
    if backend == "compiled":
        raise ValueError("no torch.compile contender for bucket")
    ranks = BUCKET_RANKS
    n = numel // ranks // block * block
    grads = torch.randn(ranks, n, device=device)
    residual = torch.zeros(ranks - 1, n, device=device)
    codes = torch.empty(ranks, code_numel(n, bits, block), dtype=torch.int8, device=device)
    scales = torch.empty(ranks, num_blocks_for(n, block), device=device)
    count = torch.zeros((), dtype=torch.int64, device=device)
    out = torch.empty(n, device=device)
    loop = "ref" if backend == "triton" and device != "cuda" else backend

    def run() -> None:
        if backend == "triton":
            row_ops.encode_rows(grads, codes, scales, bits, block, fmt=fmt, skip=0, residual=residual, count=count)
            row_ops.decode_sum_rows(codes, scales, grads[0], 0, ranks, bits, block, out, fmt=fmt)
        else:
            row_ops.encode_rows_loop(grads, codes, scales, bits, block, fmt=fmt, skip=0, residual=residual, count=count,
                                  backend=loop)  # type: ignore[arg-type]  # fmt: skip
            row_ops.decode_sum_rows(codes, scales, grads[0], 0, ranks, bits, block, out, fmt=fmt, backend=loop)  # type: ignore[arg-type]

    return run


def block_layout(numel: int, rows: int, align: int) -> UnitLayout:
    """One GPT block's parameters (~numel elements, width d a multiple of 64 as in real models)
    laid out over `rows` ranks: chunks are padded where d is not a multiple of `rows`, and to
    multiples of `align` elements."""
    d = max(64, round((numel / 12) ** 0.5 / 64) * 64)
    shapes = [(3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,), (d,), (d,)]
    params = [ParamInfo(f"p{i}", ((f"m{i}", "w"),), torch.Size(s), True) for i, s in enumerate(shapes)]
    return make_layout(0, "block", ("block",), params, rows, align)


def make_copy_call(
    op: str, src_dtype: torch.dtype, dst_dtype: torch.dtype, backend: CopyContender, layout: UnitLayout, device: str
) -> tuple[Callable[[], object], int]:
    """(call, bytes moved) for one copy op on `layout`, as the runtime would issue it."""
    n = layout.world_size
    sizes = [n * s.padded_chunk_numel for s in layout.slots]
    data = [s.chunk_numel for s in layout.slots]
    if op == "copy_out":
        gathered = torch.randn(layout.unsharded_numel, device=device).to(src_dtype)
        unsharded = torch.empty(layout.unsharded_numel, dtype=dst_dtype, device=device)
        outs = [unsharded[s.unsharded_offset : s.unsharded_offset + n * s.chunk_numel] for s in layout.slots]
        moved = layout.unsharded_numel * (gathered.element_size() + unsharded.element_size())
        if backend != "eager":
            return lambda: copy_out(gathered, outs, sizes=sizes, data_cols=data, num_rows=n, backend=backend), moved
        views = [o.view(n, -1) for o in outs]
        if src_dtype == dst_dtype and data == layout.chunk_sizes:
            return lambda: torch.split_with_sizes_copy(gathered.view(n, -1), layout.chunk_sizes, 1, out=views), moved

        def split_and_cast() -> None:
            for view, block in zip(views, gathered.view(n, -1).split(layout.chunk_sizes, dim=1)):
                view.copy_(block[:, : view.shape[1]])

        return split_and_cast, moved
    grads = [torch.randn(s.shape, device=device).to(src_dtype) for s in layout.slots]
    flags = torch.ones(n, len(grads), dtype=dst_dtype, device=device)
    full = torch.empty(n, layout.shard_numel + len(grads), dtype=dst_dtype, device=device)
    moved = sum(g.numel() for g in grads) * grads[0].element_size() + full.numel() * full.element_size()
    if backend != "eager":
        all_sizes, all_data = [*sizes, flags.numel()], [*data, len(grads)]
        return lambda: copy_in([*grads, flags.view(-1)], full, sizes=all_sizes, data_cols=all_data, num_rows=n,
                               backend=backend), moved  # fmt: skip

    def pad_and_cat() -> None:  # plain torch: pad each gradient to its chunks, then to the padded width
        columns = []
        for g, slot in zip(grads, layout.slots):
            chunks = F.pad(g.reshape(-1), (0, n * slot.chunk_numel - g.numel())).view(n, -1)
            columns.append(F.pad(chunks, (0, slot.padded_chunk_numel - slot.chunk_numel)))
        torch.cat([*columns, flags], dim=1, out=full)

    return pad_and_cat, moved


def make_memcpy(numel: int, device: str) -> tuple[Callable[[], object], int]:
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src), 8 * numel


def time_call(fn: Callable[[], object], device: str, reps: int = 5) -> tuple[float, int]:
    """(seconds per call, host syncs the calls made: CUDA only, counted by torch's sync debug
    mode, 0 elsewhere)."""
    if device != "cuda":
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start, 0
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()  # outside the timed region
    with warnings.catch_warnings(record=True) as syncs:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            begin.record()
            for _ in range(reps):
                fn()
            end.record()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    end.synchronize()
    return begin.elapsed_time(end) / 1e3 / reps, sum("synchroniz" in str(w.message) for w in syncs)


def measure(calls: dict[str, Callable[[], object]], rounds: int, device: str) -> dict[str, tuple[list[float], int]]:
    """Seconds per call for each contender over interleaved rounds (after one warm-up call),
    and the host syncs its timed calls made."""
    for fn in calls.values():
        fn()  # warm-up: compiles, fills the copy-table cache
    names = list(calls)
    times: dict[str, list[float]] = {b: [] for b in names}
    syncs = dict.fromkeys(names, 0)
    for r in range(rounds):
        for b in names[r % len(names) :] + names[: r % len(names)]:
            seconds, num_syncs = time_call(calls[b], device)
            times[b].append(seconds)
            syncs[b] += num_syncs
    return {b: (times[b], syncs[b]) for b in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1M,8M,32M", help="elements per tensor, comma-separated")
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--compile", action="store_true", help="also time torch.compile(reference)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument(
        "--ops", default="memcpy,quantize,dequant_acc,feedback,bucket,copy_out,copy_in", help="which ops to time"
    )
    parser.add_argument("--rows", type=int, default=2, help="copy ops: ranks the unit is sharded over")
    parser.add_argument("--align", type=int, default=CHUNK_ALIGN_NUMEL, help="copy ops: chunk padding (elements)")
    args = parser.parse_args()

    device = args.device
    if device == "cpu":
        keep_freed_cpu_memory()  # as the runtime does: reused, not freshly faulted, pages
    ops = set(args.ops.split(","))
    compiled: list[Literal["cpp", "triton"]] = []
    if device == "cpu" and cpu.load_extension() is not None:
        compiled.append("cpp")
    if device == "cuda":
        compiled.append("triton")
    backends: list[Contender] = ["ref", *compiled]
    if args.compile:
        backends.append("compiled")
    copy_backends: list[CopyContender] = ["eager", *compiled]
    print(f"device={device} threads={torch.get_num_threads()} block={args.block} backends={backends}"
          f" copy backends={copy_backends} rows={args.rows} cpp_load_s={cpu.build_seconds}")  # fmt: skip

    rows: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []

    def add_rows(op: str, numel: int, times: dict[str, tuple[list[float], int]], moved: int) -> None:
        base = statistics.median(next(iter(times.values()))[0])
        for b, (ts, syncs) in times.items():
            med = statistics.median(ts)
            rows.append({
                "op": op, "numel": numel, "backend": b, "median_ms": med * 1e3, "min_ms": min(ts) * 1e3,
                "max_ms": max(ts) * 1e3, "gbps": moved / med / 1e9, "speedup_vs_base": base / med,
                "host_syncs": syncs,
            })  # fmt: skip

    def attempt(op: str, numel: int, run: Callable[[], None]) -> None:
        """One op at one size; a failure is reported and skipped (the other ops still run)."""
        try:
            run()
        except Exception as exc:  # a benchmark reports, it does not stop
            message = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            errors.append({"op": op, "numel": numel, "error": message})
            print(f"[kernels] {op} numel={numel} failed: {message}", flush=True)

    for numel in [parse_size(s) for s in args.sizes.split(",")]:
        first_row = len(rows)
        fn, moved = make_memcpy(numel, device)
        add_rows("memcpy f32", numel, measure({"torch": fn}, args.rounds, device), moved)
        for op, bits, fmt in OPS if ops & {"quantize", "dequant_acc", "feedback", "bucket"} else []:
            if op not in ops:
                continue
            name = f"{op} {fmt if fmt == 'fp8' else f'int{bits}'}"

            def run_quantize(op: str = op, bits: int = bits, fmt: CodeFormat = fmt, name: str = name) -> None:
                calls: dict[str, Callable[[], object]] = {
                    b: make_call(op, bits, fmt, b, numel, args.block, device)
                    for b in backends
                    if not (op in ("feedback", "bucket") and b == "compiled")
                }
                add_rows(name, numel, measure(calls, args.rounds, device), bytes_moved(op, bits, numel, args.block))

            attempt(name, numel, run_quantize)
        layout = block_layout(numel, args.rows, args.align)
        for op, src_dtype, dst_dtype in COPY_OPS:
            if op not in ops:
                continue
            name = f"{op} {_SHORT[src_dtype]}>{_SHORT[dst_dtype]}"

            def run_copy(op: str = op, src_dtype: torch.dtype = src_dtype, dst_dtype: torch.dtype = dst_dtype,
                         name: str = name) -> None:  # fmt: skip
                made = {b: make_copy_call(op, src_dtype, dst_dtype, b, layout, device) for b in copy_backends}
                times = measure({b: fn for b, (fn, _) in made.items()}, args.rounds, device)
                add_rows(name, layout.numel, times, made["eager"][1])

            attempt(name, numel, run_copy)
        copy_gbps = rows[first_row]["gbps"]  # this size's memcpy row
        for row in rows[first_row:]:
            row["share_of_memcpy"] = row["share_of_d2d_copy"] = row["gbps"] / copy_gbps

    header = (f"{'op':<20}{'numel':>10}  {'backend':<9}{'median ms':>10}{'min-max ms':>16}{'GB/s':>8}"
              f"{'x base':>8}{'% copy':>8}{'syncs':>6}")  # fmt: skip
    print(header)
    print("-" * len(header))
    for row in rows:
        spread = f"{row['min_ms']:.3f}-{row['max_ms']:.3f}"
        print(
            f"{row['op']:<20}{row['numel']:>10}  {row['backend']:<9}{row['median_ms']:>10.3f}{spread:>16}"
            f"{row['gbps']:>8.2f}{row['speedup_vs_base']:>8.1f}{100 * row['share_of_memcpy']:>7.0f}%"
            f"{row['host_syncs']:>6}"
        )
    for error in errors:
        print(f"{error['op']:<20}{error['numel']:>10}  failed: {error['error']}")
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {"device": device, "block": args.block, "copy_rows": args.rows, "copy_align": args.align,
                   "rows": rows, "errors": errors}  # fmt: skip
        path.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
