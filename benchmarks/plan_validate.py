"""Does the planner's simulator predict W1's real step? Calibrate, measure, compare.

    python benchmarks/plan_validate.py --json out/plan_validate.json     # loopback and 1gbit
    python benchmarks/plan_validate.py --links loopback --rounds 2 --steps 2   # a quick look

W1 (8 x TransformerEncoderLayer(512, ff 2048), batch 4 x 128, fp32, AdamW) on 2 gloo ranks x 1
thread, one world per link: `loopback`, and `1gbit` (each rank in a network namespace behind
tc tbf, overlap/tools/bench/link.py; needs root and iproute2). In each world, `--rounds` rounds of:

1. Calibrate, from measurements that are not the steps validated below:
   link        all-gather and all-to-all of 1, 4, 12 and 24 MiB (what W1 moves), timed
               as `overlap bench comm` does (its `measure`); an alpha-beta least-squares fit
               per op (`fit_link`): gathers use the all-gather fit, gradient reductions (an
               all-to-all on gloo) the all-to-all fit
   compute     forward and backward per layer of the plain (unwrapped) W1, timed by hooks,
               both ranks computing at once as in training (each rank alone is printed once,
               for comparison); the slower rank's median, since ranks meet in every collective
   optimizer   AdamW's step on a wrapped W1's shards, timed alone
   host        the training thread's work around one unit's collectives, timed on the
               runtime's own verbs driven by hand (`measure_host`): gather issue (encode),
               copy-out (decode), reduction packing (encode), summing (decode) and scaling
   contention  one layer's forward+backward alone and beside a loop of one-layer all-gathers:
               the share of speed compute loses (`contention_share`); the all-gather alone and
               beside that compute: how much longer comm takes (stretch)
   concurrency 8 one-layer all-gathers and all-to-alls in turn, issued at once (gloo runs two
               at a time, its lanes kept busy as a link-bound step keeps them): the link's
               throughput with two in flight, the value with which the fluid model takes the
               measured time (`concurrent_throughput`)
2. Time every config of `configs()` (all wrapped up front), in rotated order: a warm-up step
   and `--steps` timed steps each (barrier before each; the slowest rank's time; the median).
The table gives the median over rounds and the min-max of the round medians, and predictions
from the median calibration (`median_calibration`) by the simulator, two ways:
   planner     the model as `overlap tune` uses it: one link fit for every collective, gloo's
               two lanes at full speed each, contention charged additively on all comm time
   host-aware  the reduction's own link fit, the measured host work on the training thread
               (UnitCost.*_host_s) and the fluid contention model (`Contention`: compute slowed
               while comm is in flight, comm stretched while compute runs, collectives in
               flight sharing the link in issue order); [Note: fluid clock] in
               overlap/tools/plan/simulate.py
Calibrating in every round puts calibration and measurement under the same machine load.

`--json PATH` writes the calibrations (median and per round), measurements and predictions.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from overlap.tools.plan.cost import Link, Topology, UnitCost, ring_time_s

LINKS = ("loopback", "1gbit")
LINK_SIZES_BYTES = tuple(k * 2**20 for k in (1, 4, 12, 24))
"""Up to what W1 moves: 12 MiB (a layer) and 24 MiB (two). A 32 MiB all-gather measured up to
2x slower per byte than 16 MiB on loopback here, and a fit is only as good as its range."""
CONCURRENCY_OPS = 8
PROFILE_WARMUP = 1


# ---------------------------------------------------------------------------------------------
# calibration arithmetic (pure; tests/test_plan_validate.py)


def fit_link(name: str, rows: list[tuple[int, float]], world_size: int) -> Link:
    """Least-squares fit of `(bytes, seconds)` rows of one collective to the cost model's ring
    form t = (n-1)·α + (n-1)/n · S / B ([Note: alpha-beta ring model] in overlap/tools/plan/cost.py).
    A negative intercept (noise at small sizes) is clamped to α = 0."""
    n = world_size
    if n < 2 or len(rows) < 2:
        raise ValueError(f"fit_link({name}): need world_size >= 2 and >= 2 sizes, got {n}, {rows}")
    xs = [(n - 1) / n * b for b, _ in rows]
    ys = [t for _, t in rows]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    if slope <= 0:
        raise ValueError(f"fit_link({name}): time does not grow with size: {rows}")
    alpha = max(0.0, my - slope * mx) / (n - 1)
    return Link(name, alpha, 1.0 / slope / 1e9, f"least-squares fit of {len(rows)} sizes")


def fluid_queue_s(solo_s: list[float], lanes: int, throughput: float) -> float:
    """Seconds until collectives of these solo times, all issued at once, have finished under
    the simulator's fluid model with this link throughput (`simulate.batch_time_s`)."""
    from overlap.tools.plan.simulate import Contention, batch_time_s

    return batch_time_s(solo_s, lanes, Contention(concurrent_throughput=throughput))


