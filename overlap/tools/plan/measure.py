"""The calibration's measurements, one function per cost (overlap/tools/plan/calibrate.py's
docstring says what each measures and why). Every rank calls them in the same order."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from overlap.step_model.calibration import HostCosts, fit_link, gather_op
from overlap.tools.plan.world import World, max_over_ranks, mean_over_ranks, w1
from overlap.tools.worlds.collectives import all_gather_single, iters_for
from overlap.transport.shm_segments import ShmWork

LINK_SIZES_BYTES = tuple(k * 2**20 for k in (1, 4, 12, 24))
"""Up to what W1 moves: 12 MiB (a layer) and 24 MiB (two). A 32 MiB all-gather measured up to
2x slower per byte than 16 MiB on loopback here, and a fit is only as good as its range."""
LINK_MIN_ITERS = 5
"""Timed collectives per link size at least. Two 24 MiB all-to-alls, averaged, let one slow
exchange (165 ms where 105-115 was usual, 1 Gbit) into a round's fit and its predictions up 20%;
the median of five keeps one out."""
CONCURRENCY_OPS = 8
PROFILE_WARMUP = 1
CONTENTION_REPS = 3
"""Alternations of `measure_contention`. With 2, the comm stretch of one world ranged 1.29x to
1.97x between calibration rounds and moved its predicted step by up to 5% (RESULTS.md, "The
model's own noise")."""
CONTENTION_SOLO_COMMS = 8
"""Collectives in the loop that times one alone (4 before: two of them were warm-up in effect)."""
CONCURRENCY_REPS = 5
"""Batches `measure_concurrency` takes the median of (2 before: the throughput of one round on
the 1 Gbit link came out 1.58x where the others found 1.0x, a 25% slower prediction)."""


def launcher(op: str, num_bytes: int, group: dist.ProcessGroup) -> Callable[[bool], Any]:
    """`launch(async_op)` issuing one `op` of `num_bytes` (the cost model's S: unsharded output
    of an all-gather, all ranks' parts of an all-to-all, the tensor of an all-reduce) on
    `group`. The all-to-all is the runtime's own exchange (`collectives._exchange`): each
    rank's own part stays home ([Note: own part stays home] in overlap/transport/collectives.py)
    and, on gloo, receives are posted first ([Note: receive before send] in
    overlap/transport/pairwise.py)."""
    from overlap.transport import collectives as comm

    n, me = group.size(), group.rank()
    numel = max(n, num_bytes // 4 // n * n)
    if op == "all_gather":
        inp, out = torch.randn(numel // n), torch.empty(numel)
        return lambda async_op=False: all_gather_single(out, inp, group=group, async_op=async_op)
    if op == "all_to_all":
        send = torch.randn(numel)

        def exchange(async_op: bool = False) -> Any:
            _, work, _ = comm._exchange(send, n, group, None, me)
            return work if async_op else work.wait()

        return exchange
    if op == "all_reduce":
        buf = torch.randn(numel)
        return lambda async_op=False: dist.all_reduce(buf, group=group, async_op=async_op)
    raise ValueError(f"launcher: unknown op {op!r}")


def layer_gather_op(world: World, layer_bytes: int) -> str:
    """The collective an uncompressed W1 layer's all-gather goes through in this world."""
    return gather_op("gloo", world.shard_size, False, layer_bytes)


def time_collective(op: str, num_bytes: int, group: dist.ProcessGroup) -> float:
    """Seconds of one `op` of `num_bytes` (`launcher`) on `group`, back to back (at least
    `LINK_MIN_ITERS`); every group of the world at once; each rank's median, the slowest rank's."""
    launch = launcher(op, num_bytes, group)
    iters, warmup = iters_for(num_bytes, 8, 2, 48 * 2**20)
    for _ in range(warmup):
        launch()
    dist.barrier()
    times = []
    for _ in range(max(iters, LINK_MIN_ITERS)):
        t0 = time.perf_counter()
        launch()
        times.append(time.perf_counter() - t0)
    return max_over_ranks([statistics.median(times)])[0]


def calibrate_links(
    shard: dist.ProcessGroup, replicas: dist.ProcessGroup | None, layer_bytes: int
) -> tuple[Any, Any, Any, dict[str, list[tuple[int, float]]]]:
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
    """Per-layer forward and backward seconds of the plain model on this rank (medians over
    `steps`; `profile_steps` says how they are timed)."""
    fwd, bwd = profile_steps(model, batch, steps)
    return [statistics.median(x) for x in fwd], [statistics.median(x) for x in bwd]


def profile_slowest(
    model: nn.Module, batch: tuple[torch.Tensor, ...], steps: int, warmup: int = PROFILE_WARMUP
) -> tuple[list[float], list[float]]:
    """The per-layer compute that paces a step, every rank profiling at once: in each profiled
    step the layers of the rank whose forward + backward took longest in that step; per layer,
    the median over steps. Every rank returns the same.

    [Note: slowest rank per step] Ranks meet in every collective, so a step waits for the rank
    slowest in it, and on a shared host which rank that is changes from step to step. The
    slowest rank's median (each rank's median, then the max) misses that: 12 plain W1 steps on
    2 ranks here paced at 632 ms by each step's slowest rank, 624 ms by the slower median."""
    fwd, bwd = profile_steps(model, batch, steps, warmup)
    local = torch.tensor([[*f, *b] for f, b in zip(zip(*fwd), zip(*bwd), strict=True)], dtype=torch.float64)
    every = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(every, local)
    return slowest_per_step(torch.stack(every), len(fwd))


def slowest_per_step(samples: torch.Tensor, num_layers: int) -> tuple[list[float], list[float]]:
    """`samples`: ranks x steps x (forward seconds of each layer, then backward). In each step
    the rank with the largest sum; per layer, the median over steps of that rank's seconds."""
    slowest = samples.sum(dim=2).argmax(dim=0)
    # calibration only, once per profile (CPU tensors of a few dozen numbers), never in a training step
    chosen = samples[slowest, torch.arange(samples.shape[1])].T.tolist()  # per layer: one value per step
    return [statistics.median(x) for x in chosen[:num_layers]], [statistics.median(x) for x in chosen[num_layers:]]


def profile_steps(
    model: nn.Module, batch: tuple[torch.Tensor, ...], steps: int, warmup: int = PROFILE_WARMUP
) -> tuple[list[list[float]], list[list[float]]]:
    """Per layer, the forward and backward seconds of the plain model in each of `steps` steps
    (after `warmup` untimed ones), on this rank.

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
        for step in range(warmup + steps):
            model.zero_grad(set_to_none=True)
            loss = model(batch[0]).pow(2).mean()
            t_loss = time.perf_counter()
            loss.backward()
            t_end = time.perf_counter()
            if step < warmup:
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
    return fwd, bwd


def measure_optimizer(
    opt: torch.optim.Optimizer, grads: list[tuple[nn.Parameter, torch.Tensor]], reps: int = 3
) -> float:
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
    only the host work (decode, copy-out; sum, decode, scale), except where shared memory
    carries it: its wait is the pull (the peers' copies, the sum) on this thread, host work
    timed into the wait ([Note: shared-memory collectives] in overlap/step_model/cost.py), after
    a barrier: every peer has posted, so it times the copies, not a wait for the slowest peer's
    post (ranks sharing cores are descheduled at times; in training a prefetched gather's peers
    posted long before its wait, and which rank is late is the compute profile's). The
    forward gather encodes the shard (with a codec), the backward re-gather resends those bytes:
    both are timed. A first, untimed repetition warms the buffers."""
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

    def settle(work: Any) -> float:  # the collective itself; seconds of a shared-memory pull (see doc)
        if work is None:
            return 0.0
        t0 = time.perf_counter()
        work.wait()
        return time.perf_counter() - t0 if isinstance(work, ShmWork) else 0.0

    for rep in range(reps + 1):
        for key, for_backward in (("gather issue", False), ("regather issue", True)):
            dist.barrier()
            timed(key, rt.gather, unit, for_backward)
            dist.barrier()  # every peer posted (see doc)
            pulled = settle(rt.gather_in_flight(unit).comm.work)
            timed("gather wait", rt.wait_gather, unit)
            samples["gather wait"][-1] += pulled
            if not for_backward:
                rt.free(unit)
        for p in rt.units[unit].unsharded_params:
            p.grad = torch.randn_like(p)
        dist.barrier()
        timed("reduce issue", rt.reduce, rep, (unit,))
        pending = rt._pending[rep]
        dist.barrier()
        summed = settle(pending.result.work)
        t0 = time.perf_counter()
        rt.release_reduce(rep)  # the sum; HSDP: the all-reduce issued
        summed += time.perf_counter() - t0
        if pending.all_reduce is not None:
            dist.barrier()
            summed += settle(pending.all_reduce.work)
        timed("reduce wait", rt.wait_reduce, rep, (unit,))
        samples["reduce wait"][-1] += summed
        rt.free(unit)
        model.zero_grad(set_to_none=True)
    # the first repetition (two gather samples, one of each reduction) is a warm-up
    med = max_over_ranks([statistics.median(samples[k][2 if k == "gather wait" else 1 :]) for k in keys])
    return HostCosts(
        unit_bytes=4 * sum(p.numel() for p in rt.units[unit].unsharded_params),
        gather_issue_s=med[0], regather_issue_s=med[1], gather_wait_s=med[2],
        reduce_issue_s=med[3], reduce_wait_s=med[4],
    )  # fmt: skip


def measure_contention(
    layer: nn.Module, x: torch.Tensor, group: dist.ProcessGroup, op: str, reps: int = CONTENTION_REPS
) -> tuple[float, float, float, float]:
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
        comm_loop(CONTENTION_SOLO_COMMS, threading.Event(), span)
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


def measure_concurrency(layer_bytes: int, group: dist.ProcessGroup, op: str, reps: int = CONCURRENCY_REPS) -> float:
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
