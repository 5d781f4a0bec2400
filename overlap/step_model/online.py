"""The model `autotune` proposes with: the simulator of `overlap plan` and `overlap tune`,
fitted to the wrapped model's own first steps.

[Note: the model fitted online]
While training, the runtime knows what the planner has to guess: the units' bytes in the order
they run, the backend and the world, and per step the step time and the exposed all-gather and
reduce-scatter waits (the span timers: CUDA events on a GPU, the host clock on CPU). It does not
know the compute per unit or the link's speed. So the tools' model for this world
(`default_world_calibration`: its links, contention and host work) is fitted to the baseline
window by two scales, solved by nested bisection on the simulator itself:

    compute   the step's compute, spread over the units by their bytes (a third forward, two
              thirds backward, as 2·N·T and 4·N·T FLOPs), until the predicted step is the measured
    links     every link's time (latency and 1/bandwidth together, the defaults' ratios between
              the collectives kept) until the predicted exposed communication (the waits plus
              the host work inside them: copy-out after a gather, the sum after a reduction) is
              the measured

for each link scale tried, the compute that makes the predicted step the measured one; then the
link scale whose exposed communication is the measured one. One scale for all links, not one per
collective: on two gloo ranks the all-gathers go through all-to-all, the reductions' link, so
the two waits do not say two things. Where the ranks exchange through shared memory
(`TunerView.shared_memory`) the exchange has no link: its waits are the pulls, host work, and the
same scale multiplies that host work with the links (which then time only codecs' exchanges).
The fitted model reproduces the baseline by
construction; what it adds is how the step moves when the knobs move (deeper prefetch, other
buckets, more reductions in flight), which the baseline alone cannot say. Every candidate of a
small grid around the baseline is simulated and those predicted fastest are proposed; the
tuner measures each before keeping it ([Note: autotune] in overlap/engine/autotune_policy.py).

Deterministic: every rank fits the same numbers (gathered, the slowest rank's) with the same
arithmetic, so every rank proposes the same settings.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

from overlap.config import OverlapConfig
from overlap.step_model.calibration import Calibration, default_world_calibration
from overlap.step_model.cost import Link, UnitCost
from overlap.step_model.fitting import solve_increasing
from overlap.step_model.simulate import Prediction
from overlap.step_model.tuning import MAX_PREFETCH_DEPTH, MAX_REDUCE_INPUTS, Knobs, Measurement, Proposal, TunerView

log = logging.getLogger("overlap.autotune")

SCALE_RANGE = (1e-3, 1e3)  # link times fitted within these multiples of the defaults'
TIE = 0.005  # predictions this close are ties: the one holding less memory first


@dataclass(frozen=True)
class Fit:
    """The two scales of [Note: the model fitted online] and what they reproduce."""

    compute_s: float
    link_scale: float
    predicted_step_s: float
    predicted_exposed_s: float

    def describe(self) -> str:
        return f"fitted compute {self.compute_s * 1e3:.1f} ms, links x{self.link_scale:.3g} the defaults'"


class StepModel:
    """The simulator for one wrapped model, fitted to its baseline window."""

    def __init__(self, view: TunerView) -> None:
        self.view = view
        self.base = base_calibration(view)
        order = [u for u in view.forward_order if u != view.root]
        self.order = ([view.root] if view.root is not None else []) + order
        total = sum(view.unit_bytes[u] for u in self.order) or 1
        self.shares = [view.unit_bytes[u] / total for u in self.order]
        self.fit: Fit | None = None

    # ------------------------------------------------------------------ the simulator
    def calibration(self, link_scale: float) -> Calibration:
        base = self.base

        def scaled(link: Link) -> Link:
            return replace(link, alpha_s=link.alpha_s * link_scale, busbw_gbps=link.busbw_gbps / link_scale)

        host = {k: h.scaled(link_scale) for k, h in base.host.items()} if base.shared_memory else base.host
        return replace(
            base,
            gather_link=scaled(base.gather_link),
            reduce_link=scaled(base.reduce_link or base.gather_link),
            replica_link=scaled(base.replica_link or base.gather_link),
            host=host,
        )

    def units(self, cal: Calibration, compute_s: float) -> list[UnitCost]:
        v = self.view
        return [
            cal.unit(f"unit{u}", v.unit_bytes[u], v.grad_bytes[u], compute_s * share / 3, compute_s * share * 2 / 3)
            for u, share in zip(self.order, self.shares)
        ]

    def predict(self, knobs: Knobs, compute_s: float, link_scale: float) -> Prediction:
        cal = self.calibration(link_scale)
        return cal.predict(
            self.units(cal, compute_s), self.config(knobs),
            root=0 if self.view.root is not None else None, record=True,
        )  # fmt: skip

    def config(self, knobs: Knobs) -> OverlapConfig:
        return OverlapConfig(
            prefetch_depth=knobs.prefetch_depth,
            max_inflight_allgather_bytes=knobs.max_inflight_allgather_bytes,
            reshard_after_forward=self.view.reshard_after_forward,
            reduce_scatter_bucket_bytes=knobs.reduce_scatter_bucket_bytes,
            keep_for_backward_bytes=knobs.keep_for_backward_bytes,
            max_reduce_inputs=knobs.max_reduce_inputs,
        )

    # ------------------------------------------------------------------ the fit
    def fit_to(self, knobs: Knobs, measured: Measurement) -> Fit:
        """The two scales that make the simulator reproduce `measured` under `knobs`."""
        step = measured.step_ms / 1e3
        waits = (measured.gather_wait_ms + measured.reduce_wait_ms) / 1e3

        def compute_for(link: float) -> float:  # the compute that makes the step `step`
            return solve_increasing(
                lambda c: self.predict(knobs, c, link).step_s, step, step * 1e-3, step * 2, log=False
            )

        def exposed_at(link: float) -> float:
            return sum(exposed(self.predict(knobs, compute_for(link), link)))

        link = solve_increasing(exposed_at, waits, *SCALE_RANGE, log=True)
        compute = compute_for(link)
        p = self.predict(knobs, compute, link)
        self.fit = Fit(compute, link, p.step_s, sum(exposed(p)))
        if self.view.folder is not None:
            self.fitted_calibration(knobs, measured).save(Path(self.view.folder) / "calibration.json")
        return self.fit

    def fitted_calibration(self, knobs: Knobs, measured: Measurement) -> Calibration:
        """The base calibration with the fitted links, to reuse (`overlap plan --calibration`)."""
        assert self.fit is not None
        return replace(
            self.calibration(self.fit.link_scale),
            source=(
                f"fitted by autotune to a {measured.step_ms:.1f} ms step with "
                f"{measured.gather_wait_ms + measured.reduce_wait_ms:.1f} ms exposed under {knobs}: "
                f"{self.fit.describe()}; from {self.base.source}"
            ),
            measured={"step_ms": measured.step_ms, "gather_wait_ms": measured.gather_wait_ms,
                      "reduce_wait_ms": measured.reduce_wait_ms, "compute_s": self.fit.compute_s,
                      "link_scale": self.fit.link_scale},
        )  # fmt: skip

    # ------------------------------------------------------------------ the proposals
    def grid(self, start: Knobs) -> list[Knobs]:
        """Every combination of prefetch depth, reductions in flight and, where the tuner may
        move them, buckets and kept bytes, around `start` (a user's in-flight cap stays)."""
        buckets = [start.reduce_scatter_bucket_bytes]
        if self.view.tune_buckets:
            b = start.reduce_scatter_bucket_bytes
            buckets = sorted({0, b, max(2 * b, 1 << 20), max(4 * b, 4 << 20)})
        keeps = [start.keep_for_backward_bytes]
        if start.max_inflight_allgather_bytes is None:
            keeps = sorted({0, start.keep_for_backward_bytes, max(2 * start.keep_for_backward_bytes, 1 << 20)})
        return [
            replace(
                start, prefetch_depth=d, reduce_scatter_bucket_bytes=b, keep_for_backward_bytes=k, max_reduce_inputs=i
            )
            for d in range(MAX_PREFETCH_DEPTH + 1)
            for i in range(1, MAX_REDUCE_INPUTS + 1)
            for b in buckets
            for k in keeps
        ]

    def propose(self, start: Knobs, measured: Measurement) -> list[Proposal]:
        """Fit to the baseline, simulate the grid; proposals fastest predicted first."""
        fit = self.fit_to(start, measured)
        scales = (fit.compute_s, fit.link_scale)
        base = self.predict(start, *scales)
        base_peak = base.peak_unsharded_bytes + base.peak_reduce_bytes
        found = []
        for knobs in self.grid(start):
            if knobs == start:
                continue
            p = self.predict(knobs, *scales)
            extra = max(0, p.peak_unsharded_bytes + p.peak_reduce_bytes - base_peak)
            found.append(Proposal(knobs, p.step_s * 1e3, base.step_s * 1e3, extra, f" ({fit.describe()})"))
        found.sort(key=lambda p: p.predicted_ms)
        return _ties_by_memory(found)


def base_calibration(view: TunerView) -> Calibration:
    """What the fit starts from: the file given (`OverlapConfig.autotune_calibration`) on this
    world's ranks, or the tools' defaults for the backend (`default_world_calibration`)."""
    if view.calibration is not None:
        cal = Calibration.load(view.calibration)
        if cal.backend != view.backend:
            log.warning(
                "overlap autotune: %s was calibrated on %s, this run is %s: using the %s defaults",
                view.calibration,
                cal.backend,
                view.backend,
                view.backend,
            )
        else:
            return replace(cal, num_ranks=view.num_ranks, num_replicas=view.num_replicas)
    return default_world_calibration(
        view.num_ranks, view.backend, None, num_replicas=view.num_replicas, shared_memory=view.shared_memory
    )


def exposed(p: Prediction) -> tuple[float, float]:
    """Predicted exposed all-gather and reduction seconds, as the runtime's stall spans count
    them: the waits and the host work inside them (copy-out after a gather, the sum after a
    reduction)."""
    gather = reduce = 0.0
    for lane, name, t0, t1 in p.events:
        if (lane == "wait" and name.startswith("gather ")) or (lane == "host" and name.startswith("copy-out ")):
            gather += t1 - t0
        elif (lane == "wait" and name.startswith(("reduce [", "all-reduce ["))) or (
            lane == "host" and name.startswith("sum [")
        ):
            reduce += t1 - t0
    return gather, reduce


def _ties_by_memory(found: list[Proposal]) -> list[Proposal]:
    """Within TIE of the one before, the setting that holds less memory first."""
    out: list[Proposal] = []
    rest = list(found)
    while rest:
        lead = rest[0].predicted_ms
        tied = [p for p in rest if p.predicted_ms <= lead * (1 + TIE)]
        pick = min(tied, key=lambda p: (p.extra_bytes, p.predicted_ms))
        out.append(pick)
        rest.remove(pick)
    return out