def concurrent_throughput(solo_s: list[float], measured_s: float, lanes: int = 2) -> float:
    """The `Contention.concurrent_throughput` that makes `fluid_queue_s` take `measured_s` for
    these collectives (bisection; it falls as the throughput rises), clamped to [1, lanes]:
    1 when they share one link, `lanes` when they run independently."""
    if min(solo_s, default=0.0) <= 0 or measured_s <= 0:
        raise ValueError(f"concurrent_throughput: times must be > 0, got {solo_s}, {measured_s}")
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


@dataclass(frozen=True, kw_only=True)
class HostCosts:
    """Training-thread seconds around the collectives of one W1 layer's worth of bytes; a unit
    of k layers costs k times as much (the work is linear in bytes)."""

    gather_issue_s: float
    regather_issue_s: float
    """A backward re-gather's issue: it resends the forward's encoded bytes."""
    gather_wait_s: float
    reduce_issue_s: float
    reduce_wait_s: float


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """Everything the predictions use, measured in one world."""

    link: str
    world_size: int
    layer_numel: int
    gather_link: Link
    reduce_link: Link
    forward_s: list[float]
    """Per W1 layer, both ranks computing at once: the larger of the ranks' medians (ranks
    meet in every collective, so the slower one paces the step). Likewise host and optimizer."""
    backward_s: list[float]
    optimizer_s: float
    host: dict[str, HostCosts]
    """Keyed by codec path: "none", or "<param codec>/<grad codec>"."""
    cpu_contention: float
    """Share of its speed compute loses while a collective runs (`contention_share`)."""
    comm_stretch: float
    """A one-layer all-gather's time beside compute / alone."""
    concurrent_throughput: float
    """Throughput of an all-gather and an all-to-all at once, relative to one alone."""
    contention_ms: tuple[float, ...]
    """(layer compute alone, beside all-gathers, all-gather alone, beside compute)."""
    concurrency_ms: tuple[float, ...]
    """(one-layer all-gather, all-to-all: the fitted cost model's solo times; the measured
    batch of `CONCURRENCY_OPS` of them issued at once)."""
    link_rows: dict[str, list[tuple[int, float]]] = field(default_factory=dict)

    def topology(self) -> Topology:
        return Topology(
            self.world_size, self.world_size, self.gather_link, self.gather_link,
            reduce_link=self.reduce_link,
        )  # fmt: skip


def median_calibration(cals: list[Calibration]) -> Calibration:
    """The per-round calibrations combined: the median of every measured number (element by
    element for lists and tuples, field by field for links and host costs)."""
    if not cals:
        raise ValueError("median_calibration: no calibrations")

    def median(values: list[Any]) -> Any:
        first = values[0]
        if isinstance(first, (bool, int, str)):
            return first
        if isinstance(first, float):
            return statistics.median(values)
        if isinstance(first, (list, tuple)):
            return type(first)(median(list(column)) for column in zip(*values, strict=True))
        if isinstance(first, dict):
            return {k: median([v[k] for v in values]) for k in first}
        if isinstance(first, Link):
            return Link(f"{first.name} (median of {len(values)})", median([v.alpha_s for v in values]),
                        median([v.busbw_gbps for v in values]), first.source)  # fmt: skip
        if isinstance(first, HostCosts):
            return HostCosts(**{f.name: median([getattr(v, f.name) for v in values]) for f in fields(first)})
        raise TypeError(f"median_calibration: cannot combine {type(first).__name__}")

    out = {f.name: median([getattr(c, f.name) for c in cals]) for f in fields(Calibration) if f.name != "link_rows"}
    return Calibration(**out, link_rows=cals[0].link_rows)


def codec_path(overrides: dict[str, Any]) -> str:
    p, g = overrides.get("param_compression"), overrides.get("grad_compression")
    return "none" if p is None and g is None else f"{p}/{g}"


