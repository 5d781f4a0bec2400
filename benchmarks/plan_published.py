"""`overlap plan`'s run model against published training runs (benchmarks/published_runs.json).

    python benchmarks/plan_published.py [--json out.json] [--rows ID_SUBSTRING]

Every row of the data file is one published run: its configuration as the source states it,
the source table and commit, and the published tokens/s per GPU (or TFLOP/s or MFU, converted by
the source's own FLOP formula, written out in the file's `sources`). Each is predicted from its
configuration and the datasheet presets alone (no calibration), and the table prints predicted /
published and what the model lacks for the row. A row the model cannot express counts as a miss.

The summary gives, for the rows the model's constants were set against and separately for the
rows kept aside (`held_out`): mean |error|, the share within 10% and 15%, the worst row, and the
mean signed error per source. Scale-out: within each configuration published at several sizes,
the smallest size calibrates (its predicted / published ratio divides the larger sizes').
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from overlap.tools.plan.run_spec import ModelShape, RunSpec
from overlap.tools.plan.run_step import calibrate_compute, predict_run

DATA = Path(__file__).with_name("published_runs.json")
PEAK_BF16_TFLOPS = {"h100-sxm": 989.4, "a100-80gb": 312.0, "a100-40gb": 312.0}
"""The peaks the sources' MFU figures are relative to (their datasheets)."""


def published_tokens_per_s(row: dict[str, Any], shape: ModelShape, spec: RunSpec, source: str) -> float:
    """The published figure as tokens/s per GPU, by the source's conversion (see `sources`)."""
    pub = row["published"]
    if "tokens_per_s_per_gpu" in pub:
        return float(pub["tokens_per_s_per_gpu"])
    tflops = pub["tflops_per_gpu"] if "tflops_per_gpu" in pub else pub["mfu"] * PEAK_BF16_TFLOPS[spec.gpu]
    L, h, s, V = shape.num_layers, shape.hidden, spec.seq_len, shape.vocab_size
    if source == "megatron-2021":  # Narayanan et al. 2021, eq. 3, per token (recomputation counted)
        flops = 96 * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    else:  # Megatron-Core num_floating_point_operations for a GPT block, per token
        flops = 72 * L * h * h + 12 * L * h * s + 6 * V * h
    return tflops * 1e12 / flops


def load_rows(path: Path = DATA) -> tuple[dict[str, Any], list[tuple[dict[str, Any], RunSpec | None, str]]]:
    """(data, [(row, spec or None, why not)]) for every row of the data file."""
    data = json.loads(path.read_text())
    out = []
    for row in data["rows"]:
        fields = dict(data["models"][row["model"]])
        fields.pop("source", None)
        shape = ModelShape(**fields)
        run = dict(row["run"])
        run["notes"] = tuple(run.get("notes", ()))
        try:
            out.append((row, RunSpec(model=shape, **run), ""))
        except (ValueError, TypeError) as e:
            out.append((row, None, str(e)))
    return data, out


def summary(errors: list[float]) -> dict[str, float]:
    """Statistics of relative errors (predicted / published - 1)."""
    if not errors:
        return {}
    mags = [abs(e) for e in errors]
    return {"rows": len(errors), "mean_abs": statistics.fmean(mags), "median_abs": statistics.median(mags),
            "within_10": sum(m <= 0.10 for m in mags) / len(mags), "within_15": sum(m <= 0.15 for m in mags) / len(mags),
            "worst": max(mags), "mean_signed": statistics.fmean(errors)}  # fmt: skip


