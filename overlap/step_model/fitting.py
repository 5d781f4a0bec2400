"""The arithmetic that turns measurements into the simulator's terms: a link fitted to a
collective's times, the throughput of collectives sharing a link, the share of compute lost to
them, and the bisection that solves the model for one measured number. Pure functions of
numbers; `Calibration` (calibration.py) holds what they produce.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

from overlap.step_model.cost import Link
from overlap.step_model.simulate import Contention, batch_time_s

RING_FACTOR = {"all_gather": 1, "reduce_scatter": 1, "all_to_all": 1, "all_reduce": 2}
"""Ring passes of each collective ([Note: alpha-beta ring model] in cost.py)."""


def fit_link(name: str, rows: Sequence[tuple[float, float]], world_size: int, op: str = "all_gather") -> Link:
    """Least-squares fit of `(bytes, seconds)` rows of one collective to the cost model's ring
    form t = f·((n-1)·α + (n-1)/n · S / B), f = 2 for all-reduce, 1 otherwise ([Note: alpha-beta
    ring model] in cost.py). A negative intercept (noise at small sizes) is clamped to α = 0."""
    n, f = world_size, RING_FACTOR.get(op)
    if f is None:
        raise ValueError(f"fit_link({name}): unknown collective {op!r}")
    if n < 2 or len(rows) < 2:
        raise ValueError(f"fit_link({name}): need world_size >= 2 and >= 2 sizes, got {n}, {list(rows)}")
    xs = [f * (n - 1) / n * b for b, _ in rows]
    ys = [t for _, t in rows]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    if slope <= 0:
        raise ValueError(f"fit_link({name}): time does not grow with size: {list(rows)}")
    alpha = max(0.0, my - slope * mx) / (f * (n - 1))
    return Link(name, alpha, 1.0 / slope / 1e9, f"least-squares fit of {len(rows)} sizes ({op}, {n} ranks)")


def fluid_queue_s(solo_s: Sequence[float], lanes: int, throughput: float) -> float:
    """Seconds until collectives of these solo times, all issued at once, have finished under
    the simulator's fluid model with this link throughput (`simulate.batch_time_s`)."""
    return batch_time_s(list(solo_s), lanes, Contention(concurrent_throughput=throughput))


def concurrent_throughput(solo_s: Sequence[float], measured_s: float, lanes: int = 2) -> float:
    """The `Contention.concurrent_throughput` that makes `fluid_queue_s` take `measured_s` for
    these collectives (bisection; it falls as the throughput rises), clamped to [1, lanes]:
    1 when they share one link, `lanes` when they run independently."""
    if min(solo_s, default=0.0) <= 0 or measured_s <= 0:
        raise ValueError(f"concurrent_throughput: times must be > 0, got {list(solo_s)}, {measured_s}")
    lo, hi = 1.0, float(lanes)
    if measured_s >= fluid_queue_s(solo_s, lanes, lo):
        return lo
    if measured_s <= fluid_queue_s(solo_s, lanes, hi):
        return hi
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if fluid_queue_s(solo_s, lanes, mid) > measured_s else (lo, mid)
    return (lo + hi) / 2


def contention_share(alone_s: float, loaded_s: float) -> float:
    """The share of each second of concurrent communication that compute loses: compute that
    takes `alone_s` alone takes `loaded_s` beside a collective loop, so it runs at alone/loaded
    of its speed. Clamped to [0, 0.95]."""
    if alone_s <= 0 or loaded_s <= 0:
        raise ValueError(f"contention_share: times must be > 0, got {alone_s}, {loaded_s}")
    return min(0.95, max(0.0, 1.0 - alone_s / loaded_s))


SOLVE_BISECTIONS = 12


def solve_increasing(f: Callable[[float], float], target: float, lo: float, hi: float, *, log: bool) -> float:
    """x in [lo, hi] with f(x) = target for an increasing f, by bisection (the end it is
    beyond, when it is)."""
    if f(lo) >= target:
        return lo
    if f(hi) <= target:
        return hi
    for _ in range(SOLVE_BISECTIONS):
        mid = (lo * hi) ** 0.5 if log else (lo + hi) / 2
        if f(mid) < target:
            lo = mid
        else:
            hi = mid
    return (lo * hi) ** 0.5 if log else (lo + hi) / 2
