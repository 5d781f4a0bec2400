"""A planning request (`PlanConfig`), its answer (`PlanResult`) and a run's cost, as data."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from overlap.config import OverlapConfig
from overlap.step_model.kernels import STACKS
from overlap.tools.plan.estimate import Cluster, Estimate, check_whole_nodes
from overlap.tools.plan.layout import ParallelDims, PpSchedule, data_parallel_degree
from overlap.tools.plan.models import AC_POLICIES, DEFAULT_MFU, GPUS, AcPolicy, ModelProfile, gpu_spec
from overlap.tools.plan.scaling import SCALING_GPUS, ScalingPoint
from overlap.tools.plan.search import SearchResult

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
    """Inter-node link: a preset of `overlap.step_model.cost.LINKS` or an `overlap bench comm --json` file."""
    intra_link: str = "nvlink4"
    """Link between the GPUs of one node (preset or bench JSON)."""
    gpu: str = "h100-sxm"
    """A preset of `overlap.tools.plan.models.GPUS`."""
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
    calibration: str | None = None
    """A calibration JSON (`overlap plan --calibrate FILE`, or `from_trace`): its links replace
    the preset of the level it was measured on; its contention, lanes and host work apply
    ([Note: one model] in overlap/step_model/calibration.py). None: the link and GPU presets alone."""
    tp: int = 1
    """Tensor-parallel degree, inside a node ([Note: 3-D layout] in layout.py). With tp or pp > 1
    `local_batch` is the sequences of one data-parallel rank, shared by its tp x pp GPUs
    (torchtitan's convention)."""
    pp: int = 1
    """Pipeline-parallel degree."""
    microbatches: int | None = None
    """Pipeline micro-batches per step (None: pp)."""
    pp_schedule: PpSchedule = "1f1b"
    virtual_stages: int = 1
    """Stages per rank under the interleaved schedule."""
    async_tp: bool = False
    """Tensor-parallel collectives hidden behind the matmuls (default: exposed)."""
    stack: str = "torch-eager"
    """The kernels a preset model's blocks run on (`overlap.step_model.stacks.STACKS`): the
    kernel model prices each block on the GPU from them, unless `mfu` or `tflops` gives a rate."""

    def __post_init__(self) -> None:
        check_whole_nodes(self.num_gpus, self.gpus_per_node)
        data_parallel_degree(self.dims, self.num_gpus, self.gpus_per_node)
        if self.stack not in STACKS:
            raise ValueError(f"unknown --stack {self.stack!r}; use one of {sorted(STACKS)}")
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
                f"--tflops must be in (0, {gpu_spec(self.gpu).peak_tflops}] (the {self.gpu} peak), got {self.tflops!r}"
            )
        if (self.gpu_hour_price is None) != (self.tokens is None):
            raise ValueError("--gpu-hour-price and --tokens go together: give both to price the run")
        for name in ("gpu_hour_price", "tokens"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {value!r}")

    @property
    def dims(self) -> ParallelDims:
        return ParallelDims(tp=self.tp, pp=self.pp, microbatches=self.microbatches, pp_schedule=self.pp_schedule,
                            virtual_stages=self.virtual_stages, async_tp=self.async_tp)  # fmt: skip

    @property
    def kernels(self) -> str | None:
        """The kernel stack compute is priced with, or None when a rate was given."""
        return self.stack if self.mfu is None and self.tflops is None else None

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
                **({} if e.parallel is None else {"parallel": parallel_dict(e)}),
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


def parallel_dict(e: Estimate) -> dict[str, Any]:
    """The tensor/pipeline terms of `e` for --json (seconds per step unless per micro-batch)."""
    b = e.parallel
    assert b is not None
    d, lay = b.layout.dims, b.layout
    return {
        "tp": d.tp, "pp": d.pp, "dp": lay.dp, "microbatches": d.num_microbatches, "pp_schedule": d.pp_schedule,
        "virtual_stages": d.virtual_stages, "async_tp": d.async_tp, "layers_per_rank": b.layers_per_rank,
        "microbatch_size": b.microbatch_size, "dp_link": lay.dp_link.name, "dp_crosses_nodes": lay.dp_crosses_nodes,
        "tp_link": lay.tp_link.name, "pp_link": lay.pp_link.name,
        "microbatch_s": b.microbatch_s, "fsdp_microbatch_s": b.fsdp_microbatch_s, "reduce_tail_s": b.reduce_tail_s,
        "tp_collectives_per_microbatch": b.tp.num_collectives, "tp_bytes_each": b.tp.bytes_each,
        "tp_busy_s": d.num_microbatches * b.tp.busy_s, "tp_exposed_s": d.num_microbatches * b.tp.exposed_s,
        "p2p_s": d.num_microbatches * b.p2p_microbatch_s, "bubble_s": b.bubble_s, "bubble_fraction": b.bubble_fraction,
    }  # fmt: skip
