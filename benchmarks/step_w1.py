"""W1: one training step of an 8-layer transformer on CPU/gloo, overlap vs FSDP2 vs DDP vs floors.

    python benchmarks/step_w1.py                       # W1, all contenders, 3 rounds
    python benchmarks/step_w1.py --overlap-config prefetch_depth=2 --json out/w1.json
    python benchmarks/step_w1.py --contenders ddp,floor-compute --layers 2 --rounds 1
    python benchmarks/step_w1.py --link 1gbit          # each rank behind an emulated 1 Gbit/s link

Two ranks x one thread each, spawned once; every contender is a fresh, identically initialized
model in the same processes. Rounds interleave the contenders (order rotated each round); a round
gives each contender 2 warm-up steps and `--steps` timed steps, each timed after a barrier and
taken as the slowest rank. Reported: the median over rounds of each round's median step, and the
min-max of those round medians.

Contenders
  overlap[...]         overlap.wrap (default config, plus one per --overlap-config)
  fsdp2                fully_shard per layer, then the root; defaults
  fsdp2-tuned          + explicit next/previous-layer prefetch and _set_unshard_async_op(True)
  ddp                  DistributedDataParallel
  floor-compute        the plain local step: no communication
  floor-compute||comm  the plain local step with ZeRO-3's collectives running beside it

[Note: what floor-compute||comm issues, and when]
Per layer, in the sizes ZeRO-3 would use (the layer's numel padded to a multiple of the world
size, fp32): an all-gather from its forward pre-hook, an all-gather when the gradient of its
output arrives (a tensor hook, i.e. the start of its backward) and a reduce-scatter once all its
parameters have accumulated gradients. All are async_op=True on preallocated buffers that nothing
reads, so no compute ever waits on them; the step waits for all of them at its end. Launching
them at the hooks spreads the traffic over the step like a real ZeRO-3 schedule would, instead
of front-loading it all at step start. On 2 cores the gloo worker threads take CPU from compute,
so this is "the best this machine can overlap", not compute time alone.

Parity guard: after the up-front warm-up, every data-parallel contender's loss at step 1 (after
one AdamW update) must match DDP's on each rank within 1e-5 relative, else a WARNING line (the
floors train on local gradients and are not checked; mixed precision will trip it by design).
Exposed communication: overlap reports its own (StepStats.exposed_comm_ms, median over steps);
for the others it is estimated as step - floor-compute (marked "~").
Memory: state = per-rank bytes of parameters + gradients + optimizer state by accounting (local
shards of DTensors; DDP's buckets and overlap's/FSDP2's transient unsharded buffers excluded).
peak RSS is process-wide (all contenders live in the process): the kernel's high-water mark,
reset before each contender's steps where /proc/self/clear_refs allows, else ru_maxrss.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import os
import resource
import socket
import statistics
import sys
import time
from argparse import Namespace
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's `overlap`

from overlap.bench.link import LinkSpec, active_link, run_linked_command

ALL_CONTENDERS = ("overlap", "fsdp2", "fsdp2-tuned", "ddp", "floor-compute", "floor-compute||comm")
# Untimed steps per contender per round (and once up front, where step 1 is the parity check).
WARMUP_STEPS = 2
PARITY_RTOL = 1e-5


@dataclass
class Contender:
    name: str
    model: nn.Module
    opt: torch.optim.Optimizer
    step: Callable[..., torch.Tensor]
    """One training step, `step(on_stepped=None)`; returns the (detached) loss."""
    exposed_comm_ms: Callable[[], float] | None = None
    """The contender's own measure of the last step's exposed communication, if it has one."""
    trains_like_ddp: bool = True
    step_ms: list[list[float]] = field(default_factory=list)  # per round, per timed step
    exposed_ms: list[float] = field(default_factory=list)
    state_bytes: int = 0
    peak_rss_bytes: int = 0
    current_rss_bytes: int = 0


# ---------------------------------------------------------------------------------------------
# model, step, accounting


def build_model(args: Namespace) -> nn.Sequential:
    torch.manual_seed(args.seed)  # same init on every rank and for every contender
    return nn.Sequential(
        *[
            nn.TransformerEncoderLayer(
                d_model=args.dim,
                nhead=args.heads,
                dim_feedforward=args.ff,
                batch_first=True,
                dropout=0.0,
            )
            for _ in range(args.layers)
        ]
    )


def train_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    on_stepped: Callable[[], None] | None = None,
) -> torch.Tensor:
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    if on_stepped is not None:  # gradients still alive here: the accounting hook
        on_stepped()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def local_bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    total = 0
    for p in model.parameters():
        total += local_bytes(p) + local_bytes(p.grad)
    for per_param in opt.state.values():
        total += sum(local_bytes(v) for v in per_param.values() if isinstance(v, torch.Tensor))
    return total


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def peak_rss_bytes(was_reset: bool) -> int:
    if was_reset:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---------------------------------------------------------------------------------------------
# contenders


def standard(name: str, model: nn.Module, x: torch.Tensor, lr: float, **kw: Any) -> Contender:
    """A contender whose step is the plain `train_step` of `model` under AdamW."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)

    def step(on_stepped: Callable[[], None] | None = None) -> torch.Tensor:
        return train_step(model, opt, x, on_stepped)

    return Contender(name, model, opt, step, **kw)