def build_units(cal: Calibration, overrides: dict[str, Any], host_aware: bool) -> list[UnitCost]:
    """The simulator's units for W1 under `overrides` (fp32; layers merged as overlap.wrap
    merges them), with the calibrated compute, codec wire bytes and (host-aware) host work."""
    from overlap.compression import make_grad_codec, make_param_codec
    from overlap.engine.units import group_units

    config = _config(overrides)
    names = [str(i) for i in range(len(cal.forward_s))]
    groups = group_units(names, dict.fromkeys(names, cal.layer_numel), config.min_unit_numel)
    param_codec = make_param_codec(config.param_compression, block_size=config.compression_block_size)
    grad_codec = make_grad_codec(config.grad_compression, block_size=config.compression_block_size)
    host = cal.host[codec_path(overrides)]
    units = []
    for group in groups:
        k, layers = len(group), [int(i) for i in group]
        numel = k * cal.layer_numel
        units.append(
            UnitCost(
                f"layers.{group[0]}" if k == 1 else f"layers.{group[0]}-{group[-1]}",
                numel * 4,
                numel * 4,
                sum(cal.forward_s[i] for i in layers),
                sum(cal.backward_s[i] for i in layers),
                gather_wire_bytes=param_codec.wire_bytes(numel, torch.float32),
                reduce_wire_bytes=grad_codec.wire_bytes(numel, torch.float32),
                gather_issue_host_s=k * host.gather_issue_s if host_aware else 0.0,
                backward_gather_issue_host_s=k * host.regather_issue_s if host_aware else 0.0,
                gather_wait_host_s=k * host.gather_wait_s if host_aware else 0.0,
                reduce_issue_host_s=k * host.reduce_issue_s if host_aware else 0.0,
                reduce_wait_host_s=k * host.reduce_wait_s if host_aware else 0.0,
            )
        )
    return units


def predict_ms(cal: Calibration, overrides: dict[str, Any], host_aware: bool) -> float:
    """The simulator's steady step for W1 under `overrides`, in ms: "planner" (host_aware
    False) as `overlap tune` models a step (one link fit, additive contention, no host work),
    or host-aware (all-to-all fit for reductions, host work, the fluid contention model)."""
    from overlap.tools.plan.simulate import Contention, simulate

    units = build_units(cal, overrides, host_aware)
    if not host_aware:
        topo = replace(cal.topology(), reduce_link=None)
        p = simulate(units, _config(overrides), topo, backend="gloo", optimizer_s=cal.optimizer_s,
                     cpu_contention=cal.cpu_contention)  # fmt: skip
        return p.step_s * 1e3
    contention = Contention(
        compute_share_lost=cal.cpu_contention,
        comm_stretch=cal.comm_stretch,
        concurrent_throughput=cal.concurrent_throughput,
    )
    p = simulate(units, _config(overrides), cal.topology(), backend="gloo",
                 optimizer_s=cal.optimizer_s, contention=contention)  # fmt: skip
    return p.step_s * 1e3


def _config(overrides: dict[str, Any]) -> Any:
    from overlap.config import OverlapConfig

    return OverlapConfig(**overrides)


def configs(layer_numel: int) -> dict[str, dict[str, Any]]:
    """The validated configs: OverlapConfig overrides by name."""
    layer_bytes = 4 * layer_numel
    return {
        "default": {},
        "prefetch_depth=0": {"prefetch_depth": 0},
        "prefetch_depth=2": {"prefetch_depth": 2},
        "bucket 2 layers": {"reduce_scatter_bucket_bytes": int(1.5 * layer_bytes)},
        "2 layers/unit": {"min_unit_numel": 2 * layer_numel},
        "no reshard (ZeRO-2)": {"reshard_after_forward": False},
        "int8 params+grads, EF": {"param_compression": "int8", "grad_compression": "int8", "error_feedback": True},
    }


# ---------------------------------------------------------------------------------------------
# measurements (every rank calls these in the same order)


@dataclass(frozen=True, kw_only=True)
class ValidateConfig:
    """One validation run. Defaults: about 7 minutes on a quiet 2-core machine."""

    links: tuple[str, ...] = LINKS
    """"loopback" or an emulated link's text ("1gbit", "1gbit,200us": overlap.tools.bench.link)."""
    rounds: int = 3
    steps: int = 3
    """Timed steps per config per round (after one warm-up step)."""
    profile_steps: int = 2
    """Plain W1 forward+backward steps profiled per round (after one warm-up)."""
    json_path: str | None = None

    def __post_init__(self) -> None:
        from overlap.tools.bench.link import LinkSpec

        if min(self.rounds, self.steps, self.profile_steps) < 1:
            raise ValueError("ValidateConfig: rounds, steps and profile_steps must be >= 1")
        if not self.links:
            raise ValueError("ValidateConfig.links: give at least one link")
        for link in self.links:
            if link != "loopback":
                LinkSpec.parse(link)  # fail here, not in the ranks


def _w1() -> Any:
    from overlap.tools.bench.step import StepBenchConfig

    return StepBenchConfig()


