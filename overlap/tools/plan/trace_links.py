"""Links fitted to a run's own collectives: the spans its trace recorded in the first steps
(`overlap plan --calibrate FILE --from-trace DIR`), the cluster's way to calibrate ([Note: one
model] in overlap/step_model/calibration.py)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from overlap.step_model.calibration import Calibration
from overlap.step_model.cost import Link
from overlap.step_model.fitting import RING_FACTOR, fit_link

TRACE_LANES = {1: "all_gather", 2: "reduce"}
"""Trace thread ids of the collective lanes (overlap/observe/trace.py's LANES)."""


def trace_rows(trace_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """(bytes, seconds) per collective from a run's trace files (`trace_dir` / `OVERLAP_TRACE`):
    per op and size the fastest span over ranks and steps, the one least delayed by queueing
    behind other collectives (a host-clock span runs from issue to completion). Ops:
    "all_gather" (unsharded bytes), "reduce" (the bucket's unsharded gradient bytes: a
    reduce-scatter, or gloo's all-to-all) and "all_reduce" (HSDP: the reduced shard's bytes)."""
    files = sorted(Path(trace_dir).glob("trace_rank*.json"))
    if not files:
        raise ValueError(f"from_trace: no trace_rank*.json in {trace_dir} (run with OVERLAP_TRACE={trace_dir})")
    best: dict[str, dict[int, float]] = {}
    for file in files:
        for e in json.loads(file.read_text())["traceEvents"]:
            if e.get("ph") != "X" or e.get("tid") not in TRACE_LANES or not e.get("args", {}).get("bytes"):
                continue
            op = "all_reduce" if str(e["name"]).startswith("all-reduce") else TRACE_LANES[e["tid"]]
            sizes = best.setdefault(op, {})
            nbytes, seconds = int(e["args"]["bytes"]), e["dur"] * 1e-6
            if seconds > 0:
                sizes[nbytes] = min(seconds, sizes.get(nbytes, float("inf")))
    return {op: sorted(sizes.items()) for op, sizes in best.items()}


def _fit_or_scale(name: str, rows: list[tuple[int, float]], n: int, op: str, preset: Link) -> Link:
    """`fit_link` over two sizes or more; over one, the preset's latency and the bandwidth
    that size implies."""
    if len({b for b, _ in rows}) >= 2:
        try:
            return fit_link(name, rows, n, op)
        except ValueError:
            pass  # time not growing with size (few, noisy spans): scale the preset instead
    f = RING_FACTOR[op]
    nbytes, seconds = max(rows)
    wire_s = max(seconds - f * (n - 1) * preset.alpha_s, 1e-9)
    return Link(
        name,
        preset.alpha_s,
        f * (n - 1) / n * nbytes / wire_s / 1e9,
        f"{op} spans of one size, {preset.name}'s latency",
    )


def from_trace(trace_dir: str | Path, base: Calibration) -> Calibration:
    """`base` (the defaults for the traced world, `default_world_calibration`) with links fitted
    to the collective spans of a run's trace: on a cluster, the first steps of the job itself.
    Compute and host work are kept from `base` (tune profiles compute, plan takes FLOPs)."""
    rows = trace_rows(trace_dir)
    if "all_gather" not in rows:
        raise ValueError(f"from_trace: no all-gather spans with bytes in {trace_dir}")
    reduce_op = "all_to_all" if base.backend == "gloo" else "reduce_scatter"
    n, r = base.num_ranks, base.num_replicas
    gather = _fit_or_scale("traced all_gather", rows["all_gather"], n, "all_gather", base.gather_link)
    reduce = None
    if "reduce" in rows:
        reduce = _fit_or_scale(
            f"traced {reduce_op}", rows["reduce"], n, reduce_op, base.reduce_link or base.gather_link
        )
    replica = None
    if "all_reduce" in rows and r > 1:
        replica = _fit_or_scale(
            "traced all_reduce", rows["all_reduce"], r, "all_reduce", base.replica_link or base.gather_link
        )
    return replace(
        base, source=f"trace {trace_dir} ({base.source})", gather_link=gather, reduce_link=reduce,
        replica_link=replica, measured={"trace_rows": rows},
    )  # fmt: skip