def make_overlap(args: Namespace, x: torch.Tensor, name: str, overrides: dict) -> Contender:
    import overlap

    overrides = {"cpu_keep_freed_memory": args.keep_freed_memory, **overrides}
    model = overlap.wrap(build_model(args), **overrides)

    def exposed_comm_ms() -> float:
        stats = overlap.step_stats(model)  # None only before the first step
        return float("nan") if stats is None else stats.exposed_comm_ms

    return standard(name, model, x, args.lr, exposed_comm_ms=exposed_comm_ms)


def make_fsdp2(args: Namespace, x: torch.Tensor, name: str, tuned: bool) -> Contender:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = build_model(args)
    layers = [fully_shard(layer, mesh=mesh) for layer in model]
    root = fully_shard(model, mesh=mesh)
    assert isinstance(root, FSDPModule)
    if tuned:
        # FSDP2's implicit prefetch needs CUDA streams; on CPU only explicit prefetch with
        # async unshard overlaps its all-gathers (its reduce-scatter stays synchronous).
        for i, layer in enumerate(layers):
            if i + 1 < len(layers):
                layer.set_modules_to_forward_prefetch([layers[i + 1]])
            if i > 0:
                layer.set_modules_to_backward_prefetch([layers[i - 1]])
        root._set_unshard_async_op(True)
    return standard(name, model, x, args.lr)


def make_ddp(args: Namespace, x: torch.Tensor) -> Contender:
    return standard("ddp", nn.parallel.DistributedDataParallel(build_model(args)), x, args.lr)


def make_floor(args: Namespace, x: torch.Tensor) -> Contender:
    return standard("floor-compute", build_model(args), x, args.lr, trains_like_ddp=False)


