"""Re-predict stored plan_validate runs with the current model, without measuring anything.

    python benchmarks/plan_repredict.py benchmarks/data/plan-validate-2026-12-04/pv_all_r5.json \\
        benchmarks/data/plan-validate-2026-12-04-epyc/pv_paired_r5.json --fit-host "prefetch_depth=2"

A plan_validate JSON keeps every round's calibration and, per config, the measured steps with the
compute profiled beside each (per step; files before 2026-12-04 13:00 kept one profile per round's
segment, as forward and backward totals). This script predicts every config again from those, with
the simulator as it is now, and prints each world's signed errors: a change to the model is
checked against every machine's data, Intel and AMD alike, before a 50-minute run on the one
machine at hand. The stored compute is totals, not per layer: each step's profile is its round's
calibration scaled to them (W1's layers are alike, so little is lost).

`--fit-host CONFIG` also fits one factor on every host cost (`HostCosts.scaled`) to CONFIG's stored
steps, the factor that makes its median predicted step the measured median, and gives the other
configs' errors under it.

[Note: host work in a step]
`measure_host` times the runtime's verbs alone, the other ranks waiting in a barrier; in a step
they run beside the other ranks' compute and gloo's copies. Could one factor on the host work
explain the per-machine bias on 2 ranks? Replayed on the Intel run of 2026-12-04 (`pv_all_r5`)
and the AMD EPYC run `pv_paired_r5`, the factor fitted to the prefetch_depth=2 steps was
1.26-1.58 on Intel and 0.62-1.30 on EPYC and took every world of both within +-1.6%. It does
not hold up: on the other stored runs of the same machines the fitted factor for loopback 2
was 0.98 (Intel, `pv_all_beside`), 0.28 and 0.30 (EPYC, `pv_amd_r5`, `pv_lb_paired_r5`), and
it made their errors worse. A step time is too blunt for it: a step 4% slower asks for twice the
host work on loopback 4, 1.6x on loopback 2. Fitted inside the calibration, from 3 steps a round, it ranged
0.5-2.0 (its clamp) within one world and the validation got worse (loopback 2 +4.3%;
`pv_hostfit_r5`, commit 8215219, reverted). RESULTS.md, "A host factor, tried and removed".
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's overlap first

from overlap.config import OverlapConfig
from overlap.step_model.calibration import Calibration, predict_measured, solve_increasing, with_compute

HOST_SCALE_RANGE = (0.2, 5.0)
"""Where `--fit-host` looks for the factor."""


def with_host(cal: Calibration, k: float) -> Calibration:
    """`cal` with every host cost times `k` ([Note: host work in a step])."""
    return replace(cal, host={path: h.scaled(k) for path, h in cal.host.items()})


def beside(cal: Calibration, compute_ms: float | list[float]) -> Calibration:
    """`cal` with its per-layer compute scaled to a stored profile: a total (ms), or forward
    and backward totals (older files)."""
    assert cal.compute is not None
    c = cal.compute
    fwd, bwd = sum(c.forward_s) * 1e3, sum(c.backward_s) * 1e3
    if isinstance(compute_ms, list):
        kf, kb = compute_ms[0] / fwd, compute_ms[1] / bwd
    else:
        kf = kb = compute_ms / (fwd + bwd)
    return with_compute(cal, [x * kf for x in c.forward_s], [x * kb for x in c.backward_s])


def observations(row: dict[str, Any]) -> tuple[list[tuple[int, Any]], float]:
    """((round, compute beside) per prediction, the measured median ms) of a stored row."""
    if "step_ms" in row:  # a profile beside every step
        obs = [(r, cb) for r, steps in enumerate(row["compute_beside_ms"]) for cb in steps]
        return obs, statistics.median(ms for steps in row["step_ms"] for ms in steps)
    return list(enumerate(row["compute_beside_ms"])), statistics.median(row["round_ms"])


def error(cals: list[Calibration], row: dict[str, Any], host_scale: float | None = None) -> float:
    """Median predicted / median measured - 1 for one stored row (`host_scale`: every host
    cost times it)."""
    config = OverlapConfig(**row["overrides"])
    obs, measured_ms = observations(row)
    predicted = []
    for r, compute in obs:
        cal = cals[r] if host_scale is None else with_host(cals[r], host_scale)
        predicted.append(predict_measured(beside(cal, compute), config).step_s * 1e3)
    return statistics.median(predicted) / measured_ms - 1


def fit_host(cals: list[Calibration], row: dict[str, Any]) -> float:
    """The host factor that makes `row`'s median predicted step its measured median."""
    return solve_increasing(lambda k: error(cals, row, k), 0.0, *HOST_SCALE_RANGE, log=True)


def repredict(result: dict[str, Any], fit_config: str | None = None) -> dict[str, Any]:
    """One stored world: every config's error as stored, and with `fit_config`'s fitted factor
    (the others' errors; the fitted config's own is 0 by construction)."""
    dropped = [c.get("host_scale") for c in result["calibration_rounds"] if "host_scale" in c]
    # pv_hostfit_r5 (commit 8215219) fitted a host factor per round, since removed: replayed at 1x
    cals = [
        Calibration.from_dict({k: v for k, v in c.items() if k != "host_scale"}) for c in result["calibration_rounds"]
    ]
    for row in result["rows"]:
        if "compute_beside_ms" not in row:
            raise ValueError(f"{result['world']}, {row['config']}: no compute stored beside the steps "
                             "(a plan_validate run before 2026-12-04): nothing to predict them with")  # fmt: skip
        if len(row["compute_beside_ms"]) != len(cals):
            raise ValueError(f"{result['world']}, {row['config']}: {len(row['compute_beside_ms'])} rounds of steps, "
                             f"{len(cals)} calibrations")  # fmt: skip
    out: dict[str, Any] = {"world": result["world"], "errors": {r["config"]: error(cals, r) for r in result["rows"]},
                           "dropped_host_scale": dropped}  # fmt: skip
    if fit_config is not None:
        row = next((r for r in result["rows"] if r["config"] == fit_config), None)
        if row is None:
            raise ValueError(f"{result['world']}: no config {fit_config!r} stored")
        k = fit_host(cals, row)
        out["host_scale"] = k
        out["fitted_errors"] = {r["config"]: error(cals, r, k) for r in result["rows"] if r is not row}
    return out


def _line(label: str, errors: dict[str, float]) -> str:
    values = list(errors.values())
    return (f"    {label:<22} mean signed {statistics.fmean(values) * 100:+5.1f}%, max |error| "
            f"{max(abs(e) for e in values) * 100:4.1f}%:  " + " ".join(f"{e * 100:+.1f}" for e in values))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", metavar="JSON", help="plan_validate.py --json files")
    parser.add_argument(
        "--fit-host", metavar="CONFIG", default=None, help="fit a factor on the host work to this config's steps"
    )
    args = parser.parse_args(argv)
    for path in args.files:
        data = json.loads(Path(path).read_text())
        print(f"{path} ({data.get('cpu', 'machine not recorded')})")
        for result in data["results"]:
            res = repredict(result, args.fit_host)
            dropped = res["dropped_host_scale"]
            note = (
                f" (the stored host factors {', '.join(f'{k:.2f}' for k in dropped)} dropped: replayed at 1x)"
                if dropped
                else ""
            )
            print(f"  {res['world']}{note}")
            print(_line("as stored", res["errors"]))
            if args.fit_host is not None:
                print(_line(f"host x{res['host_scale']:.2f} (others)", res["fitted_errors"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
