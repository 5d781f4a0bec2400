"""`overlap bench mesh`: FSDP x TP, overlap beside FSDP2 on the same (dp, tp) mesh.

    overlap bench mesh --dp 2 --tp 2 --layers 4 --dim 256 --ff 1024 --no-memory

One spawned gloo world of dp x tp ranks, `init_device_mesh("cpu", (dp, tp), ("dp", "tp"))`. The
model is `--layers` residual MLP blocks (dim -> ff -> dim, ReLU) and a plain head
(overlap.tools.workloads.toy), each block made tensor-parallel by `parallelize_module(block,
mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})`; the batch is `--batch` x
`--seq` tokens per dp rank (the same on the tp ranks of a dp rank), loss mean(out^2). Contenders, both identically initialized in the same
processes:
  overlap   overlap.wrap(model, group=mesh["dp"]), default config (plus one per --overlap-config)
  fsdp2     fully_shard(block, mesh=mesh["dp"]) per block, then the root; defaults
Rounds interleave the contenders (order rotated each round); a round gives each 2 warm-up steps
and `--steps` timed steps, each timed after a barrier and taken as the slowest rank. Reported: the
median over rounds of each round's median step, the min-max of those round medians, overlap's
ratio to FSDP2 (the median of per-round ratios, each round's two medians taken under the same
machine load, and their min-max), the loss after the warm-up steps of the first round (equal bit for bit: see
tests/parity/test_compose.py), the state bytes per rank (parameters, gradients and AdamW state, local
shards), and, unless --no-memory, each contender's peak RSS from a world of its own (the largest
rank's VmHWM, as `overlap bench step` measures it).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

import overlap
from overlap.engine.autotune_memory import process_peak_rss_bytes
from overlap.tools.bench.peers import parse_overrides, state_bytes
from overlap.tools.flags import OVERLAP_CONFIG_FLAG, command, config_or_exit, from_flags
from overlap.tools.workloads.step import ModelShape
from overlap.tools.workloads.toy import ResidualMlp, tensor_parallel
from overlap.tools.worlds.launch import run_local_world

WARMUP_STEPS = 2


@dataclass(frozen=True, kw_only=True)
class MeshBenchConfig(ModelShape):
    """One FSDP x TP comparison: `layers` residual MLP blocks `dim` -> `ff` -> `dim` (dim and ff
    divisible by tp); a dp rank's `batch` sequences are the same on its tp ranks."""

    dp: int = 2
    """Data-parallel ranks: overlap and FSDP2 shard over them."""
    tp: int = 2
    """Tensor-parallel ranks per data-parallel rank."""
    overlap_configs: tuple[str, ...] = field(default=(), metadata=OVERLAP_CONFIG_FLAG)
    """Extra overlap contenders, one per "key=value[,key=value]" of OverlapConfig overrides."""
    rounds: int = 3
    """Rounds interleaving the contenders (order rotated each round)."""
    steps: int = 6
    """Timed steps per contender per round."""
    threads: int = 1
    """Torch threads per rank."""
    memory: bool = True
    """Measure each contender's peak RSS in a fresh world of its own."""
    timeout_s: float = 300.0
    """Process-group timeout: a hung collective fails after this long."""

    def __post_init__(self) -> None:
        if min(self.dp, self.tp, self.rounds, self.steps) < 1:
            raise ValueError("MeshBenchConfig: sizes, rounds and steps must be >= 1")
        super().__post_init__()
        if self.ff % self.tp or self.dim % self.tp:
            raise ValueError(f"MeshBenchConfig: dim={self.dim} and ff={self.ff} must divide by tp={self.tp}")
        for spec in self.overlap_configs:
            parse_overrides(spec)


def parse_mesh(text: str) -> tuple[int, int]:
    """ "dp=2,tp=2" -> (2, 2)."""
    sizes = dict(part.split("=", 1) for part in text.split(",") if part.strip())
    if set(sizes) != {"dp", "tp"}:
        raise ValueError(f"--mesh expects dp=N,tp=M, got {text!r}")
    return int(sizes["dp"]), int(sizes["tp"])


def _model(cfg: MeshBenchConfig, mesh: Any) -> nn.Module:
    torch.manual_seed(0)
    return tensor_parallel(ResidualMlp(cfg.layers, cfg.dim, cfg.ff), mesh["tp"])


def _contender(cfg: MeshBenchConfig, mesh, name: str) -> nn.Module:
    if name == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        model = _model(cfg, mesh)
        for block in model.layers:
            fully_shard(block, mesh=mesh["dp"])
        return fully_shard(model, mesh=mesh["dp"])
    overrides = parse_overrides(name.removeprefix("overlap").strip("[]")) if name != "overlap" else {}
    return overlap.wrap(_model(cfg, mesh), group=mesh["dp"], **overrides)


def contender_names(cfg: MeshBenchConfig) -> list[str]:
    return ["overlap", *(f"overlap[{spec}]" for spec in cfg.overlap_configs), "fsdp2"]


class _Trainer:
    def __init__(self, cfg: MeshBenchConfig, mesh, name: str, batch: torch.Tensor) -> None:
        self.name, self.batch = name, batch
        self.model = _contender(cfg, mesh, name)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr)
        self.step_ms: list[list[float]] = []
        self.loss = float("nan")

    def step(self) -> None:
        loss = self.model(self.batch).pow(2).mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        self.loss = loss.item()  # once per step, as every contender does: the step ends with the host reading its loss