_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def attach_zero3_comm(layer: nn.Module, world: int, works: list[dist.Work]) -> None:
    """Hooks that issue `layer`'s ZeRO-3 collectives; see [Note: what floor-compute||comm ...]."""
    params = list(layer.parameters())
    padded_numel = -(-sum(p.numel() for p in params) // world) * world
    shard = torch.zeros(padded_numel // world)
    gathered_fwd, gathered_bwd = torch.zeros(padded_numel), torch.zeros(padded_numel)
    grad_flat, grad_shard = torch.zeros(padded_numel), torch.zeros(padded_numel // world)
    num_grads_ready = 0

    def gather_fwd(_module: nn.Module, _inputs: Any) -> None:
        works.append(_all_gather(gathered_fwd, shard, async_op=True))

    def gather_bwd(_grad: torch.Tensor) -> None:
        works.append(_all_gather(gathered_bwd, shard, async_op=True))

    def arm_gather_bwd(_module: nn.Module, _inputs: Any, output: torch.Tensor) -> None:
        output.register_hook(gather_bwd)

    def reduce_when_ready(_param: torch.Tensor) -> None:
        nonlocal num_grads_ready
        num_grads_ready += 1
        if num_grads_ready == len(params):
            num_grads_ready = 0
            works.append(_reduce_scatter(grad_shard, grad_flat, async_op=True))

    layer.register_forward_pre_hook(gather_fwd)
    layer.register_forward_hook(arm_gather_bwd)
    for p in params:
        p.register_post_accumulate_grad_hook(reduce_when_ready)


def make_floor_with_comm(args: Namespace, x: torch.Tensor) -> Contender:
    """The local step with ZeRO-3's collectives beside it, waited for at the end of the step."""
    model = build_model(args)
    works: list[dist.Work] = []
    for layer in model:
        attach_zero3_comm(layer, dist.get_world_size(), works)
    c = standard("floor-compute||comm", model, x, args.lr, trains_like_ddp=False)
    local_step = c.step

    def step(on_stepped: Callable[[], None] | None = None) -> torch.Tensor:
        loss = local_step(on_stepped)
        for work in works:
            work.wait()
        works.clear()
        return loss

    c.step = step
    return c


def parse_overrides(spec: str) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    for item in filter(None, spec.split(",")):
        key, sep, raw = item.partition("=")
        if not sep:
            raise SystemExit(f"--overlap-config expects key=value[,key=value], got {item!r}")
        lowered = raw.strip().lower()
        value: Any
        if lowered in ("true", "false", "none"):
            value = {"true": True, "false": False, "none": None}[lowered]
        else:
            try:
                value = ast.literal_eval(raw.strip())
            except (ValueError, SyntaxError):
                value = raw.strip()  # e.g. param_dtype=bfloat16
        overrides[key.strip()] = value
    return overrides


def build_contenders(args: Namespace, x: torch.Tensor) -> list[Contender]:
    wanted = set(args.contenders.split(","))
    unknown = wanted - set(ALL_CONTENDERS)
    if unknown:
        raise SystemExit(f"unknown contenders {sorted(unknown)}; choose from {ALL_CONTENDERS}")
    out = []
    if "overlap" in wanted:
        try:
            import overlap  # noqa: F401
        except ImportError as e:
            if dist.get_rank() == 0:
                print(f"WARNING: overlap not importable ({e}); skipping its contenders")
        else:
            out.append(make_overlap(args, x, "overlap", {}))
            for spec in args.overlap_config:
                out.append(make_overlap(args, x, f"overlap[{spec}]", parse_overrides(spec)))
    if "fsdp2" in wanted:
        out.append(make_fsdp2(args, x, "fsdp2", tuned=False))
    if "fsdp2-tuned" in wanted:
        out.append(make_fsdp2(args, x, "fsdp2-tuned", tuned=True))
    if "ddp" in wanted:
        out.append(make_ddp(args, x))
    if "floor-compute" in wanted:
        out.append(make_floor(args, x))
    if "floor-compute||comm" in wanted:
        out.append(make_floor_with_comm(args, x))
    return out


# ---------------------------------------------------------------------------------------------
# protocol


def check_parity(contenders: list[Contender], losses: dict[str, list[float]]) -> None:
    """Loss at step 1 (after one optimizer step) vs DDP, on every rank; rank 0 warns."""
    ref = losses.get("ddp")
    for c in contenders:
        if c.name == "ddp" or not c.trains_like_ddp:
            continue
        if ref is None:
            rel = float("nan")
        else:
            rel = abs(losses[c.name][1] - ref[1]) / max(abs(ref[1]), 1e-30)
        rel_t = torch.tensor([rel], dtype=torch.float64)
        dist.all_reduce(rel_t, op=dist.ReduceOp.MAX)
        if dist.get_rank() != 0:
            continue
        if ref is None:
            print(f"note: ddp not selected, no parity check for {c.name}")
        elif not rel_t.item() <= PARITY_RTOL:
            print(
                f"WARNING: {c.name} loss at step 1 differs from ddp by {rel_t.item():.2e} "
                f"relative (> {PARITY_RTOL:g})"
            )
        else:
            print(f"parity ok: {c.name} loss at step 1 within {rel_t.item():.1e} of ddp")


def run_segment(c: Contender, num_steps: int) -> None:
    """One contender's turn in a round: warm-up, then timed steps."""
    for _ in range(WARMUP_STEPS):
        c.step()
    was_reset = reset_peak_rss()
    times, exposed = [], []
    for _ in range(num_steps):
        dist.barrier()
        t0 = time.perf_counter()
        c.step()
        times.append((time.perf_counter() - t0) * 1e3)
        if c.exposed_comm_ms is not None:
            exposed.append(c.exposed_comm_ms())
    times_t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(times_t, op=dist.ReduceOp.MAX)  # a step ends when its slowest rank ends
    c.step_ms.append(times_t.tolist())
    if exposed:
        exposed_t = torch.tensor(exposed, dtype=torch.float64)
        dist.all_reduce(exposed_t)
        c.exposed_ms.extend((exposed_t / dist.get_world_size()).tolist())
    mem = torch.tensor([peak_rss_bytes(was_reset), current_rss_bytes()], dtype=torch.int64)
    dist.all_reduce(mem, op=dist.ReduceOp.MAX)
    c.peak_rss_bytes = max(c.peak_rss_bytes, int(mem[0]))
    c.current_rss_bytes = int(mem[1])


def worker(rank: int, args: Namespace, port: int | None) -> None:
    """One rank; `port` None: the world is described by the environment (an emulated link)."""
    torch.set_num_threads(args.threads)
    # [Note: one allocator setting for all] overlap.wrap on CPU raises glibc's mmap/trim
    # thresholds (OverlapConfig.cpu_keep_freed_memory), which is process-wide; every contender
    # lives in this process, so apply it up front to all of them (order-independent and fair),
    # or to none with --no-keep-freed-memory.
    if args.keep_freed_memory:
        from overlap.runtime import keep_freed_cpu_memory

        keep_freed_cpu_memory()
    dist.init_process_group(
        "gloo",
        init_method="env://" if port is None else f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=args.world_size,
        timeout=datetime.timedelta(seconds=args.timeout_s),
    )
    try:
        run(rank, args)
    finally:
        dist.destroy_process_group()


def run(rank: int, args: Namespace) -> None:
    world = dist.get_world_size()
    gen = torch.Generator().manual_seed(1000 + rank)  # fixed input, different per rank
    x = torch.randn(args.batch, args.seq, args.dim, generator=gen)
    contenders = build_contenders(args, x)

    # Up-front warm-up: step 0, then step 1 (after one update) is the parity check.
    losses: dict[str, list[float]] = {}
    for c in contenders:
        losses[c.name] = [c.step().item()]

        def account(c=c):  # while gradients are alive
            c.state_bytes = state_bytes(c.model, c.opt)

        losses[c.name].append(c.step(account).item())
    state = torch.tensor([c.state_bytes for c in contenders], dtype=torch.int64)
    dist.all_reduce(state, op=dist.ReduceOp.MAX)
    for c, b in zip(contenders, state.tolist(), strict=True):
        c.state_bytes = b
    check_parity(contenders, losses)

    bar = None
    if rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=args.rounds * len(contenders), desc="W1", unit="segment")
    for r in range(args.rounds):
        k = r % len(contenders)
        for c in contenders[k:] + contenders[:k]:
            run_segment(c, args.steps)
            if bar is not None:
                bar.set_postfix_str(f"round {r} {c.name}")
                bar.update()
    if bar is not None:
        bar.close()
    if rank == 0:
        report(args, world, contenders)


# ---------------------------------------------------------------------------------------------
# report


def summarize(c: Contender) -> tuple[float, float, float]:
    medians = [statistics.median(r) for r in c.step_ms]
    return statistics.median(medians), min(medians), max(medians)


def report(args: Namespace, world: int, contenders: list[Contender]) -> None:
    tokens = args.batch * args.seq * world
    floor = next((c for c in contenders if c.name == "floor-compute"), None)
    floor_ms = summarize(floor)[0] if floor is not None else None
    rows = []
    for c in contenders:
        med, lo, hi = summarize(c)
        exposed: float | None
        if c.exposed_ms:
            exposed, estimated = statistics.median(c.exposed_ms), False
        elif floor_ms is not None and c is not floor:
            exposed, estimated = med - floor_ms, True
        else:
            exposed, estimated = (0.0 if c is floor else None), False
        rows.append(
            {
                "name": c.name,
                "median_step_ms": med,
                "spread_ms": [lo, hi],
                "tokens_per_s": tokens / (med / 1e3),
                "exposed_comm_ms": exposed,
                "exposed_comm_estimated": estimated,
                "peak_mem_bytes": c.peak_rss_bytes,
                "current_rss_bytes": c.current_rss_bytes,
                "state_bytes": c.state_bytes,
            }
        )

    mib = 2**20
    print(
        f"\nW1 step: {args.layers} x TransformerEncoderLayer(d={args.dim}, ff={args.ff}), "
        f"B={args.batch} T={args.seq}, world={world} x {args.threads} thread(s), "
        f"gloo {active_link() or 'loopback'}; "
        f"{args.rounds} rounds x {args.steps} steps"
    )
    w = max(len(row["name"]) for row in rows)
    header = (
        f"{'contender':<{w}} {'step ms':>9} {'spread ms':>15} {'tok/s':>8} {'exposed ms':>11} "
        f"{'state MiB':>10} {'peak RSS MiB':>13} {'cur RSS MiB':>12}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        lo, hi = row["spread_ms"]
        e = row["exposed_comm_ms"]
        e_str = "n/a" if e is None else ("~" if row["exposed_comm_estimated"] else "") + f"{e:.1f}"
        print(
            f"{row['name']:<{w}} {row['median_step_ms']:>9.1f} {f'{lo:.1f}-{hi:.1f}':>15} "
            f"{row['tokens_per_s']:>8.0f} {e_str:>11} {row['state_bytes'] / mib:>10.1f} "
            f"{row['peak_mem_bytes'] / mib:>13.1f} {row['current_rss_bytes'] / mib:>12.1f}"
        )
    print(
        "~ = estimate: step - floor-compute.  state = params + grads + optimizer state, per rank."
    )

    by_name = {row["name"]: row for row in rows}
    for row in rows:
        if not row["name"].startswith("overlap"):
            continue
        med = row["median_step_ms"]
        ratios = [
            f"{row['name']}/{other} = {med / by_name[other]['median_step_ms']:.3f}"
            for other in ("fsdp2", "fsdp2-tuned", "floor-compute||comm", "ddp")
            if other in by_name
        ]
        if "ddp" in by_name:
            ratios.append(
                f"memory (state) {row['name']}/ddp = "
                f"{row['state_bytes'] / by_name['ddp']['state_bytes']:.3f}"
            )
        print("  " + "\n  ".join(ratios))

    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            json.dumps({"world_size": world, "link": active_link() or "loopback", "runs": rows}, indent=2)
            + "\n"
        )
        print(f"wrote {path}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contenders", default=",".join(ALL_CONTENDERS))
    p.add_argument(
        "--no-keep-freed-memory",
        dest="keep_freed_memory",
        action="store_false",
        help="leave glibc's malloc thresholds alone for every contender (see the Note in worker)",
    )
    p.add_argument("--overlap-config", action="append", default=[], metavar="KEY=VALUE,...")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6, help="timed steps per contender per round")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--ff", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--timeout-s", type=int, default=300, help="process-group timeout")
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument("--link", default=None, metavar="RATE[,DELAY]", help="e.g. 1gbit, 1gbit,200us")
    args = p.parse_args()
    if args.rounds < 1 or args.steps < 1:
        raise SystemExit("--rounds and --steps must be >= 1")
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    if active_link() is not None:  # a rank inside the emulated link: the env names it
        worker(int(os.environ["RANK"]), args, None)
        return
    if args.link:  # every rank re-runs this script with these arguments, in its namespace
        argv = [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:]]
        spec = LinkSpec.parse(args.link)
        run_linked_command(argv, args.world_size, spec, num_threads=args.threads)
        return
    mp.spawn(worker, args=(args, free_port()), nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
