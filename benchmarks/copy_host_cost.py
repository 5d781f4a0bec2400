"""Host time per fused copy on the Triton path, the launch itself left out.

What the runtime pays in Python for each copy-out (a gathered unit into its parameters, with
the tag slot) and copy-in (a bucket's gradients and used flags into the reduce buffer) before
Triton's launcher runs: argument checks, the segment plan, the table lookup. The kernels are
replaced by a stub that records the launch, so this runs on the CPU and measures our code
only (Triton's own launcher adds its cost on top, the same before and after any change here).
Copy-in is measured with the same gradient tensors every call and with fresh ones (new
allocations, as autograd makes every step). Run against any checkout to compare
(PYTHONPATH=that checkout); prints a table and writes JSON.

    python benchmarks/copy_host_cost.py --out /tmp/copy_host_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

if "PYTHONPATH" not in os.environ:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from overlap.engine.units import CHUNK_ALIGN_NUMEL, ParamInfo, make_layout
from overlap.kernels import copy as copy_mod
from overlap.kernels import triton_copy
from overlap.transport.fingerprint import TAG_NUMEL

# one decoder layer (attention with biases, MLP, two norms): 12 parameters, one of them with an
# odd chunk at world size 8, so that both aligned and unaligned segments occur
SHAPES = [(1024, 1024), (1024,), (1024, 1024), (1024,), (1024, 1024), (1024,), (1024, 1024), (1024,),
          (4096, 1024), (4096,), (1024, 4096), (1000,)]  # fmt: skip


class StubKernel:
    """Stands in for a jitted kernel: `kernel[grid](...)` counts the launch and returns."""

    def __init__(self) -> None:
        self.launches = 0

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.launches += 1

        return launch


def per_call_us(fn: Any, calls: int, rounds: int = 20) -> float:
    """The best round's mean: other processes on the machine only ever add time."""
    fn()  # plans and caches
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--flags-in-reduce-dtype", action="store_true", help="fp32 used flags, as runtimes before")
    args = parser.parse_args()
    n = args.world_size
    stubs = {"out": StubKernel(), "in": StubKernel()}
    triton_copy._copy_out_kernel = stubs["out"]
    triton_copy._copy_in_kernel = stubs["in"]
    copy_mod.select_copy_backend = lambda *a, **k: "triton"  # the CUDA choice, for CPU tensors

    infos = [ParamInfo(f"p{i}", ((f"m{i}", "w"),), torch.Size(s), True) for i, s in enumerate(SHAPES)]
    layout = make_layout(0, "layer", ("m",), infos, n, align_numel=CHUNK_ALIGN_NUMEL)
    dtype = torch.bfloat16
    # copy-out as Runtime._copy_out issues it: views of the unsharded buffer, then the tag slot
    tag = TAG_NUMEL if n > 1 else 0
    gathered = torch.zeros(n * (layout.shard_numel + tag), dtype=dtype)
    unsharded = torch.zeros(layout.unsharded_numel + n * tag, dtype=dtype)
    outs = [unsharded[s.unsharded_offset : s.unsharded_offset + n * s.chunk_numel] for s in layout.slots]
    sizes = [n * s.padded_chunk_numel for s in layout.slots]
    cols = [s.chunk_numel for s in layout.slots]
    if tag:
        outs.append(unsharded[layout.unsharded_numel :])
        sizes.append(n * tag)
        cols.append(tag)
    copy_out = copy_mod.bind_copy_out(dtype, gathered.device, outs, sizes, cols, n)
    # copy-in as Reductions.reduce issues it: the gradients, then the used flags
    flag_cols = -(-len(SHAPES) // CHUNK_ALIGN_NUMEL) * CHUNK_ALIGN_NUMEL
    in_sizes = [n * s.padded_chunk_numel for s in layout.slots] + [n * flag_cols]
    in_cols = [s.chunk_numel for s in layout.slots] + [len(SHAPES)]
    # the runtime sends the flags in the gradients' dtype (one launch); before, in the reduce dtype
    flags = torch.ones(n * len(SHAPES), dtype=torch.float32 if args.flags_in_reduce_dtype else dtype)
    full = torch.empty(sum(in_sizes), dtype=torch.float32)
    copy_in = copy_mod.bind_copy_in({dtype, flags.dtype, torch.float32}, full.device, in_sizes, in_cols, n)
    grads = [torch.zeros(s, dtype=dtype) for s in SHAPES]

    def fresh_copy_in() -> None:
        fresh = [torch.empty(s, dtype=dtype) for s in SHAPES]
        copy_in([*fresh, flags], full)

    def allocations_only() -> None:  # subtracted from the fresh case: not copy cost
        [torch.empty(s, dtype=dtype) for s in SHAPES]

    rows = []
    for name, fn in [
        ("copy_out (runtime layout, tagged)", lambda: copy_out(gathered)),
        ("copy_in (same gradients)", lambda: copy_in([*grads, flags], full)),
        ("copy_in (fresh gradients)", fresh_copy_in),
    ]:
        before = {k: s.launches for k, s in stubs.items()}
        us = per_call_us(fn, args.calls)
        calls = 1 + 20 * args.calls
        launches = sum(s.launches - before[k] for k, s in stubs.items()) / calls
        if name.endswith("(fresh gradients)"):
            us -= per_call_us(allocations_only, args.calls)
        rows.append({"copy": name, "host_us": round(us, 2), "launches_per_copy": launches})
    print(f"world size {n}, {len(SHAPES)} parameters, {len(outs)} copy-out segments, kernels stubbed")
    print(f"{'copy':<40} {'host us/copy':>12} {'launches':>9}")
    for row in rows:
        print(f"{row['copy']:<40} {row['host_us']:>12.2f} {row['launches_per_copy']:>9.2f}")
    if args.out is not None:
        args.out.write_text(json.dumps({"world_size": n, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