def _setup(rank: int, cfg: MeshBenchConfig):
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(cfg.threads)
    mesh = init_device_mesh("cpu", (cfg.dp, cfg.tp), mesh_dim_names=("dp", "tp"))
    gen = torch.Generator().manual_seed(mesh["dp"].get_local_rank())
    return mesh, torch.randn(cfg.batch * cfg.seq, cfg.dim, generator=gen)


def mesh_rank(rank: int, world_size: int, cfg: MeshBenchConfig) -> dict | None:
    """The interleaved rounds on one rank; rank 0 returns the summary."""
    mesh, batch = _setup(rank, cfg)
    trainers = [_Trainer(cfg, mesh, name, batch) for name in contender_names(cfg)]
    losses = {}
    for r in range(cfg.rounds):
        k = r % len(trainers)
        for t in trainers[k:] + trainers[:k]:
            for _ in range(WARMUP_STEPS):
                t.step()
            if r == 0:
                losses[t.name] = t.loss
            times = []
            for _ in range(cfg.steps):
                dist.barrier()
                start = time.perf_counter()
                t.step()
                times.append((time.perf_counter() - start) * 1e3)
            slowest = torch.tensor(times, dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a step ends when its slowest rank ends
            t.step_ms.append(slowest.tolist())  # once per round, after the timed steps (a CPU tensor)
    state = torch.tensor([state_bytes(t.model, t.opt) for t in trainers], dtype=torch.int64)
    dist.all_reduce(state, op=dist.ReduceOp.MAX)
    if rank != 0:
        return None
    out = {}
    base = [statistics.median(r) for r in trainers[-1].step_ms]  # fsdp2's round medians
    for t, nbytes in zip(trainers, state.tolist()):  # once, at the report (a CPU tensor)
        medians = [statistics.median(r) for r in t.step_ms]
        ratios = [m / b for m, b in zip(medians, base)]  # within a round: the same load on the machine
        out[t.name] = {
            "median_step_ms": statistics.median(medians),
            "spread_ms": (min(medians), max(medians)),
            "ratio_to_fsdp2": statistics.median(ratios),
            "ratio_spread": (min(ratios), max(ratios)),
            "loss_after_warmup": losses[t.name],
            "state_bytes": nbytes,
        }
    return out


def peak_rank(rank: int, world_size: int, cfg: MeshBenchConfig, name: str) -> int:
    """Contender `name` alone in fresh processes: warm-up steps plus one; the largest VmHWM."""
    mesh, batch = _setup(rank, cfg)
    trainer = _Trainer(cfg, mesh, name, batch)
    for _ in range(WARMUP_STEPS + 1):
        trainer.step()
    peak = torch.tensor([process_peak_rss_bytes()], dtype=torch.int64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return int(peak)


def bench_mesh(cfg: MeshBenchConfig) -> dict:
    """Run the comparison and print its table; the summary per contender."""
    n = cfg.dp * cfg.tp
    report = run_local_world(mesh_rank, n, cfg, timeout_s=cfg.timeout_s, threads_per_rank=cfg.threads)[0]
    if cfg.memory:
        for name in report:
            report[name]["peak_rss_bytes"] = run_local_world(
                peak_rank, n, cfg, name, timeout_s=cfg.timeout_s, threads_per_rank=cfg.threads
            )[0]
    print(
        f"FSDP x TP, mesh dp={cfg.dp} x tp={cfg.tp} (gloo, {cfg.threads} thread/rank): {cfg.layers} MLP blocks "
        f"{cfg.dim}->{cfg.ff}->{cfg.dim}, {cfg.batch * cfg.seq} tokens per dp rank, {cfg.rounds} rounds x {cfg.steps} steps"
    )
    print(
        f"{'contender':<28}{'step ms':>10}{'spread':>18}{'vs fsdp2 (spread)':>22}{'state MB':>10}{'peak RSS MB':>13}  loss"
    )
    for name, row in report.items():
        low, high = row["spread_ms"]
        r_low, r_high = row["ratio_spread"]
        ratio = f"{row['ratio_to_fsdp2']:.2f} ({r_low:.2f}-{r_high:.2f})"
        peak = row.get("peak_rss_bytes")
        peak_mb = "n/a" if peak is None else f"{peak / 2**20:.0f}"
        print(
            f"{name:<28}{row['median_step_ms']:>10.1f}{f'{low:.1f}-{high:.1f}':>18}{ratio:>22}"
            f"{row['state_bytes'] / 2**20:>10.1f}{peak_mb:>13}  {row['loss_after_warmup']:.6f}"
        )
    return report


add_arguments, run = command(MeshBenchConfig, bench_mesh, "overlap bench mesh")


def run_from_step_flags(args: argparse.Namespace) -> int:
    """`overlap bench step --mesh dp=N,tp=M ...`, the old spelling: step's flags that this
    benchmark has, the others ignored."""

    def build() -> MeshBenchConfig:
        dp, tp = parse_mesh(args.mesh)
        return from_flags(MeshBenchConfig, args, dp=dp, tp=tp)

    bench_mesh(config_or_exit("overlap bench step --mesh", build))
    return 0
