"""The calibration step: measure this machine's costs in a local world and write a `Calibration`.

    overlap plan --calibrate cal.json                      # 2 gloo ranks on loopback
    overlap plan --calibrate cal.json --calibrate-world 1gbit,4   # 4 ranks behind an emulated link
    overlap plan --calibrate cal.json --calibrate-world hsdp2x2   # HSDP: 2 replicas x 2 shards

The workload is W1 (8 x TransformerEncoderLayer(512, ff 2048), batch 4 x 128, fp32, AdamW; one
gloo thread per rank), the model of `overlap bench step`. Every rank calls the measurements in the
same order; each one is separate from the training steps it will predict:

   link        all-gather and all-to-all of 1, 4, 12 and 24 MiB over the shard group (what W1
               moves), timed back to back; an alpha-beta least-squares fit per op (`fit_link`):
               gathers use the all-gather fit, gradient reductions (an all-to-all on gloo) the
               all-to-all fit; HSDP: the all-reduce of a layer's shard over the replicas, likewise
   compute     forward and backward per layer of the plain (unwrapped) W1, timed by hooks, all
               ranks computing at once as in training; the slower rank's median, since ranks
               meet in every collective
   optimizer   AdamW's step on a wrapped W1's shards, timed alone
   host        the training thread's work around one unit's collectives, timed on the runtime's
               own verbs driven by hand (`measure_host`): gather issue (encode), copy-out
               (decode), reduction packing (encode), summing (decode) and scaling
   wrapper     what the wrapper's own verbs add per unit to forward and backward, with nothing
               gathered or reduced (`measure_hooks`, [Note: hook cost] in hooks.py)
   contention  one layer's forward+backward alone and beside a loop of one-layer all-gathers:
               the share of speed compute loses (`contention_share`); the all-gather alone and
               beside that compute: how much longer comm takes (stretch)
   concurrency 8 one-layer all-gathers and all-to-alls in turn, issued at once (gloo runs two
               at a time): the link's throughput with two in flight (`concurrent_throughput`)

`calibrate_round` is one pass; benchmarks/plan_validate.py interleaves passes with the steps it
validates, so calibration and measurement see the same machine load.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from overlap.tools.plan.calibration import (
    NO_CODEC,
    Calibration,
    ComputeCosts,
    HostCosts,
    concurrent_throughput,
    contention_share,
    fit_link,
    gather_op,
    median_calibration,
)
from overlap.tools.plan.cost import Topology, ring_time_s
from overlap.tools.plan.hooks import measure_hooks

LINK_SIZES_BYTES = tuple(k * 2**20 for k in (1, 4, 12, 24))
"""Up to what W1 moves: 12 MiB (a layer) and 24 MiB (two). A 32 MiB all-gather measured up to
2x slower per byte than 16 MiB on loopback here, and a fit is only as good as its range."""
CONCURRENCY_OPS = 8
PROFILE_WARMUP = 1
CODEC_OVERRIDES: dict[str, dict[str, Any]] = {
    NO_CODEC: {},
    "int8/int8": {"param_compression": "int8", "grad_compression": "int8", "error_feedback": True},
}
"""The codec paths whose host work is measured (others fall back to "none")."""


# ---------------------------------------------------------------------------------------------
# the world


@dataclass(frozen=True)
class World:
    """A local world to calibrate (or validate) in: its link, ranks and HSDP replicas."""

    link: str = "loopback"
    """"loopback" or an emulated link's text ("1gbit", "1gbit,200us": overlap.tools.bench.link)."""
    num_ranks: int = 2
    num_replicas: int = 1
    """HSDP: a 2-D mesh of num_replicas x (num_ranks / num_replicas)."""

    def __post_init__(self) -> None:
        if self.link != "loopback":
            from overlap.tools.bench.link import LinkSpec

            LinkSpec.parse(self.link)  # fail here, not in the ranks
        if self.num_ranks < 2 or self.num_replicas < 1 or self.num_ranks % self.num_replicas:
            raise ValueError(f"World: num_ranks ({self.num_ranks}) must be >= 2 and a multiple of num_replicas ({self.num_replicas})")
        if self.num_ranks // self.num_replicas < 2:
            raise ValueError(f"World: a shard group needs >= 2 ranks, got {self.num_ranks} / {self.num_replicas}")

    @classmethod
    def parse(cls, text: str) -> World:
        """"loopback", "1gbit" (2 ranks), "loopback,4" or "4ranks" (4 ranks), "hsdp2x2"
        (2 replicas x 2 shards, loopback), "1gbit,hsdp2x2"."""
        link, ranks, replicas = "loopback", 2, 1
        for part in (p.strip() for p in text.split(",") if p.strip()):
            if part.startswith("hsdp") and "x" in part:
                r, s = part[4:].split("x")
                replicas, ranks = int(r), int(r) * int(s)
            elif part.endswith("ranks") and part[:-5].isdigit():
                ranks = int(part[:-5])
            elif part.isdigit():
                ranks = int(part)
            elif part != "loopback":
                link = part if link == "loopback" else f"{link},{part}"
        return cls(link, ranks, replicas)

    @property
    def shard_size(self) -> int:
        return self.num_ranks // self.num_replicas

    def __str__(self) -> str:
        hsdp = f" hsdp {self.num_replicas}x{self.shard_size}" if self.num_replicas > 1 else ""
        return f"{self.link} {self.num_ranks} ranks{hsdp}"

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """`fn(rank, world_size, *args)` on this world's ranks (one thread each)."""
        from overlap.tools.bench.link import LinkSpec, run_linked_world
        from overlap.tools.launch import run_local_world

        if self.link == "loopback":
            return run_local_world(fn, self.num_ranks, *args, threads_per_rank=1)
        return run_linked_world(fn, self.num_ranks, *args, spec=LinkSpec.parse(self.link))