def _mean_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def _max_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def calibrate_links(world_size: int) -> tuple[Link, Link, dict[str, list[tuple[int, float]]]]:
    from overlap.tools.bench.comm import iters_for, measure

    rows: dict[str, list[tuple[int, float]]] = {}
    for op in ("all_gather", "all_to_all"):
        rows[op] = []
        for size in LINK_SIZES_BYTES:
            iters, warmup = iters_for(size, 8, 2, 48 * 2**20)
            row = measure(op, size, torch.float32, False, iters=iters, warmup=warmup,
                          device=torch.device("cpu"))  # fmt: skip
            assert row is not None and row.num_wrong == 0, f"rank {dist.get_rank()}: {op} {row}"
            rows[op].append((row.bytes, row.time_us * 1e-6))
    gather = fit_link("measured all_gather", rows["all_gather"], world_size)
    reduce = fit_link("measured all_to_all", rows["all_to_all"], world_size)
    return gather, reduce, rows


def profile_compute(model: nn.Module, batch: tuple[torch.Tensor, ...], steps: int) -> tuple[list[float], list[float]]:
    """Per-layer forward and backward seconds of the plain model (medians over `steps`).

    Forward: module pre/post hooks. Backward: a hook on each layer's output fires when its
    gradient is ready, i.e. when that layer's backward starts; it ends when the previous
    layer's output gradient is ready (the first layer's at the end of backward). The loss's own
    forward and backward count to the last layer."""
    layers = list(model.children())
    fwd: list[list[float]] = [[] for _ in layers]
    bwd: list[list[float]] = [[] for _ in layers]
    marks: dict[str, float] = {}

    def arm(i: int, layer: nn.Module) -> list[Any]:
        def pre(_m: nn.Module, _a: Any) -> None:
            marks[f"f{i}"] = time.perf_counter()

        def post(_m: nn.Module, _a: Any, out: torch.Tensor) -> None:
            marks[f"f{i}_end"] = time.perf_counter()
            out.register_hook(lambda g: marks.__setitem__(f"b{i}", time.perf_counter()))

        return [layer.register_forward_pre_hook(pre), layer.register_forward_hook(post)]

    handles = [h for i, layer in enumerate(layers) for h in arm(i, layer)]
    try:
        for step in range(PROFILE_WARMUP + steps):
            model.zero_grad(set_to_none=True)
            loss = model(batch[0]).pow(2).mean()
            t_loss = time.perf_counter()
            loss.backward()
            t_end = time.perf_counter()
            if step < PROFILE_WARMUP:
                continue
            last = len(layers) - 1
            for i in range(len(layers)):
                f_end = t_loss if i == last else marks[f"f{i}_end"]
                fwd[i].append(f_end - marks[f"f{i}"])
                b_start = t_loss if i == last else marks[f"b{i}"]
                b_end = t_end if i == 0 else marks[f"b{i - 1}"]
                bwd[i].append(b_end - b_start)
    finally:
        for h in handles:
            h.remove()
    return [statistics.median(x) for x in fwd], [statistics.median(x) for x in bwd]


def measure_optimizer(opt: torch.optim.Optimizer, grads: list[tuple[nn.Parameter, torch.Tensor]], reps: int = 3) -> float:
    """AdamW's step and zero_grad on the wrapped model's shards (gradients from one backward,
    restored before each repetition); median seconds."""
    times = []
    for _ in range(reps):
        for p, g in grads:
            p.grad = g
        t0 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_host(model: nn.Module, reps: int = 3) -> HostCosts:
    """Training-thread seconds around one unit's collectives on CPU, timed on the runtime's own
    verbs of a wrapped W1 (`Runtime.gather`, `wait_gather`, `reduce`, `wait_reduce`, driven by
    hand, outside any step; `model` is used for nothing else): each collective is waited for
    untimed first, so the timed wait holds only the host work (decode, copy-out; sum, decode,
    scale). The forward gather encodes the shard (with a codec), the backward re-gather resends
    those bytes: both are timed. A first, untimed repetition warms the buffers."""
    state: Any = model._overlap_state  # OverlapState; its runtime's verbs are driven by hand
    rt, unit = state.runtime, 0
    assert state.root_unit is None and len(rt.units) == _w1().layers, (
        f"rank {dist.get_rank()}: expected one unit per W1 layer and no root unit"
    )
    keys = ("gather issue", "regather issue", "gather wait", "reduce issue", "reduce wait")
    samples: dict[str, list[float]] = {k: [] for k in keys}

    def timed(key: str, fn: Callable[..., None], *args: Any) -> None:
        t0 = time.perf_counter()
        fn(*args)
        samples[key].append(time.perf_counter() - t0)

    def settle(work: Any) -> None:  # the collective itself, untimed (private handles: see doc)
        if work is not None:
            work.wait()

    for rep in range(reps + 1):
        for key, for_backward in (("gather issue", False), ("regather issue", True)):
            dist.barrier()
            timed(key, rt.gather, unit, for_backward)
            settle(rt.units[unit].gather.work)
            timed("gather wait", rt.wait_gather, unit)
            if not for_backward:
                rt.free(unit)
        for p in rt.units[unit].unsharded_params:
            p.grad = torch.randn_like(p)
        dist.barrier()
        timed("reduce issue", rt.reduce, rep, (unit,))
        settle(rt._pending[rep].result.work)
        timed("reduce wait", rt.wait_reduce, rep, (unit,))
        rt.free(unit)
        model.zero_grad(set_to_none=True)
    # the first repetition (two gather samples, one of each reduction) is a warm-up
    med = _max_over_ranks([statistics.median(samples[k][2 if k == "gather wait" else 1:]) for k in keys])
    return HostCosts(
        gather_issue_s=med[0], regather_issue_s=med[1], gather_wait_s=med[2],
        reduce_issue_s=med[3], reduce_wait_s=med[4],
    )  # fmt: skip


