"""The FSDP path of the planner: a cluster, units from the model profile, the simulator's step,
throughput, memory. `estimate()` in estimate.py picks this path or parallel.py's, which builds on
this module's units and memory.

`estimate_fsdp()` turns a `ModelProfile` and an `OverlapConfig` into the simulator's `UnitCost`s
(units merged by `min_unit_numel` exactly as `overlap.wrap` merges them, bytes from the config's
dtypes and codecs, seconds from FLOPs at an achieved rate), replays the runtime's schedule on the
virtual clock, and adds what the schedule does not know: the optimizer step, tokens per second,
MFU and memory per GPU.

[Note: memory per GPU]
    sharded state      fp32 master parameters, fp32 gradients and AdamW's two moments:
                       16 bytes per parameter, divided by the world size
    root               the root unit (embeddings, final norm, head) stays unsharded all step
    units in flight    the simulator's peak of gathered or gathering units (param dtype)
    gradient buffers   the simulator's peak of buckets issued and not yet reduced (reduce
                       dtype), plus one unit's unsharded gradients being produced (param dtype)
    error feedback     the residual's rows for the peer ranks, (W-1)/W of a full gradient in
                       `error_feedback_dtype` (int8: codes + an fp32 scale per codec block)
    activations        an estimate from the model's shape (see `TransformerShape`), not a
                       measurement; allocator fragmentation and workspaces come on top
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from overlap.compression import make_grad_codec, make_param_codec, make_residual_format
from overlap.config import OverlapConfig
from overlap.engine.units import group_units
from overlap.step_model.calibration import Calibration, codec_path, default_calibration
from overlap.step_model.cost import LINKS, Link, Topology, UnitCost
from overlap.step_model.hardware import accelerator
from overlap.step_model.kernels import block_seconds, head_seconds
from overlap.step_model.moe import moe_seconds
from overlap.step_model.simulate import Prediction
from overlap.step_model.stacks import stack as kernel_stack
from overlap.tools.plan.layout import ParallelBreakdown, ParallelDims
from overlap.tools.plan.models import GpuSpec, ModelProfile

MASTER_BYTES_PER_PARAM = 4  # fp32 master shard
SHARDED_STATE_BYTES_PER_PARAM = 16  # fp32 master + fp32 gradient + AdamW exp_avg, exp_avg_sq
OPTIMIZER_BYTES_PER_PARAM = 28
"""HBM traffic of a fused AdamW step per sharded parameter: read parameter, gradient and both
moments, write parameter and both moments, 4 bytes each. Priced at the datasheet bandwidth."""


def rails_link(inter: Link, intra: Link, ranks_per_node: int) -> Link:
    """A per-GPU preset inter-node link as a ring with `ranks_per_node` ranks in each node sees
    it (each rank its own adapter, capped by the intra-node link); a measured link (not a
    preset: its busbw is what the ring sustained) is returned as it is."""
    if LINKS.get(inter.name) is not inter or ranks_per_node <= 1:
        return inter
    busbw = min(intra.busbw_gbps, ranks_per_node * inter.busbw_gbps)
    return Link(f"{inter.name} x {ranks_per_node} rails", inter.alpha_s, busbw, inter.source)


def check_whole_nodes(num_gpus: int, gpus_per_node: int) -> None:
    """ValueError unless both counts are positive ints and the GPUs fill whole nodes (or fewer
    GPUs than one node)."""
    for name, value in (("num_gpus", num_gpus), ("gpus_per_node", gpus_per_node)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if num_gpus > gpus_per_node and num_gpus % gpus_per_node:
        raise ValueError(
            f"--gpus {num_gpus} is not a multiple of --gpus-per-node {gpus_per_node}; plan whole "
            f"nodes (e.g. --gpus {num_gpus // gpus_per_node * gpus_per_node}) or fewer GPUs than one node"
        )


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """Where the model trains: GPUs, how they are grouped into nodes, links, compute rate."""

    num_gpus: int
    gpus_per_node: int
    gpu: GpuSpec
    intra: Link
    """Link between GPUs of one node (NVLink)."""
    inter: Link
    """Link between nodes, per GPU (InfiniBand, Ethernet)."""
    achieved_tflops: float
    """Rate of the model's compute kernels (recomputation included), TFLOPs per GPU."""
    calibration: Calibration | None = None
    """Measured costs (`overlap plan --calibration FILE`): its links replace `intra` or `inter`
    (the level it was measured on; `with_calibration`), its contention, lanes and host work
    apply. None: NCCL on the link presets, no contention, no host work ([Note: one model] in
    overlap/step_model/calibration.py)."""
    kernels: str | None = None
    """A kernel stack of `overlap.step_model.stacks.STACKS`: each block of a preset model is
    priced by the kernel model (GEMMs, attention, element-wise bytes on this GPU) instead of
    FLOPs at `achieved_tflops`. None, or a module-path model: FLOPs at `achieved_tflops`."""
    dims: ParallelDims = ParallelDims()
    """Tensor and pipeline parallel degrees; overlap shards over the data-parallel rest
    ([Note: 3-D layout] in layout.py). Default: FSDP over every GPU."""

    def __post_init__(self) -> None:
        check_whole_nodes(self.num_gpus, self.gpus_per_node)
        if not self.achieved_tflops > 0:
            raise ValueError(f"achieved TFLOPs must be > 0, got {self.achieved_tflops!r}")

    def with_calibration(self, calibration: Calibration) -> Cluster:
        """This cluster with `calibration`'s gather link on the level it was measured on. A
        gloo calibration (CPU ranks) gives its links only: its host work, contention and lanes
        are those of CPU ranks, not of GPUs with comm streams."""
        if calibration.backend != "nccl":
            calibration = replace(calibration, backend="nccl", host={}, compute_share_lost=0.0, comm_stretch=1.0,
                                  concurrent_throughput=None, source=f"{calibration.source}, links only")  # fmt: skip
        return replace(self, calibration=calibration, **{calibration.level: calibration.gather_link})

    def model(self) -> Calibration:
        """The calibration every prediction on this cluster runs through."""
        if self.calibration is not None:
            return self.calibration
        return default_calibration("nccl", self.num_gpus, self.topology().link())

    @property
    def num_nodes(self) -> int:
        return max(1, self.num_gpus // self.gpus_per_node)

    def topology(self) -> Topology:
        """Two levels; a calibration's reduction link where the ring crosses its level. A preset
        inter-node link is one adapter per GPU: a ring with k ranks in each node drives k of them
        at once (NCCL's rails, [Note: rails] in overlap/step_model/hardware.py), up to NVLink."""
        topo = Topology(
            self.num_gpus, self.gpus_per_node, self.intra, rails_link(self.inter, self.intra, self.gpus_per_node)
        )
        cal = self.calibration
        if cal is not None and cal.reduce_link is not None:
            level = "inter" if self.num_gpus > self.gpus_per_node else "intra"
            if level == cal.level:
                topo = replace(topo, reduce_link=cal.reduce_link)
        return topo

    def with_gpus(self, num_gpus: int) -> Cluster:
        return replace(self, num_gpus=num_gpus)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU by kind; see [Note: memory per GPU]."""

    sharded_state_bytes: float
    root_bytes: int
    units_in_flight_bytes: int
    grad_buffer_bytes: int
    error_feedback_bytes: int
    activation_bytes: float | None

    @property
    def total_bytes(self) -> float:
        return (
            self.sharded_state_bytes
            + self.root_bytes
            + self.units_in_flight_bytes
            + self.grad_buffer_bytes
            + self.error_feedback_bytes
            + (self.activation_bytes or 0.0)
        )


@dataclass(frozen=True)
class Estimate:
    """The predicted steady-state step of one config on one cluster."""

    config: OverlapConfig
    prediction: Prediction
    memory: MemoryEstimate
    num_units: int
    num_gpus: int
    optimizer_s: float
    tokens_per_gpu_step: float
    model_flops_per_token: float
    peak_tflops: float
    hbm_bytes: float
    parallel: ParallelBreakdown | None = None
    """The tensor/pipeline terms of the step (None: FSDP over every GPU)."""

    @property
    def step_s(self) -> float:
        return self.prediction.step_s

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_gpu_step / self.step_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_s_per_gpu * self.num_gpus

    @property
    def mfu(self) -> float:
        """Model FLOPs per second over peak: exposed comm, recomputation and the optimizer
        step all lower it (the input --mfu is the rate of the compute kernels alone)."""
        return self.model_flops_per_token * self.tokens_per_s_per_gpu / (self.peak_tflops * 1e12)

    @property
    def exposed_share(self) -> float:
        return self.prediction.exposed_s / self.step_s

    @property
    def fits(self) -> bool:
        return self.memory.total_bytes <= self.hbm_bytes


def _elem_bytes(dtype: torch.dtype | None) -> int:
    return MASTER_BYTES_PER_PARAM if dtype is None else torch.empty((), dtype=dtype).element_size()


def dtype_bytes(config: OverlapConfig) -> tuple[int, int]:
    """Bytes per element of the all-gathered parameters and of the reduced gradients."""
    param = _elem_bytes(config.param_dtype)
    reduce = _elem_bytes(config.reduce_dtype) if config.reduce_dtype is not None else param
    return param, reduce


def group_blocks(profile: ModelProfile, min_unit_numel: int) -> list[tuple[int, ...]]:
    """Block indices of each unit, merged as `overlap.wrap` merges them (`group_units`)."""
    names = [str(i) for i in range(len(profile.block_numels))]
    numels = dict(zip(names, profile.block_numels))
    return [tuple(int(n) for n in group) for group in group_units(names, numels, min_unit_numel)]


def _codec_cost(
    kind: str, config: OverlapConfig, numel: int, dtype_bytes_: int, hbm_tbps: float
) -> tuple[int | None, float]:
    """Wire bytes and kernel seconds of one unit's compressed collective (None, 0: no codec).

    Kernel time: encode and decode are memory-bound, reading the raw bytes and the codes once
    each at the datasheet bandwidth; an assumption until `overlap bench` measures them on GPU.
    """
    name = config.param_compression if kind == "param" else config.grad_compression
    if name is None:
        return None, 0.0
    make = make_param_codec if kind == "param" else make_grad_codec
    codec = make(name, block_size=config.compression_block_size)
    dtype = {2: torch.bfloat16, 4: torch.float32}.get(dtype_bytes_, torch.float32)
    wire = codec.wire_bytes(numel, dtype)
    return wire, (numel * dtype_bytes_ + wire) / (hbm_tbps * 1e12)


def kernel_seconds(profile: ModelProfile, cluster: Cluster) -> tuple[tuple[float, float], tuple[float, float]] | None:
    """(forward, backward + recompute) seconds of one block and of the root (head and loss) from
    the kernel model, or None when the cluster asks for FLOPs at a rate (or the model has no
    shape)."""
    if cluster.kernels is None or profile.shape is None or not cluster.gpu.accelerator:
        return None
    shape, gpu, tp = profile.shape, accelerator(cluster.gpu.accelerator), profile.tensor_parallel
    tokens = profile.seq_len * profile.local_batch
    kernels = kernel_stack(cluster.kernels)
    forward = backward = 0.0
    for index in range(shape.num_layers):  # a MoE model's layers differ: their mean is each block's
        moe_layer = shape.is_moe_layer(index)
        window = shape.sliding_window if shape.is_sliding_layer(index) else 0
        b = block_seconds(shape.block(moe_layer=moe_layer), tokens, profile.seq_len, gpu, kernels, tp=tp,
                          recompute=profile.ac, window=window)  # fmt: skip
        forward, backward = forward + b.forward_s, backward + b.backward_s + b.recompute_s
        if moe_layer:
            assert shape.moe is not None  # every expert on every rank: no expert parallelism here
            e = moe_seconds(shape.moe, shape.hidden, tokens, gpu, tp=tp, etp=tp)
            forward += e.forward_s
            backward += e.backward_s + (e.forward_s if profile.ac == "full" else 0.0)
    layers = shape.num_layers
    return (forward / layers, backward / layers), head_seconds(tokens, shape.hidden, shape.vocab_size, gpu, tp)


def build_units(profile: ModelProfile, config: OverlapConfig, cluster: Cluster) -> list[UnitCost]:
    """The simulator's units: the root first (index 0), then the merged blocks in order."""
    tokens = profile.seq_len * profile.local_batch
    rate = cluster.achieved_tflops * 1e12
    param_b, reduce_b = dtype_bytes(config)
    hbm = cluster.gpu.hbm_tbps
    cal, path = cluster.model(), codec_path(config.param_compression, config.grad_compression)
    kernels = kernel_seconds(profile, cluster)

    def seconds(name: str, count: int, fwd_flops: float, recompute_flops: float) -> tuple[float, float]:
        if kernels is not None:
            fwd, bwd = kernels[1] if name == "root" else kernels[0]
            return count * fwd, count * bwd
        return tokens * fwd_flops / rate, tokens * (2.0 * fwd_flops + recompute_flops) / rate

    def unit(name: str, numel: int, fwd_flops: float, recompute_flops: float, count: int = 1) -> UnitCost:
        gather_wire, gather_codec_s = _codec_cost("param", config, numel, param_b, hbm)
        reduce_wire, reduce_codec_s = _codec_cost("grad", config, numel, reduce_b, hbm)
        return cal.unit(
            name,
            numel * param_b,
            numel * reduce_b,
            *seconds(name, count, fwd_flops, recompute_flops),
            codec=path,
            gather_wire_bytes=gather_wire,
            reduce_wire_bytes=reduce_wire,
            gather_codec_s=gather_codec_s,
            reduce_codec_s=reduce_codec_s,
        )

    units = [unit("root", profile.root_numel, profile.root_forward_flops, 0.0)]
    for group in group_blocks(profile, config.min_unit_numel):
        label = f"blocks.{group[0]}" if len(group) == 1 else f"blocks.{group[0]}-{group[-1]}"
        units.append(
            unit(
                label,
                sum(profile.block_numels[i] for i in group),
                sum(profile.block_forward_flops[i] for i in group),
                sum(profile.block_recompute_flops[i] for i in group),
                len(group),
            )
        )
    return units


def _error_feedback_bytes(profile: ModelProfile, config: OverlapConfig, world_size: int) -> float:
    """Per rank: one residual row per peer rank over this rank's 1/W of the gradient columns
    ([Note: error feedback residual] in compression/feedback.py)."""
    if not config.error_feedback or config.grad_compression is None:
        return 0
    codec = make_grad_codec(config.grad_compression, block_size=config.compression_block_size)
    fmt = make_residual_format(config.error_feedback_dtype, codec)
    return (world_size - 1) * fmt.row_nbytes(math.ceil(profile.num_params / world_size))


def estimate_fsdp(profile: ModelProfile, config: OverlapConfig, cluster: Cluster) -> Estimate:
    """Predict one steady-state training step of FSDP alone (`cluster.dims` is not read) through
    the cluster's calibration (by default nccl: one communicator, collectives in order; [Note:
    one model] in overlap/step_model/calibration.py)."""
    units = build_units(profile, config, cluster)
    shard_params = profile.num_params / cluster.num_gpus
    optimizer_s = OPTIMIZER_BYTES_PER_PARAM * shard_params / (cluster.gpu.hbm_tbps * 1e12)
    prediction = cluster.model().predict(units, config, topology=cluster.topology(), root=0, optimizer_s=optimizer_s)
    tokens = profile.seq_len * profile.local_batch
    memory = MemoryEstimate(
        sharded_state_bytes=SHARDED_STATE_BYTES_PER_PARAM * shard_params,
        root_bytes=units[0].param_bytes,
        units_in_flight_bytes=prediction.peak_unsharded_bytes,
        grad_buffer_bytes=prediction.peak_reduce_bytes + max(u.param_bytes for u in units[1:]),
        error_feedback_bytes=_error_feedback_bytes(profile, config, cluster.num_gpus),
        activation_bytes=None
        if profile.activation_bytes_per_token is None
        else profile.activation_bytes_per_token * tokens,
    )
    return Estimate(
        config=config,
        prediction=prediction,
        memory=memory,
        num_units=len(units) - 1,
        num_gpus=cluster.num_gpus,
        optimizer_s=optimizer_s,
        tokens_per_gpu_step=tokens,
        model_flops_per_token=profile.model_flops_per_token,
        peak_tflops=cluster.gpu.peak_tflops,
        hbm_bytes=cluster.gpu.hbm_gib * 2**30,
    )