def groups(world: World) -> tuple[Any, dist.ProcessGroup, dist.ProcessGroup | None]:
    """(what `overlap.wrap` takes as `group`, the shard group, the replica group or None)."""
    if world.num_replicas == 1:
        return None, dist.group.WORLD, None
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world.num_replicas, world.shard_size), mesh_dim_names=("replicate", "shard"))
    return mesh, mesh.get_group(1), mesh.get_group(0)


def w1() -> Any:
    from overlap.tools.bench.step import StepBenchConfig

    return StepBenchConfig()


def mean_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def max_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def set_up_rank() -> None:
    """One compute thread, freed CPU memory kept as overlap.wrap keeps it, the C++ kernels built
    (a JIT build must not land inside a timed phase)."""
    from overlap.transport.host import keep_freed_cpu_memory

    torch.set_num_threads(1)
    keep_freed_cpu_memory()
    try:
        from overlap.kernels.cpu import load_extension

        load_extension()
    except Exception as e:  # noqa: BLE001  the reference kernels still work
        print(f"note: C++ kernels not loaded ({e})")


# ---------------------------------------------------------------------------------------------
# measurements (every rank calls these in the same order)


def launcher(op: str, num_bytes: int, group: dist.ProcessGroup) -> Callable[[bool], Any]:
    """`launch(async_op)` issuing one `op` of `num_bytes` (the cost model's S: unsharded output
    of an all-gather, all ranks' parts of an all-to-all, the tensor of an all-reduce) on
    `group`. The all-to-all leaves each rank's own part home, as the runtime's reductions and
    pair gathers do ([Note: own part stays home] in overlap/transport/collectives.py)."""
    from overlap.tools.bench.comm import all_gather_single

    n, me = group.size(), group.rank()
    numel = max(n, num_bytes // 4 // n * n)
    if op == "all_gather":
        inp, out = torch.randn(numel // n), torch.empty(numel)
        return lambda async_op=False: all_gather_single(out, inp, group=group, async_op=async_op)
    if op == "all_to_all":
        splits = [0 if r == me else numel // n for r in range(n)]
        inp, out = torch.randn(sum(splits)), torch.empty(sum(splits))
        return lambda async_op=False: dist.all_to_all_single(
            out, inp, output_split_sizes=splits, input_split_sizes=splits, group=group, async_op=async_op
        )
    if op == "all_reduce":
        buf = torch.randn(numel)
        return lambda async_op=False: dist.all_reduce(buf, group=group, async_op=async_op)
    raise ValueError(f"launcher: unknown op {op!r}")


def layer_gather_op(world: World, layer_bytes: int) -> str:
    """The collective an uncompressed W1 layer's all-gather goes through in this world."""
    return gather_op("gloo", world.shard_size, False, layer_bytes)


def time_collective(op: str, num_bytes: int, group: dist.ProcessGroup) -> float:
    """Seconds of one `op` of `num_bytes` (`launcher`) on `group`, back to back; every group of
    the world at once; the slowest rank's mean."""
    from overlap.tools.bench.comm import iters_for

    launch = launcher(op, num_bytes, group)
    iters, warmup = iters_for(num_bytes, 8, 2, 48 * 2**20)
    for _ in range(warmup):
        launch()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        launch()
    return max_over_ranks([(time.perf_counter() - t0) / iters])[0]


def calibrate_links(shard: dist.ProcessGroup, replicas: dist.ProcessGroup | None, layer_bytes: int) -> tuple[Any, Any, Any, dict[str, list[tuple[int, float]]]]:
    """(gather link, reduce link, replica link or None, the rows behind them)."""
    rows: dict[str, list[tuple[int, float]]] = {}
    for op in ("all_gather", "all_to_all"):
        rows[op] = [(size, time_collective(op, size, shard)) for size in LINK_SIZES_BYTES]
    gather = fit_link("measured all_gather", rows["all_gather"], shard.size())
    reduce = fit_link("measured all_to_all", rows["all_to_all"], shard.size(), "all_to_all")
    replica = None
    if replicas is not None:  # the reduced shard of 1/2, 1, 2 layers and a quarter
        shard_bytes = layer_bytes // shard.size()
        sizes = [shard_bytes // 4, shard_bytes // 2, shard_bytes, 2 * shard_bytes]
        rows["all_reduce"] = [(size, time_collective("all_reduce", size, replicas)) for size in sizes]
        replica = fit_link("measured all_reduce", rows["all_reduce"], replicas.size(), "all_reduce")
    return gather, reduce, replica, rows


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
    verbs of a wrapped W1 (`Runtime.gather`, `wait_gather`, `reduce`, `release_reduce`,
    `wait_reduce`, driven by hand, outside any step; `model` is used for nothing else): each
    collective is waited for untimed first (HSDP: the all-reduce too), so the timed waits hold
    only the host work (decode, copy-out; sum, decode, scale). The forward gather encodes the
    shard (with a codec), the backward re-gather resends those bytes: both are timed. A first,
    untimed repetition warms the buffers."""
    state: Any = model._overlap_state  # OverlapState; its runtime's verbs are driven by hand
    rt, unit = state.runtime, 0
    assert state.root_unit is None and len(rt.units) == w1().layers, (
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
        pending = rt._pending[rep]
        settle(pending.result.work)
        t0 = time.perf_counter()
        rt.release_reduce(rep)  # the sum; HSDP: the all-reduce issued
        summed = time.perf_counter() - t0
        if pending.all_reduce is not None:
            settle(pending.all_reduce.work)
        timed("reduce wait", rt.wait_reduce, rep, (unit,))
        samples["reduce wait"][-1] += summed
        rt.free(unit)
        model.zero_grad(set_to_none=True)
    # the first repetition (two gather samples, one of each reduction) is a warm-up
    med = max_over_ranks([statistics.median(samples[k][2 if k == "gather wait" else 1:]) for k in keys])
    return HostCosts(
        unit_bytes=4 * sum(p.numel() for p in rt.units[unit].unsharded_params),
        gather_issue_s=med[0], regather_issue_s=med[1], gather_wait_s=med[2],
        reduce_issue_s=med[3], reduce_wait_s=med[4],
    )  # fmt: skip


def measure_contention(layer: nn.Module, x: torch.Tensor, group: dist.ProcessGroup, op: str, reps: int = 2) -> tuple[float, float, float, float]:
    """(compute alone, compute beside an all-gather loop, one all-gather alone, one all-gather
    beside compute), seconds; medians over `reps` alternations, means over ranks.

    The compute is one W1 layer's forward + backward; the loop is a thread issuing one-layer
    all-gathers (through `op`, as the runtime gathers that layer) back to back on the shard
    group (the same count on every rank), spanning about four computes. Beside the loop, compute
    repeats until the loop ends; a repetition still running when it ended is not counted."""
    gather = launcher(op, 4 * sum(p.numel() for p in layer.parameters()), group)

    def work() -> float:
        t0 = time.perf_counter()
        layer(x).pow(2).mean().backward()
        return time.perf_counter() - t0

    def comm_loop(count: int, done: threading.Event, span: list[float]) -> None:
        t0 = time.perf_counter()
        for _ in range(count):
            gather()
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
        count = 1 + int(max_over_ranks([4 * max(compute_alone) / span[0]])[0])
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
    if not compute_loaded:  # the loop ended within one compute: count that one
        compute_loaded = [max(compute_alone)]
    samples = (compute_alone, compute_loaded, comm_alone, comm_loaded)
    a, b, c, d = mean_over_ranks([statistics.median(x) for x in samples])
    return a, b, c, d


def measure_concurrency(layer_bytes: int, group: dist.ProcessGroup, op: str, reps: int = 2) -> float:
    """Seconds for `CONCURRENCY_OPS` one-layer collectives, all-gathers (through `op`) and
    all-to-alls in turn, issued at once on the shard group: gloo's two worker threads run two
    at a time, kept busy as training keeps them when the link is the bottleneck (a gather beside
    a reduction or a prefetched gather). Median over `reps`, mean over ranks."""
    launches = [launcher(op if i % 2 == 0 else "all_to_all", layer_bytes, group) for i in range(CONCURRENCY_OPS)]

    def batch() -> float:
        dist.barrier()
        t0 = time.perf_counter()
        works = [launch(True) for launch in launches]
        for work in works:
            work.wait()
        return time.perf_counter() - t0

    batch()
    return mean_over_ranks([statistics.median(batch() for _ in range(reps))])[0]


@dataclass
class Rig:
    """What calibration reuses every round, built once per world."""

    world: World
    group: Any
    """What `overlap.wrap` takes (None: the default group; HSDP: the 2-D mesh)."""
    shard: dist.ProcessGroup
    replicas: dist.ProcessGroup | None
    batch: tuple[torch.Tensor, ...]
    plain: nn.Module
    """W1 unwrapped: the compute profile and the contention measurement run it."""
    host_models: dict[str, nn.Module]
    """A wrapped W1 per codec path, driven by `measure_host` (the first also by `measure_hooks`)."""
    opt: torch.optim.Optimizer
    grads: list[tuple[nn.Parameter, torch.Tensor]]
    """A wrapped W1's parameters and gradients from one backward, for `measure_optimizer`."""

    @property
    def layer_numel(self) -> int:
        return sum(p.numel() for p in next(self.plain.children()).parameters())

    @classmethod
    def build(cls, world: World, codecs: dict[str, dict[str, Any]] | None = None) -> Rig:
        import overlap
        from overlap.tools.bench import step as bench_step

        bench = w1()
        group, shard, replicas = groups(world)
        batch = bench_step.make_batch(bench, dist.get_rank())
        plain = bench_step.build_model(bench)
        host_models = {path: overlap.wrap(bench_step.build_model(bench), group=group, **o)
                       for path, o in (codecs or CODEC_OVERRIDES).items()}  # fmt: skip
        opt_model = overlap.wrap(bench_step.build_model(bench), group=group)
        opt = torch.optim.AdamW(opt_model.parameters(), lr=bench.lr)
        opt_model(batch[0]).pow(2).mean().backward()
        grads = [(p, p.grad) for p in opt_model.parameters() if p.grad is not None]
        return cls(world, group, shard, replicas, batch, plain, host_models, opt, grads)


def calibrate_round(rig: Rig, profile_steps: int = 2) -> Calibration:
    """One calibration of every cost in the module docstring, in this world."""
    world, layer_numel = rig.world, rig.layer_numel
    gather_link, reduce_link, replica_link, rows = calibrate_links(rig.shard, rig.replicas, 4 * layer_numel)
    fwd, bwd = profile_compute(rig.plain, rig.batch, profile_steps)
    fwd, bwd = max_over_ranks(fwd), max_over_ranks(bwd)  # the slower rank paces the step
    host = {path: measure_host(model) for path, model in rig.host_models.items()}
    hooks = mean_over_ranks(list(measure_hooks(next(iter(rig.host_models.values())), rig.plain, rig.batch)))
    op = layer_gather_op(world, 4 * layer_numel)
    contention = measure_contention(next(rig.plain.children()), rig.batch[0], rig.shard, op)
    topo = Topology(world.shard_size, world.shard_size, gather_link, gather_link, reduce_link=reduce_link)
    concurrency = (  # the cost model's solo times of the two kinds, and the measured batch
        ring_time_s(op, 4 * layer_numel, topo),
        ring_time_s("all_to_all", 4 * layer_numel, topo),
        measure_concurrency(4 * layer_numel, rig.shard, op),
    )
    solos = [concurrency[i % 2] for i in range(CONCURRENCY_OPS)]
    optimizer_s = max_over_ranks([measure_optimizer(rig.opt, rig.grads)])[0]
    bench = w1()
    return Calibration(
        source=f"measured: W1 on {world}, gloo, {time.strftime('%Y-%m-%d %H:%M')}",
        backend="gloo",
        num_ranks=world.shard_size,
        num_replicas=world.num_replicas,
        level="intra" if world.link == "loopback" else "inter",
        gather_link=gather_link,
        reduce_link=reduce_link,
        replica_link=replica_link,
        compute_share_lost=contention_share(contention[0], contention[1]),
        comm_stretch=max(1.0, contention[3] / contention[2]),
        concurrent_throughput=concurrent_throughput(solos, concurrency[2]),
        host=host,
        compute=ComputeCosts(unit_numel=layer_numel, forward_s=tuple(fwd), backward_s=tuple(bwd),
                             optimizer_s=optimizer_s, tokens=bench.batch * bench.seq,
                             hook_forward_s=hooks[0], hook_backward_s=hooks[1]),
        measured={
            "link_rows": rows,
            "contention_ms": [x * 1e3 for x in contention],
            "concurrency_ms": [x * 1e3 for x in concurrency],
        },
    )


def profile_alone(rig: Rig, steps: int) -> tuple[list[float], list[float]]:
    """The compute profile with each rank computing alone while the others wait in a barrier
    (printed for comparison; calibrations use all ranks at once, as in training)."""
    n = len(list(rig.plain.children()))
    fwd, bwd = [0.0] * n, [0.0] * n
    for r in range(dist.get_world_size()):
        if dist.get_rank() == r:
            fwd, bwd = profile_compute(rig.plain, rig.batch, steps)
        dist.barrier()
    return max_over_ranks(fwd), max_over_ranks(bwd)


# ---------------------------------------------------------------------------------------------
# the command


@dataclass(frozen=True, kw_only=True)
class CalibrateConfig:
    world: World = World()
    rounds: int = 2
    """Calibrations taken; the file holds their median (`median_calibration`)."""
    profile_steps: int = 2

    def __post_init__(self) -> None:
        if min(self.rounds, self.profile_steps) < 1:
            raise ValueError("CalibrateConfig: rounds and profile_steps must be >= 1")


def calibrate_rank(rank: int, world_size: int, cfg: CalibrateConfig) -> Calibration | None:
    set_up_rank()
    rig = Rig.build(cfg.world)
    cals = [calibrate_round(rig, cfg.profile_steps) for _ in range(cfg.rounds)]
    return median_calibration(cals) if rank == 0 else None


def calibrate(cfg: CalibrateConfig | None = None, /, **overrides: Any) -> Calibration:
    """Measure this machine in a local world and return the median calibration."""
    cfg = replace(cfg or CalibrateConfig(), **overrides)
    return cfg.world.run(calibrate_rank, cfg)[0]


def format_calibration(cal: Calibration, rounds: list[Calibration] | None = None) -> str:
    """The calibration's main numbers, with the min-max over `rounds` where given."""
    ms = 1e3

    def spread(get: Callable[[Calibration], float], scale: float = ms) -> str:
        if not rounds or len(rounds) < 2:
            return ""
        values = [get(x) * scale for x in rounds]
        return f" [{min(values):.3g}-{max(values):.3g}]"

    lines = [f"calibration: {cal.source}"]
    for name, link in (("all_gather", cal.gather_link), ("all_to_all", cal.reduce_link), ("all_reduce", cal.replica_link)):
        if link is not None:
            attr = {"all_gather": "gather_link", "all_to_all": "reduce_link", "all_reduce": "replica_link"}[name]
            lines.append(f"  {name:<10}  alpha {link.alpha_s * 1e6:7.1f} us  busbw {link.busbw_gbps:.3f} GB/s"
                         f"{spread(lambda x, a=attr: getattr(x, a).busbw_gbps, 1)}")  # fmt: skip
    if cal.compute is not None:
        c = cal.compute
        lines.append(f"  compute per layer: forward {statistics.fmean(c.forward_s) * ms:.1f} ms"
                     f"{spread(lambda x: statistics.fmean(x.compute.forward_s))}, backward "
                     f"{statistics.fmean(c.backward_s) * ms:.1f} ms{spread(lambda x: statistics.fmean(x.compute.backward_s))}; "
                     f"optimizer {c.optimizer_s * ms:.1f} ms{spread(lambda x: x.compute.optimizer_s)}")  # fmt: skip
        lines.append(f"  wrapper per unit: forward {c.hook_forward_s * ms:.2f} ms{spread(lambda x: x.compute.hook_forward_s)}, "
                     f"backward {c.hook_backward_s * ms:.2f} ms{spread(lambda x: x.compute.hook_backward_s)}")  # fmt: skip
    lines.append(f"  contention: compute share lost {cal.compute_share_lost:.2f}{spread(lambda x: x.compute_share_lost, 1)}, "
                 f"comm stretch {cal.comm_stretch:.2f}x{spread(lambda x: x.comm_stretch, 1)}, concurrent throughput "
                 f"{cal.concurrent_throughput or 0:.2f}x{spread(lambda x: x.concurrent_throughput or 0, 1)}")  # fmt: skip
    for path, h in cal.host.items():
        lines.append(f"  host per {h.unit_bytes / 2**20:.1f} MiB unit [{path}]: gather issue {h.gather_issue_s * ms:.2f} "
                     f"(re-gather {h.regather_issue_s * ms:.2f}), wait {h.gather_wait_s * ms:.2f} ms; reduce issue "
                     f"{h.reduce_issue_s * ms:.2f}, wait {h.reduce_wait_s * ms:.2f} ms")  # fmt: skip
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--calibrate", metavar="FILE", default=None,
                        help="measure this machine (W1 in a local gloo world) and write a calibration JSON; nothing is planned")
    parser.add_argument("--calibrate-world", default="loopback", metavar="WORLD",
                        help="with --calibrate: loopback, 1gbit, loopback,4 (ranks), hsdp2x2, 1gbit,hsdp2x2")
    parser.add_argument("--calibrate-rounds", type=int, default=CalibrateConfig.rounds)  # fmt: skip
    parser.add_argument("--from-trace", metavar="DIR", default=None,
                        help="with --calibrate: fit the links to a run's trace (OVERLAP_TRACE=DIR) instead of measuring")  # fmt: skip
    parser.add_argument("--trace-ranks", type=int, default=None,
                        help="with --from-trace: ranks of a shard group (default: the trace files)")  # fmt: skip
    parser.add_argument("--trace-backend", choices=("nccl", "gloo"), default="nccl")
    parser.add_argument("--trace-level", choices=("intra", "inter"), default="inter",
                        help="with --from-trace: the link level the traced run crossed")  # fmt: skip


def calibrate_from_trace(args: argparse.Namespace) -> Calibration:
    from pathlib import Path

    from overlap.tools.plan.calibration import default_world_calibration, from_trace

    n = args.trace_ranks or len(list(Path(args.from_trace).glob("trace_rank*.json")))
    if n < 2:
        raise ValueError(f"--from-trace {args.from_trace}: give --trace-ranks (>= 2 ranks in a shard group)")
    base = replace(default_world_calibration(n, args.trace_backend, None), level=args.trace_level)
    return from_trace(args.from_trace, base)


def run(args: argparse.Namespace) -> int:
    try:
        if args.from_trace is not None:
            cal = calibrate_from_trace(args)
        else:
            cal = calibrate(CalibrateConfig(world=World.parse(args.calibrate_world), rounds=args.calibrate_rounds))
    except ValueError as e:
        raise SystemExit(f"overlap plan --calibrate: {e}") from None
    print(format_calibration(cal))
    print(f"wrote {cal.save(args.calibrate)}")
    return 0
