"""`overlap plan`: what a model will do on a cluster before the cluster is spent on it.

    overlap plan --model llama-8b --gpus 1024 --gpus-per-node 8 --link ndr400

prints the predicted step time, tokens/s (per GPU and total), MFU, exposed communication, memory
per GPU, the best config a small search on the simulator finds, and a scaling curve from 8 to
4,096 GPUs (--png draws it). With --gpu-hour-price and --tokens it prices the whole run.

Every prediction replays the runtime's own `Schedule` on the virtual clock of
`overlap.plan.simulate`; the inputs are stated in the output with their sources (model shapes,
GPU datasheets, link presets, the achieved-TFLOPs assumption). Importable: `plan(PlanConfig(...))`
or `plan(model="llama-8b", num_gpus=1024)` returns a `PlanResult`.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from overlap.config import OverlapConfig
from overlap.plan.cost import LINKS, Link, calibrate_from_bench
from overlap.plan.estimate import Cluster, Estimate, check_whole_nodes, estimate
from overlap.plan.models import (
    AC_POLICIES,
    DEFAULT_MFU,
    GPUS,
    MODELS,
    AcPolicy,
    ModelProfile,
    gpu_spec,
    load_model,
)
from overlap.plan.render import format_report
from overlap.plan.scaling import (
    SCALING_GPUS,
    ScalingPoint,
    plot_scaling,
    scaling_curve,
    scaling_gpu_counts,
)
from overlap.plan.search import SearchResult, SearchSpace, search

PLAN_DEFAULT_CONFIG = OverlapConfig(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
"""What the planner assumes without --config: bf16 all-gathers and compute, fp32 gradient
reduction (torchtitan's FSDP2 mixed-precision defaults); every other field as OverlapConfig has it."""


@dataclass(frozen=True, kw_only=True)
class PlanConfig:
    """One planning request. The CLI flags map one to one onto these fields."""

    model: str = "llama-8b"
    """A preset (llama-8b, llama-70b) or 'package.module:factory' returning an nn.Module."""
    num_gpus: int = 8
    gpus_per_node: int = 8
    link: str = "ndr400"
    """Inter-node link: a preset of `overlap.plan.cost.LINKS` or an `overlap bench comm --json` file."""
    intra_link: str = "nvlink4"
    """Link between the GPUs of one node (preset or bench JSON)."""
    gpu: str = "h100-sxm"
    """A preset of `overlap.plan.models.GPUS`."""
    config: OverlapConfig | None = None
    """The config to plan; None: `PLAN_DEFAULT_CONFIG`."""
    seq_len: int | None = None
    """None: the model preset's default."""
    local_batch: int | None = None
    """Sequences per GPU per step; None: the model preset's default."""
    ac: AcPolicy | None = None
    """Activation checkpointing: none, selective (op-level) or full; None: the preset's."""
    mfu: float | None = None
    """Achieved share of the GPU's peak in the compute kernels (default `DEFAULT_MFU`)."""
    tflops: float | None = None
    """Achieved TFLOPs per GPU in the compute kernels (instead of `mfu`)."""
    gpu_hour_price: float | None = None
    """Price of one GPU-hour; with `tokens`, the run's wall-clock time and cost are priced."""
    tokens: float | None = None
    """Tokens the whole run trains on."""
    search: bool = True
    """Search configs on the simulator (at the planned size and along the scaling curve)."""
    search_codecs: bool = False
    """Include the lossy codecs (param int8, grad bf16/int8) in the search."""
    scaling_gpus: tuple[int, ...] = SCALING_GPUS
    """GPU counts of the scaling curve (non-whole-node counts are skipped); () for none."""

    def __post_init__(self) -> None:
        check_whole_nodes(self.num_gpus, self.gpus_per_node)
        if self.gpu not in GPUS:
            raise ValueError(f"unknown --gpu {self.gpu!r}; use one of {sorted(GPUS)}")
        if self.ac is not None and self.ac not in AC_POLICIES:
            raise ValueError(f"--ac must be one of {AC_POLICIES}, got {self.ac!r}")
        if self.mfu is not None and self.tflops is not None:
            raise ValueError("give --mfu or --tflops, not both")
        if self.mfu is not None and not 0 < self.mfu <= 1:
            raise ValueError(f"--mfu is a fraction of peak in (0, 1], got {self.mfu!r}")
        if self.tflops is not None and not 0 < self.tflops <= gpu_spec(self.gpu).peak_tflops:
            raise ValueError(
                f"--tflops must be in (0, {gpu_spec(self.gpu).peak_tflops}] (the {self.gpu} peak), "
                f"got {self.tflops!r}"
            )
        if (self.gpu_hour_price is None) != (self.tokens is None):
            raise ValueError("--gpu-hour-price and --tokens go together: give both to price the run")
        for name in ("gpu_hour_price", "tokens"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {value!r}")

    @property
    def achieved_tflops(self) -> float:
        if self.tflops is not None:
            return self.tflops
        return (DEFAULT_MFU if self.mfu is None else self.mfu) * gpu_spec(self.gpu).peak_tflops


@dataclass(frozen=True)
class RunCost:
    """A whole training run at one predicted throughput."""

    tokens: float
    num_gpus: int
    tokens_per_s: float
    gpu_hour_price: float

    @property
    def wall_s(self) -> float:
        return self.tokens / self.tokens_per_s

    @property
    def gpu_hours(self) -> float:
        return self.wall_s / 3600.0 * self.num_gpus

    @property
    def cost(self) -> float:
        return self.gpu_hours * self.gpu_hour_price


@dataclass
class PlanResult:
    """Everything `overlap plan` prints, as data."""

    request: PlanConfig
    profile: ModelProfile
    cluster: Cluster
    config: OverlapConfig
    estimate: Estimate
    search: SearchResult | None
    scaling: list[ScalingPoint]
    elapsed_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> Estimate:
        return self.estimate if self.search is None else self.search.best

    def run_cost(self, e: Estimate | None = None) -> RunCost | None:
        """The run priced at `e`'s throughput (default: the planned config); None without prices."""
        r = self.request
        if r.tokens is None or r.gpu_hour_price is None:
            return None
        e = self.estimate if e is None else e
        return RunCost(r.tokens, e.num_gpus, e.tokens_per_s, r.gpu_hour_price)

    def to_dict(self) -> dict[str, Any]:
        def row(e: Estimate) -> dict[str, Any]:
            return {
                "num_gpus": e.num_gpus,
                "step_s": e.step_s,
                "exposed_s": e.prediction.exposed_s,
                "tokens_per_s_per_gpu": e.tokens_per_s_per_gpu,
                "tokens_per_s": e.tokens_per_s,
                "mfu": e.mfu,
                "memory_bytes": e.memory.total_bytes,
                "config": e.config.to_dict() if e.config.unit_policy == "auto" else None,
            }

        return {
            "model": self.profile.name,
            "num_params": self.profile.num_params,
            "gpu": self.cluster.gpu.name,
            "achieved_tflops": self.cluster.achieved_tflops,
            "planned": row(self.estimate),
            "best": row(self.best),
            "scaling": [{"given": row(p.given), "best": row(p.best)} for p in self.scaling],
        }


def resolve_link(name: str) -> Link:
    """A link preset, or a Link fitted to an `overlap bench comm --json` file."""
    if name in LINKS:
        return LINKS[name]
    if name.endswith(".json") and Path(name).is_file():
        return calibrate_from_bench(name)
    raise ValueError(
        f"unknown link {name!r}; use a preset ({', '.join(LINKS)}) or an `overlap bench comm "
        "--json` output file"
    )


def plan(request: PlanConfig | None = None, /, **overrides: Any) -> PlanResult:
    """Plan `request` (or `PlanConfig(**overrides)`; both: the request with overrides applied)."""
    started = time.perf_counter()
    request = PlanConfig(**overrides) if request is None else replace(request, **overrides)
    profile = load_model(request.model, request.seq_len, request.local_batch, request.ac)
    cluster = Cluster(
        num_gpus=request.num_gpus,
        gpus_per_node=request.gpus_per_node,
        gpu=gpu_spec(request.gpu),
        intra=resolve_link(request.intra_link),
        inter=resolve_link(request.link),
        achieved_tflops=request.achieved_tflops,
    )
    config = PLAN_DEFAULT_CONFIG if request.config is None else request.config
    notes: list[str] = []
    if config.param_dtype is None:
        notes.append("config has no param_dtype: planned with fp32 all-gathers (compute still at the bf16 rate)")
    space = None
    if request.search:
        space = SearchSpace.with_codecs() if request.search_codecs else SearchSpace()
    planned = estimate(profile, config, cluster)
    found = search(profile, config, cluster, space) if space is not None else None
    counts = scaling_gpu_counts(request.gpus_per_node, request.num_gpus, request.scaling_gpus) if request.scaling_gpus else []
    best_config = found.best.config if found is not None else None
    points = scaling_curve(profile, config, cluster, counts, space, start=best_config)
    if not planned.fits:
        notes.append("the planned config does not fit the GPU's memory (see memory per GPU)")
    return PlanResult(request, profile, cluster, config, planned, found, points, time.perf_counter() - started, notes)


def _token_count(text: str) -> float:
    """'15e12', '15T', '2.5B', '300M' -> tokens."""
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
    text = text.strip()
    try:
        if text and text[-1].upper() in scale:
            return float(text[:-1]) * scale[text[-1].upper()]
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r} (e.g. 15e12 or 15T)") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = PlanConfig()
    parser.add_argument("--model", default=d.model,
                        help=f"preset ({', '.join(MODELS)}) or package.module:factory returning an nn.Module")
    parser.add_argument("--gpus", type=int, default=d.num_gpus, help="GPUs in the run")
    parser.add_argument("--gpus-per-node", type=int, default=d.gpus_per_node)
    parser.add_argument("--link", default=d.link, help=f"inter-node link: {', '.join(LINKS)} or a bench comm JSON")
    parser.add_argument("--intra-link", default=d.intra_link, help="link inside a node (default nvlink4)")
    parser.add_argument("--gpu", default=d.gpu, help=f"GPU preset: {', '.join(GPUS)}")
    parser.add_argument("--config", type=Path, default=None, help="OverlapConfig JSON to plan (default: bf16/fp32 mixed precision)")
    parser.add_argument("--seq-len", type=int, default=None, help="sequence length (default: the model preset's)")
    parser.add_argument("--local-batch", type=int, default=None, help="sequences per GPU per step (default: the preset's)")
    parser.add_argument("--ac", choices=AC_POLICIES, default=None, help="activation checkpointing (default: the preset's)")
    rate = parser.add_mutually_exclusive_group()
    rate.add_argument("--mfu", type=float, default=None,
                      help=f"achieved share of peak in the compute kernels (default {DEFAULT_MFU}: Llama 3 paper, Table 4)")
    rate.add_argument("--tflops", type=float, default=None, help="achieved TFLOPs per GPU in the compute kernels")
    parser.add_argument("--gpu-hour-price", type=float, default=None, help="price per GPU-hour (with --tokens)")
    parser.add_argument("--tokens", type=_token_count, default=None, help="tokens of the whole run, e.g. 15T (with --gpu-hour-price)")
    parser.add_argument("--png", type=Path, default=None, help="draw the scaling curve into this PNG")
    parser.add_argument("--json", type=Path, default=None, help="write the numbers as JSON here")
    parser.add_argument("--no-search", action="store_true", help="predict the given config only")
    parser.add_argument("--search-codecs", action="store_true", help="also search the lossy codecs (int8/bf16 on the wire)")


def request_from_args(args: argparse.Namespace) -> PlanConfig:
    config = None
    if args.config is not None:
        if not args.config.is_file():
            raise ValueError(f"--config {args.config}: no such file (an OverlapConfig JSON, see OverlapConfig.save)")
        config = OverlapConfig.load(args.config)
    return PlanConfig(
        model=args.model, num_gpus=args.gpus, gpus_per_node=args.gpus_per_node, link=args.link,
        intra_link=args.intra_link, gpu=args.gpu, config=config, seq_len=args.seq_len,
        local_batch=args.local_batch, ac=args.ac, mfu=args.mfu, tflops=args.tflops,
        gpu_hour_price=args.gpu_hour_price, tokens=args.tokens, search=not args.no_search,
        search_codecs=args.search_codecs,
    )


def run(args: argparse.Namespace) -> int:
    try:
        result = plan(request_from_args(args))
    except ValueError as e:
        raise SystemExit(f"overlap plan: {e}") from None
    print(format_report(result))
    if args.png is not None:
        try:
            path = plot_scaling(result.scaling, args.png, f"overlap plan: {result.profile.name} on {result.cluster.gpu.name}, "
                                f"{result.request.link} between nodes of {result.cluster.gpus_per_node}")
        except ImportError:
            print("no PNG: matplotlib is not installed (pip install -e '.[plot]')")
            return 1
        print(f"wrote {path}")
    if args.json is not None:
        args.json.write_text(json.dumps(result.to_dict(), indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


__all__ = ["PLAN_DEFAULT_CONFIG", "PlanConfig", "PlanResult", "RunCost", "add_arguments", "plan", "run"]
