"""Every Triton kernel variant on the device against the torch reference on the CPU.

quantize {int8, int4, fp8} x {nearest, stochastic (int)} x input {fp32, bf16, fp16};
dequantize(-accumulate) x output {fp32, bf16, fp16}; error feedback (fp32 and int8 residual); a
bucket's rows in one launch (encode with each residual, the count, the decode-sum); inputs with
zero, denormal, NaN and +-Inf blocks and a partial last block; copy-out / copy-in on the
runtime's own layouts at world size 1 (untagged), 2 and 8 (tagged) for every pair of
fp32/bf16/fp16, with which copy variant (aligned or not) each layout gets. Each case records
bitwise (NaN payloads aside), the bits exactly, mismatches and the largest distance in units in
the last place. Reports the kernels it still compiled (`triton_cache_new_entries`: 0 when the
compile part warmed them all). The dry run runs the kernels under TRITON_INTERPRET=1 on CPU
tensors (fp8 skipped: the interpreter's cast is wrong).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from .helpers.compare import classify
from .helpers.numerics_cases import numerics_cases
from .helpers.report import PartRecord

pytestmark = pytest.mark.cuda
BAR = "every case bitwise against the CPU reference (any NaN equal to any NaN; tags exact)"
WRITE_EVERY = 12  # cases between two writes of the report


def triton_cache_entries() -> set[str]:
    """The entries of Triton's on-disk kernel cache, to count the compiles a part caused."""
    try:
        from triton import knobs

        folder = Path(knobs.cache.dir)
    except Exception:
        folder = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    return set(os.listdir(folder)) if folder.is_dir() else set()


@pytest.mark.part("numerics")
def test_numerics(device: torch.device, record: PartRecord) -> None:
    pytest.importorskip("triton", reason="triton is not installed")
    interpreted = device.type != "cuda"
    if interpreted and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip(
            "the dry run needs TRITON_INTERPRET=1 from the start (benchmarks/gpu_check.py --device cpu sets it)"
        )
    record.bar = BAR
    measured: dict[str, Any] = {
        "kernels": "triton" + (" under TRITON_INTERPRET=1 on CPU tensors" if interpreted else f" on {device}"),
        "reference": "the torch references (overlap.kernels.*_ref) on the CPU",
        "summary": {}, "plans": {}, "cases": {},
    }  # fmt: skip
    cases: dict[str, Any] = measured["cases"]
    cache = triton_cache_entries()

    def summarize() -> None:
        by: dict[str, list[str]] = {}
        for name, r in cases.items():
            by.setdefault(r["class"], []).append(name)
        measured["summary"] = {"cases": len(cases), **{k: (len(v) if k == "bitwise" else v) for k, v in by.items()}}
        if not interpreted:  # [Note: warm Triton cache]: the kernels the compile part did not warm
            measured["triton_cache_new_entries"] = len(triton_cache_entries() - cache)

    pending, skipped = numerics_cases(device, interpreted, measured["plans"])
    for count, (_, name, fn) in enumerate(sorted(pending, key=lambda t: t[0]), 1):
        try:
            parts = fn()
            cases[name] = {"class": classify(parts), **parts}
        except Exception as e:
            cases[name] = {"class": "error", "error": f"{type(e).__name__}: {str(e)[:300]}"}
        if count % WRITE_EVERY == 0:
            summarize()
            record.progress(measured)
    summarize()
    measured["skipped"] = skipped
    variants = {launch["aligned"] for p in measured["plans"].values() for launch in p["launches"]}
    measured["copy_variants_run"] = sorted("aligned" if v else "unaligned" for v in variants)
    record.progress(measured)
    differing = [name for name, r in cases.items() if r["class"] != "bitwise"]
    assert cases and not differing, f"{len(differing)} of {len(cases)} cases not bitwise: {differing[:10]}"
