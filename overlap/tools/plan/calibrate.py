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
               ranks computing at once as in training; in each step the slowest rank's, since
               ranks meet in every collective (`profile_slowest`); the median over steps
   optimizer   AdamW's step on a wrapped W1's shards, timed alone
   host        the training thread's work around one unit's collectives, timed on the runtime's
               own verbs driven by hand (`measure_host`): gather issue (encode), copy-out
               (decode), reduction packing (encode), summing (decode) and scaling; through
               shared memory (ranks of one host) the exchange itself, the post at issue and the
               pull in the wait: the calibration then prices those collectives as host work
               (`Calibration.shared_memory`), the links below for the codecs' gloo exchanges
   wrapper     what the wrapper's own verbs add per unit to forward and backward, with nothing
               gathered or reduced (`measure_hooks`, [Note: hook cost] in hooks.py)
   contention  one layer's forward+backward alone and beside a loop of one-layer all-gathers:
               the share of speed compute loses (`contention_share`); the all-gather alone and
               beside that compute: how much longer comm takes (stretch)
   concurrency 8 one-layer all-gathers and all-to-alls in turn, issued at once (gloo runs two
               at a time): the link's throughput with two in flight (`concurrent_throughput`)

The measurements live in measure.py (the wrapper's in hooks.py), the worlds in world.py; this
module runs them (`calibrate_round`) and is the `--calibrate` command. `calibrate_round` is one pass; benchmarks/plan_validate.py interleaves passes with the steps it
validates, so calibration and measurement see the same machine load.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from overlap.step_model.calibration import (
    NO_CODEC,
    Calibration,
    ComputeCosts,
    concurrent_throughput,
    contention_share,
    median_calibration,
)
from overlap.step_model.cost import SHARED_MEMORY, Topology, ring_time_s
from overlap.tools.plan.hooks import measure_hooks
from overlap.tools.plan.measure import (  # the measurements (measure.py)
    CONCURRENCY_OPS,
    calibrate_links,
    layer_gather_op,
    measure_concurrency,
    measure_contention,
    measure_host,
    measure_optimizer,
    profile_compute,
    profile_slowest,
)
from overlap.tools.plan.world import World, groups, max_over_ranks, mean_over_ranks, set_up_rank, w1  # re-exported
from overlap.tools.workloads import step as workload

CODEC_OVERRIDES: dict[str, dict[str, Any]] = {
    NO_CODEC: {},
    "int8/int8": {"param_compression": "int8", "grad_compression": "int8", "error_feedback": True},
}
"""The codec paths whose host work is measured (others fall back to "none")."""
HOST_WARMUP_STEPS = 2
"""Forward + backward passes of each `Rig.host_models` model before `measure_host` times its
verbs. Without them `overlap plan --calibrate` (2 rounds, a fresh process) measured the int8 + EF
reduction's issue at 21 ms per unit, the median of a cold round (43 ms) and a warm one (4 ms)."""


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
    bench: Any
    """The W1 every model here is built from (`w1()`, or one with other sizes)."""

    def shared_memory(self) -> tuple[bool, bool]:
        """Whether the wrapped models' shard group, and their replica group, exchange through
        shared memory (`OverlapConfig.shared_memory`; overlap/transport/shm.py)."""
        transport = next(iter(self.host_models.values()))._overlap_state.runtime.transport
        return transport.all_gather.through_shared_memory, transport.all_reduce.through_shared_memory

    @property
    def layer_numel(self) -> int:
        return sum(p.numel() for p in next(self.plain.children()).parameters())

    @classmethod
    def build(cls, world: World, codecs: dict[str, dict[str, Any]] | None = None, bench: Any = None) -> Rig:
        """`bench`: the W1 to build (default `w1()`)."""
        import overlap

        bench = bench or w1()
        group, shard, replicas = groups(world)
        batch = workload.make_batch(bench, dist.get_rank())
        plain = workload.build_model(bench)
        host_models = {path: overlap.wrap(workload.build_model(bench), group=group, **o)
                       for path, o in (codecs or CODEC_OVERRIDES).items()}  # fmt: skip
        for model in host_models.values():  # warm, as training is before anything is timed: a
            for _ in range(HOST_WARMUP_STEPS):  # cold int8 + EF reduction issued in 43 ms, warm 4
                model(batch[0]).pow(2).mean().backward()
                model.zero_grad(set_to_none=True)
        opt_model = overlap.wrap(workload.build_model(bench), group=group)
        opt = torch.optim.AdamW(opt_model.parameters(), lr=bench.lr)
        opt_model(batch[0]).pow(2).mean().backward()
        grads = [(p, p.grad) for p in opt_model.parameters() if p.grad is not None]
        return cls(world, group, shard, replicas, batch, plain, host_models, opt, grads, bench)


def calibrate_round(rig: Rig, profile_steps: int = 2) -> Calibration:
    """One calibration of every cost in the module docstring, in this world."""
    world, layer_numel = rig.world, rig.layer_numel
    gather_link, reduce_link, replica_link, rows = calibrate_links(rig.shard, rig.replicas, 4 * layer_numel)
    fwd, bwd = profile_slowest(rig.plain, rig.batch, profile_steps)
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
    bench = rig.bench
    shard_shm, replica_shm = rig.shared_memory()
    return Calibration(
        source=f"measured: W1 on {world}, gloo{', shared memory' if shard_shm else ''}, {time.strftime('%Y-%m-%d %H:%M')}",
        backend="gloo",
        num_ranks=world.shard_size,
        num_replicas=world.num_replicas,
        shared_memory=shard_shm,
        level="intra" if world.link == "loopback" else "inter",
        gather_link=gather_link,
        reduce_link=reduce_link,
        replica_link=SHARED_MEMORY if replica_shm else replica_link,
        compute_share_lost=contention_share(contention[0], contention[1]),
        comm_stretch=max(1.0, contention[3] / contention[2]),
        concurrent_throughput=concurrent_throughput(solos, concurrency[2]),
        host=host,
        compute=ComputeCosts(
            unit_numel=layer_numel,
            forward_s=tuple(fwd),
            backward_s=tuple(bwd),
            optimizer_s=optimizer_s,
            tokens=bench.batch * bench.seq,
            hook_forward_s=hooks[0],
            hook_backward_s=hooks[1],
        ),
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
    for name, link in (
        ("all_gather", cal.gather_link),
        ("all_to_all", cal.reduce_link),
        ("all_reduce", cal.replica_link),
    ):
        if link is SHARED_MEMORY or link == SHARED_MEMORY:
            lines.append(f"  {name:<10}  shared memory (its copies are host work)")
        elif link is not None:
            attr = {"all_gather": "gather_link", "all_to_all": "reduce_link", "all_reduce": "replica_link"}[name]
            lines.append(f"  {name:<10}  alpha {link.alpha_s * 1e6:7.1f} us  busbw {link.busbw_gbps:.3f} GB/s"
                         f"{spread(lambda x, a=attr: getattr(x, a).busbw_gbps, 1)}")  # fmt: skip
    if cal.shared_memory:
        lines.append("  shared memory: the shard group's uncompressed all-gathers and reductions (host work below);"
                     " the links above time the codecs' gloo exchanges")  # fmt: skip
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
    parser.add_argument(
        "--calibrate",
        metavar="FILE",
        default=None,
        help="measure this machine (W1 in a local gloo world) and write a calibration JSON; nothing is planned",
    )
    parser.add_argument(
        "--calibrate-world",
        default="loopback",
        metavar="WORLD",
        help="with --calibrate: loopback, 1gbit, loopback,4 (ranks), hsdp2x2, 1gbit,hsdp2x2",
    )
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

    from overlap.step_model.calibration import default_world_calibration
    from overlap.tools.plan.trace_links import from_trace

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
