"""How a kernel's output differs from the reference's: bits, ulps, codes."""

from __future__ import annotations

from typing import Any

import torch

from .common import BF16, FP16, FP32

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