def measure_contention(layer: nn.Module, x: torch.Tensor, reps: int = 2) -> tuple[float, float, float, float]:
    """(compute alone, compute beside an all-gather loop, one all-gather alone, one all-gather
    beside compute), seconds; medians over `reps` alternations, means over ranks.

    The compute is one W1 layer's forward + backward; the loop is a thread issuing one-layer
    all-gathers back to back on gloo (the same count on every rank), spanning about four
    computes. Beside the loop, compute repeats until the loop ends; a repetition still running
    when it ended is not counted."""
    from overlap.tools.bench.comm import all_gather_single

    n = dist.get_world_size()
    numel = sum(p.numel() for p in layer.parameters())
    inp, out = torch.randn(numel // n), torch.empty(numel - numel % n)

    def work() -> float:
        t0 = time.perf_counter()
        layer(x).pow(2).mean().backward()
        return time.perf_counter() - t0

    def comm_loop(count: int, done: threading.Event, span: list[float]) -> None:
        t0 = time.perf_counter()
        for _ in range(count):
            all_gather_single(out, inp)
        span.append((time.perf_counter() - t0) / count)
        done.set()

    work()
    compute_alone, compute_loaded, comm_alone, comm_loaded = [], [], [], []
    for _ in range(reps):
        dist.barrier()
        compute_alone += [work() for _ in range(2)]
        dist.barrier()
        span: list[float] = []
        comm_loop(4, threading.Event(), span)
        comm_alone.append(span[0])
        count = 1 + int(_max_over_ranks([4 * max(compute_alone) / span[0]])[0])
        done, span = threading.Event(), []
        dist.barrier()
        thread = threading.Thread(target=comm_loop, args=(count, done, span))
        thread.start()
        while not done.is_set():
            dt = work()
            if not done.is_set():
                compute_loaded.append(dt)
        thread.join()
        comm_loaded.append(span[0])
    samples = (compute_alone, compute_loaded, comm_alone, comm_loaded)
    a, b, c, d = _mean_over_ranks([statistics.median(x) for x in samples])
    return a, b, c, d


def measure_concurrency(layer_numel: int, reps: int = 2) -> float:
    """Seconds for `CONCURRENCY_OPS` one-layer collectives, all-gathers and all-to-alls in
    turn, issued at once: gloo's two worker threads run two at a time, kept busy as training
    keeps them when the link is the bottleneck (a gather beside a reduction or a prefetched
    gather). Median over `reps`, mean over ranks."""
    from overlap.tools.bench.comm import all_gather_single

    n = dist.get_world_size()
    numel = layer_numel - layer_numel % n
    bufs = [(torch.randn(numel // n if i % 2 == 0 else numel), torch.empty(numel)) for i in range(CONCURRENCY_OPS)]

    def batch() -> float:
        dist.barrier()
        t0 = time.perf_counter()
        works = [all_gather_single(out, inp, async_op=True) if i % 2 == 0
                 else dist.all_to_all_single(out, inp, async_op=True)
                 for i, (inp, out) in enumerate(bufs)]  # fmt: skip
        for work in works:
            work.wait()
        return time.perf_counter() - t0

    batch()
    return _mean_over_ranks([statistics.median(batch() for _ in range(reps))])[0]


@dataclass
class Rig:
    """What calibration reuses every round, built once per world."""

    batch: tuple[torch.Tensor, ...]
    plain: nn.Module
    """W1 unwrapped: the compute profile and the contention measurement run it."""
    host_models: dict[str, nn.Module]
    """A wrapped W1 per codec path, driven by `measure_host`."""
    opt_model: nn.Module
    opt: torch.optim.Optimizer
    grads: list[tuple[nn.Parameter, torch.Tensor]]
    """`opt_model`'s parameters and gradients from one backward, for `measure_optimizer`."""

    @property
    def layer_numel(self) -> int:
        return sum(p.numel() for p in next(self.plain.children()).parameters())

    @classmethod
    def build(cls) -> Rig:
        import overlap
        from overlap.tools.bench import step as w1

        bench = _w1()
        batch = w1.make_batch(bench, dist.get_rank())
        plain = w1.build_model(bench)
        layer_numel = sum(p.numel() for p in next(plain.children()).parameters())
        paths = {codec_path(o): o for o in configs(layer_numel).values()}
        host_models = {path: overlap.wrap(w1.build_model(bench), **o) for path, o in paths.items()}
        opt_model = overlap.wrap(w1.build_model(bench))
        opt = torch.optim.AdamW(opt_model.parameters(), lr=bench.lr)
        opt_model(batch[0]).pow(2).mean().backward()
        grads = [(p, p.grad) for p in opt_model.parameters() if p.grad is not None]
        return cls(batch, plain, host_models, opt_model, opt, grads)


def calibrate_round(rig: Rig, link: str, world_size: int, profile_steps: int) -> Calibration:
    """One calibration: every measurement of the module docstring's step 1 except the compute
    profile of each rank alone (`profile_alone`, once per world)."""
    layer_numel = rig.layer_numel
    gather_link, reduce_link, rows = calibrate_links(world_size)
    fwd, bwd = profile_compute(rig.plain, rig.batch, profile_steps)
    fwd, bwd = _max_over_ranks(fwd), _max_over_ranks(bwd)  # the slower rank paces the step
    host = {path: measure_host(model) for path, model in rig.host_models.items()}
    contention = measure_contention(next(rig.plain.children()), rig.batch[0])
    topo = Topology(world_size, world_size, gather_link, gather_link, reduce_link=reduce_link)
    concurrency = (  # the cost model's solo times of the two kinds, and the measured batch
        ring_time_s("all_gather", 4 * layer_numel, topo),
        ring_time_s("all_to_all", 4 * layer_numel, topo),
        measure_concurrency(layer_numel),
    )
    solos = [concurrency[i % 2] for i in range(CONCURRENCY_OPS)]
    optimizer_s = _max_over_ranks([measure_optimizer(rig.opt, rig.grads)])[0]
    return Calibration(
        link=link,
        world_size=world_size,
        layer_numel=layer_numel,
        gather_link=gather_link,
        reduce_link=reduce_link,
        forward_s=fwd,
        backward_s=bwd,
        optimizer_s=optimizer_s,
        host=host,
        cpu_contention=contention_share(contention[0], contention[1]),
        comm_stretch=max(1.0, contention[3] / contention[2]),
        concurrent_throughput=concurrent_throughput(solos, concurrency[2]),
        contention_ms=tuple(x * 1e3 for x in contention),
        concurrency_ms=tuple(x * 1e3 for x in concurrency),
        link_rows=rows,
    )


def profile_alone(rig: Rig, steps: int) -> tuple[list[float], list[float]]:
    """The compute profile with each rank computing alone while the others wait in a barrier
    (printed for comparison; the predictions use both ranks at once, as in training)."""
    n = len(list(rig.plain.children()))
    fwd, bwd = [0.0] * n, [0.0] * n
    for r in range(dist.get_world_size()):
        if dist.get_rank() == r:
            fwd, bwd = profile_compute(rig.plain, rig.batch, steps)
        dist.barrier()
    return _max_over_ranks(fwd), _max_over_ranks(bwd)


def build_contenders(table: dict[str, dict[str, Any]], batch: tuple[torch.Tensor, ...]) -> list[tuple[nn.Module, torch.optim.Optimizer]]:
    """One wrapped W1 and AdamW per config, two steps taken (order check, allocator warm)."""
    import overlap
    from overlap.tools.bench import step as w1

    bench = _w1()
    out: list[tuple[nn.Module, torch.optim.Optimizer]] = []
    for overrides in table.values():
        model = overlap.wrap(w1.build_model(bench), **overrides)
        opt = torch.optim.AdamW(model.parameters(), lr=bench.lr)
        for _ in range(2):
            w1.train_step(model, opt, batch)
        out.append((model, opt))
    return out


def time_segment(model: nn.Module, opt: torch.optim.Optimizer, batch: tuple[torch.Tensor, ...], steps: int) -> float:
    """One config's turn in a round: a warm-up step, then the median of `steps` timed steps
    (barrier before each; a step is the slowest rank's), ms."""
    from overlap.tools.bench import step as w1

    w1.train_step(model, opt, batch)
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        w1.train_step(model, opt, batch)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(_max_over_ranks(times))


def validate_rank(rank: int, world_size: int, cfg: ValidateConfig) -> dict[str, Any] | None:
    """One link: rounds of (calibration, every config's segment in rotated order), then the
    predictions from the median calibration; rank 0 returns everything."""
    from overlap.tools.bench.link import active_link
    from overlap.transport.host import keep_freed_cpu_memory

    torch.set_num_threads(1)
    keep_freed_cpu_memory()  # what overlap.wrap sets on CPU, applied before calibrating too
    try:
        from overlap.kernels.cpu import load_extension

        load_extension()  # a JIT build must not land inside a timed phase
    except Exception as e:  # noqa: BLE001  the reference kernels still work
        print(f"note: C++ kernels not loaded ({e})")
    link = active_link() or "loopback"
    t0 = time.perf_counter()
    rig = Rig.build()
    table = configs(rig.layer_numel)
    names = list(table)
    contenders = build_contenders(table, rig.batch)
    alone = profile_alone(rig, cfg.profile_steps)
    cals: list[Calibration] = []
    rounds: dict[str, list[float]] = {name: [] for name in names}
    for r in range(cfg.rounds):
        cals.append(calibrate_round(rig, link, world_size, cfg.profile_steps))
        k = r % len(names)
        for i in list(range(k, len(names))) + list(range(k)):
            rounds[names[i]].append(time_segment(*contenders[i], rig.batch, cfg.steps))
        if rank == 0:
            print(f"  round {r + 1}/{cfg.rounds} done ({time.perf_counter() - t0:.0f} s)", flush=True)
    if rank != 0:
        return None
    cal = median_calibration(cals)
    print(format_calibration(cal, cals, alone), flush=True)
    rows = []
    for name, overrides in table.items():
        rows.append({
            "config": name,
            "overrides": overrides,
            "measured_ms": statistics.median(rounds[name]),
            "spread_ms": [min(rounds[name]), max(rounds[name])],
            "round_ms": rounds[name],
            "predicted_ms": predict_ms(cal, overrides, host_aware=True),
            "predicted_per_round_ms": [predict_ms(c, overrides, host_aware=True) for c in cals],
            "planner_ms": predict_ms(cal, overrides, host_aware=False),
        })  # fmt: skip
    return {
        "link": link,
        "calibration": asdict(cal),
        "calibration_rounds": [asdict(c) for c in cals],
        "profile_alone_s": {"forward": alone[0], "backward": alone[1]},
        "seconds": time.perf_counter() - t0,
        "rows": rows,
    }


# ---------------------------------------------------------------------------------------------
# report


def format_calibration(cal: Calibration, cals: list[Calibration], alone: tuple[list[float], list[float]]) -> str:
    """The median calibration, with the min-max over rounds of its main numbers."""
    ms, c, q = 1e3, cal.contention_ms, cal.concurrency_ms

    def spread(get: Callable[[Calibration], float], scale: float = ms) -> str:
        values = [get(x) * scale for x in cals]
        return f"[{min(values):.3g}-{max(values):.3g}]"

    def per_layer(values: list[float]) -> float:
        return statistics.fmean(values) * ms

    lines = [
        f"\ncalibration, {cal.link}: median of {len(cals)} rounds [min-max over rounds]",
        (f"  all_gather  alpha {cal.gather_link.alpha_s * 1e6:7.1f} us  busbw {cal.gather_link.busbw_gbps:.3f} GB/s "
         f"{spread(lambda x: x.gather_link.busbw_gbps, 1)}"),
        (f"  all_to_all  alpha {cal.reduce_link.alpha_s * 1e6:7.1f} us  busbw {cal.reduce_link.busbw_gbps:.3f} GB/s "
         f"{spread(lambda x: x.reduce_link.busbw_gbps, 1)}"),
        (f"  compute per layer, both ranks at once: forward {per_layer(cal.forward_s):.1f} ms "
         f"{spread(lambda x: statistics.fmean(x.forward_s))}, backward {per_layer(cal.backward_s):.1f} ms "
         f"{spread(lambda x: statistics.fmean(x.backward_s))}; each rank alone (once): "
         f"{per_layer(alone[0]):.1f} / {per_layer(alone[1]):.1f} ms"),
        f"  optimizer {cal.optimizer_s * ms:.1f} ms {spread(lambda x: x.optimizer_s)}",
        (f"  contention: layer fwd+bwd {c[0]:.1f} ms alone, {c[1]:.1f} ms beside all-gathers: share "
         f"lost {cal.cpu_contention:.2f} {spread(lambda x: x.cpu_contention, 1)}; all-gather {c[2]:.1f} ms "
         f"alone, {c[3]:.1f} ms beside compute: stretch {cal.comm_stretch:.2f}x {spread(lambda x: x.comm_stretch, 1)}"),
        (f"  concurrency: {CONCURRENCY_OPS // 2} x (all-gather {q[0]:.1f} ms + all-to-all {q[1]:.1f} ms) "
         f"(fits) issued at once: {q[2]:.1f} ms: throughput {cal.concurrent_throughput:.2f}x of one "
         f"{spread(lambda x: x.concurrent_throughput, 1)}"),
    ]
    for path, h in cal.host.items():
        lines.append(
            f"  host per layer [{path}]: gather issue {h.gather_issue_s * ms:.2f} (re-gather "
            f"{h.regather_issue_s * ms:.2f}), wait {h.gather_wait_s * ms:.2f} ms; reduce issue "
            f"{h.reduce_issue_s * ms:.2f}, wait {h.reduce_wait_s * ms:.2f} ms"
        )
    return "\n".join(lines)


def format_table(results: list[dict[str, Any]]) -> str:
    header = (
        f"{'config':<24} {'link':<9} {'measured ms':>11} {'spread ms':>15} {'predicted':>9} "
        f"{'error':>7} {'planner':>8} {'error':>7}"
    )
    lines = [header, "-" * len(header)]
    for res in results:
        for row in res["rows"]:
            m, (lo, hi) = row["measured_ms"], row["spread_ms"]
            lines.append(
                f"{row['config']:<24} {res['link']:<9} {m:>11.1f} {f'{lo:.0f}-{hi:.0f}':>15} "
                f"{row['predicted_ms']:>9.1f} {row['predicted_ms'] / m - 1:>+7.1%} "
                f"{row['planner_ms']:>8.1f} {row['planner_ms'] / m - 1:>+7.1%}"
            )
    errors = [abs(r["predicted_ms"] / r["measured_ms"] - 1) for res in results for r in res["rows"]]
    planner = [abs(r["planner_ms"] / r["measured_ms"] - 1) for res in results for r in res["rows"]]
    lines.append(
        f"host-aware: {sum(e <= 0.15 for e in errors)}/{len(errors)} within 15%, "
        f"mean |error| {statistics.fmean(errors):.1%}, max {max(errors):.1%}; "
        f"planner model: {sum(e <= 0.15 for e in planner)}/{len(planner)} within 15%, "
        f"mean |error| {statistics.fmean(planner):.1%}"
    )
    return "\n".join(lines)


def run_link(link: str, cfg: ValidateConfig) -> dict[str, Any]:
    from overlap.tools.bench.link import LinkSpec, run_linked_world
    from overlap.tools.launch import run_local_world

    if link == "loopback":
        return run_local_world(validate_rank, 2, cfg, threads_per_rank=1)[0]
    return run_linked_world(validate_rank, 2, cfg, spec=LinkSpec.parse(link))[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    d = ValidateConfig()
    parser.add_argument("--links", default=",".join(d.links), help="comma list: loopback, 1gbit, ...")
    parser.add_argument("--rounds", type=int, default=d.rounds)
    parser.add_argument("--steps", type=int, default=d.steps, help="timed steps per config per round")
    parser.add_argument("--profile-steps", type=int, default=d.profile_steps)
    parser.add_argument("--json", dest="json_path", default=None, metavar="PATH")
    args = parser.parse_args()
    try:
        cfg = ValidateConfig(
            links=tuple(x.strip() for x in args.links.split(",") if x.strip()),
            rounds=args.rounds, steps=args.steps, profile_steps=args.profile_steps,
            json_path=args.json_path,
        )  # fmt: skip
    except ValueError as e:
        raise SystemExit(f"plan_validate: {e}") from None
    t0 = time.perf_counter()
    load = os.getloadavg()
    results = []
    for link in cfg.links:
        print(f"\n== {link} ==", flush=True)
        results.append(run_link(link, cfg))
    print(f"\nW1 step on 2 gloo ranks: measured vs simulator ({cfg.rounds} rounds x {cfg.steps} steps)")
    print(format_table(results))
    total_s = time.perf_counter() - t0
    print(f"plan_validate: {total_s:.0f} s in all; load average at start {load[0]:.1f}, at end {os.getloadavg()[0]:.1f}")
    if cfg.json_path:
        path = Path(cfg.json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        out = {"config": asdict(cfg), "load_average": [load[0], os.getloadavg()[0]],
               "total_s": total_s, "results": results}  # fmt: skip
        path.write_text(json.dumps(out, indent=2, default=str) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from entry import run_as_module  # ranks import this script by module name

    sys.exit(run_as_module(__file__))