def scale_out(results: list[dict[str, Any]], specs: dict[str, RunSpec] | None = None) -> list[float]:
    """Errors of the larger sizes of each configuration once its smallest size calibrates: the
    kernels' seconds scaled to match it (`calibrate_compute`, with `specs`), or without specs the
    whole prediction divided by the smallest size's ratio."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in results:
        if r["predicted"] is None:
            continue
        key = json.dumps(
            {k: v for k, v in r["run"].items() if k not in ("num_gpus", "global_batch", "notes")}, sort_keys=True
        )
        groups[r["source"] + r["model"] + key].append(r)
    errors = []
    for rows in groups.values():
        if len({r["run"]["num_gpus"] for r in rows}) < 2:
            continue
        rows.sort(key=lambda r: r["run"]["num_gpus"])
        if specs is None:
            base = rows[0]["predicted"] / rows[0]["published"]
            errors += [r["predicted"] / base / r["published"] - 1 for r in rows[1:]]
            continue
        scale = calibrate_compute(specs[rows[0]["id"]], rows[0]["published"])
        errors += [
            predict_run(specs[r["id"]], compute_scale=scale).tokens_per_s_per_gpu / r["published"] - 1 for r in rows[1:]
        ]
    return errors


def fmt(stats: dict[str, float]) -> str:
    if not stats:
        return "no rows"
    return (f"{stats['rows']} rows: mean |error| {100 * stats['mean_abs']:.1f}%, median {100 * stats['median_abs']:.1f}%, "
            f"within 10% {100 * stats['within_10']:.0f}%, within 15% {100 * stats['within_15']:.0f}%, "
            f"worst {100 * stats['worst']:.1f}%, mean signed {100 * stats['mean_signed']:+.1f}%")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, default=None, help="write per-row results and the summary here")
    parser.add_argument("--rows", default=None, help="only rows whose id contains this")
    parser.add_argument("--quiet", action="store_true", help="summary only")
    args = parser.parse_args()
    data, rows = load_rows()
    results = []
    if not args.quiet:
        print(f"{'row':44} {'published':>10} {'predicted':>10} {'error':>7}  what the model lacks")
    for row, spec, why in rows:
        if args.rows and args.rows not in row["id"]:
            continue
        result = dict(id=row["id"], source=row["source"], model=row["model"], held_out=row["held_out"], run=row["run"])
        if spec is None:
            result.update(published=None, predicted=None, error=None, lacks=[f"cannot express: {why}"])
        else:
            pred = predict_run(spec)
            pub = published_tokens_per_s(row, spec.model, spec, row["source"])
            result.update(published=pub, predicted=pred.tokens_per_s_per_gpu, error=pred.tokens_per_s_per_gpu / pub - 1,
                          lacks=pred.lacks, step_s=pred.step_s, compute_s=pred.compute_s, dp_exposed_s=pred.dp_exposed_s,
                          tp_exposed_s=pred.tp_exposed_s, cp_exposed_s=pred.cp_exposed_s, bubble_s=pred.pp_bubble_s)  # fmt: skip
        results.append(result)
        if not args.quiet:
            mark = "*" if row["held_out"] else " "
            pub_text = "-" if result["published"] is None else f"{result['published']:,.0f}"
            pred_text = "-" if result["predicted"] is None else f"{result['predicted']:,.0f}"
            err = "miss" if result["error"] is None else f"{100 * result['error']:+.1f}%"
            print(
                f"{mark}{row['id'][:43]:43} {pub_text:>10} {pred_text:>10} {err:>7}  {'; '.join(result['lacks'])[:110]}"
            )
    out: dict[str, Any] = {}
    print("\n(* held out)")
    for label, keep in (("fitted", False), ("held out", True), ("all", None)):
        chosen = [r for r in results if keep is None or r["held_out"] == keep]
        errors = [1.0 if r["error"] is None else r["error"] for r in chosen]  # a miss counts as 100% off
        out[label] = summary(errors)
        print(f"{label:9} {fmt(out[label])}")
        worst = max(chosen, key=lambda r: 1.0 if r["error"] is None else abs(r["error"]), default=None)
        if worst is not None:
            print(f"          worst: {worst['id']}")
    print("per source (mean signed, mean |error|):")
    out["per_source"] = {}
    for source in data["sources"]:
        errs = [1.0 if r["error"] is None else r["error"] for r in results if r["source"] == source]
        if errs:
            out["per_source"][source] = summary(errs)
            print(
                f"  {source:26} {len(errs):3} rows  {100 * statistics.fmean(errs):+6.1f}%  {100 * statistics.fmean(map(abs, errs)):5.1f}%"
            )
    moe_models = {name for name, fields in data["models"].items() if fields.get("moe")}
    dense_sources = [(f"{source} (dense)", lambda r, s=source: r["source"] == s and r["model"] not in moe_models)
                     for source in data["sources"]]  # fmt: skip
    for label, keep in dense_sources:
        errs = [1.0 if r["error"] is None else r["error"] for r in results if keep(r)]
        if errs and len(errs) < len([r for r in results if r["source"] == label.split()[0]]):
            print(
                f"  {label:26} {len(errs):3} rows  {100 * statistics.fmean(errs):+6.1f}%  {100 * statistics.fmean(map(abs, errs)):5.1f}%"
            )
    print("by GPU and by parallelism (all rows):")
    out["per_group"] = {}
    for label, keep in [
        *((f"gpu {g}", (lambda r, g=g: r["run"]["gpu"] == g)) for g in sorted({r["run"]["gpu"] for r in results})),
        ("FSDP/ZeRO only", lambda r: all(r["run"].get(k, 1) == 1 for k in ("tp", "pp", "cp", "ep"))),
        (
            "3-D (TP/PP, no CP)",
            lambda r: (
                r["run"].get("cp", 1) == 1
                and r["run"].get("ep", 1) == 1
                and (r["run"].get("tp", 1) > 1 or r["run"].get("pp", 1) > 1)
            ),
        ),
        ("dense (no experts)", lambda r: r["model"] not in moe_models),
        ("dense, held out", lambda r: r["model"] not in moe_models and r["held_out"]),
        ("expert parallel (MoE)", lambda r: r["run"].get("ep", 1) > 1),
        ("expert parallel, held out", lambda r: r["run"].get("ep", 1) > 1 and r["held_out"]),
        ("context parallel", lambda r: r["run"].get("cp", 1) > 1),
    ]:
        errs = [1.0 if r["error"] is None else r["error"] for r in results if keep(r)]
        out["per_group"][label] = summary(errs)
        print(f"  {label:22} {fmt(out['per_group'][label])}")
    specs = {row["id"]: spec for row, spec, _ in rows if spec is not None}
    out["scale_out"] = summary(scale_out(results, specs))
    print(f"scale-out (the smallest size of a configuration calibrates the kernels): {fmt(out['scale_out'])}")
    if args.json is not None:
        args.json.write_text(json.dumps({"summary": out, "rows": results}, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
