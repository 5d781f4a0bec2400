"""`OverlapConfig`: every knob of `overlap.wrap`, documented and validated in one place."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn as nn

# The codec names live in the compression registry alone ([Note: adding a codec]); it does not
# import this module.
from overlap.compression.registry import block_residual_codecs, check_codec_name

UnitPolicy = Literal["auto"] | frozenset[type[nn.Module]] | Callable[[nn.Module], bool]

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_RESIDUAL_DTYPES = {  # overlap.compression.feedback.RESIDUAL_DTYPES
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
}


def check_divide_factor(factor: Any) -> None:
    """`gradient_divide_factor` is None or a finite number > 0 (an int is taken as it is)."""
    if factor is None:
        return
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor <= 0:
        raise ValueError(f"gradient_divide_factor must be None or a finite number > 0, got {factor!r}")


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    if dtype is None:
        return None
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, kw_only=True)
class OverlapConfig:
    """How `overlap.wrap` shards a model and schedules its communication.

    Keyword overrides passed to `overlap.wrap(model, field=value)` replace fields of this config.
    """

    unit_policy: Any = "auto"
    """Which modules become units (one all-gather / one reduce-scatter each).
    "auto": the repeated blocks, i.e. children of a ModuleList, ModuleDict or Sequential whose
    class occurs at least twice there (the layers of a transformer); a set of module classes; or
    a callable `module -> bool`. Parameters outside every unit belong to the root unit. `wrap`
    warns, naming the unit and its share, when one unit holds most of the parameters and
    several repeated blocks (a policy that names none of their classes, or `min_unit_numel`
    merging them)."""

    min_unit_numel: int = 0
    """Consecutive units (in registration order) are merged until each holds at least this many
    elements: the shard granularity. Bigger units mean fewer, larger collectives (better on
    high-latency links) and more memory per unsharded unit. 0 keeps the policy's units."""

    prefetch_depth: int = 1
    """How many units ahead of the one computing are all-gathered, in forward and in backward.
    0 gathers each unit only when it is needed (no overlap)."""

    max_inflight_allgather_bytes: int | None = None
    """Byte cap on unsharded parameters held at once (being gathered or gathered, the unit in use
    included). Prefetch stops at the cap; the unit that is needed now is always gathered.
    None: no cap beyond `prefetch_depth`."""

    reshard_after_forward: bool = True
    """True frees each unit's unsharded parameters after its forward and gathers them again for
    backward (ZeRO-3), except the units `keep_for_backward_bytes` keeps. False keeps them until
    the unit's backward is done (ZeRO-2: one all-gather per step, more memory)."""

    keep_for_backward_bytes: int = 128 * 2**20
    """With reshard_after_forward: the last units of the forward, whose backward runs first, stay
    gathered from their forward until their backward, while their unsharded bytes add up to at
    most this. Each kept unit saves one all-gather per step (a third of ZeRO-3's traffic for
    that unit) and holds its unsharded bytes in the meantime, outside the prefetch budget. The
    last unit is always kept, as FSDP2 keeps its root's. 0: only the last unit (strict ZeRO-3,
    FSDP2's default). Ignored when `max_inflight_allgather_bytes` is set (that cap bounds every
    unsharded byte). See [Note: units kept for backward] in schedule.py.
    Why 128 MiB by default: a fixed amount, not a share of the model, so it does not grow with
    the model or shrink ZeRO-3's 1/N scaling. Small units, where the second gather is a large
    share of the step (W1 on 2 ranks: 8 units of 12 MiB, all kept), lose it; large models
    (a unit over 64 MiB, e.g. a 7B model's 400 MB bf16 blocks) keep only the last unit, as
    FSDP2. DeepSpeed ZeRO-3 keeps up to 1e9 parameters live by default
    (stage3_max_live_parameters, stage3_max_reuse_distance)."""

    reduce_scatter_bucket_bytes: int = 0
    """Gradients of consecutive units (in backward order) are reduce-scattered together once their
    bytes reach this size. 0 reduces every unit on its own, as soon as its gradients are ready."""

    max_reduce_inputs: int = 1
    """Reduce-scatter inputs (a bucket's unsharded gradients, rank-major) alive at once. Before a
    bucket allocates its input, the oldest live one is released: on CUDA the compute stream waits
    for that reduce-scatter and the buffer is freed, as FSDP2 keeps one; on CPU the training thread
    waits for it. 1 (FSDP2's default) bounds gradient memory to one bucket in flight; more lets
    several reduce-scatters queue on a slow link at the cost of one bucket each. See
    [Note: reduce buffers] in schedule.py."""

    reduce_scatter_impl: str = "auto"
    """How gradients are reduce-scattered: "native" (the backend's reduce-scatter), "all_to_all"
    (all-to-all, then a local sum in rank order), or "auto": all_to_all on gloo, whose own
    reduce-scatter puts twice the bytes on the wire, native elsewhere (NCCL)."""

    all_gather_impl: str = "auto"
    """How uncompressed parameters are all-gathered: "native" (the backend's all-gather),
    "all_to_all" (every rank sends its shard to every rank: the same bytes on the wire, one more
    unit-sized send buffer while it runs), or "auto": all_to_all on gloo for units of at most
    512 KiB (gathered), where gloo's all-gather costs more CPU per call, native otherwise and
    elsewhere (NCCL). With all_to_all on both sides, a backward all-gather issued right after a gradient
    reduction in the same group travels in the same all-to-all: one collective instead of two
    per unit in backward. See [Note: all-gather through all-to-all] in transport/collectives.py and
    [Note: fused exchange] in transport/gloo.py."""
    shared_memory: str = "auto"
    """How ranks of the shard group that share one host exchange CPU tensors: "auto" (through
    shared-memory segments when every rank of the group is on this host, found at wrap: the
    all-gathers and reduce-scatters never leave the machine's memory), or "off" (through the
    process group's backend, gloo). HSDP's sums across replicas go through shared memory too where
    every rank of the replicate group is on this host (transport/shm_all_reduce.py); codecs'
    exchanges stay on the backend. See [Note: shared-memory exchange] in transport/shm.py."""
    symmetric_memory: bool = False
    """CUDA over NCCL: allocate every all-gather's output in torch's symmetric memory, so that
    NCCL runs its symmetric or copy-engine all-gather (one-shot copies that leave the SMs to
    compute). Off by default; ignored with a warning for CPU tensors. See transport/symm_mem.py."""

    hybrid_mode: str = "replicate"
    """What a 2-D DeviceMesh (outer, inner) passed as `group` means (ignored for a 1-D group):
    "replicate" (HSDP): shard over the inner dimension, replicate over the outer one; reduced
    gradient shards are all-reduced across replicas. "secondary" (ZeRO++ hpZ): shard over every
    rank of the mesh, and after each unit's forward all-gather keep a secondary copy sharded over
    the inner dimension only, so the backward all-gather stays inside the inner group (a node)
    instead of crossing the outer link. It costs 1/inner of the model per rank until the unit's
    gradients are reduced. See [Note: hybrid sharding] in engine/groups.py."""

    param_dtype: torch.dtype | None = None
    """Dtype of the all-gathered parameters and of the forward/backward compute (mixed precision);
    floating inputs of the root forward are cast to it. The sharded master parameters, their
    gradients and the optimizer state stay in the parameters' own dtype. None: no cast."""

    reduce_dtype: torch.dtype | None = None
    """Dtype in which gradients are reduce-scattered. None: `param_dtype` if set, else the
    parameters' dtype."""

    gradient_divide_factor: float | None = None
    """What the sum of the data-parallel ranks' gradients is divided by (FSDP2's
    `set_gradient_divide_factor`; `model.set_gradient_divide_factor(f)` changes it between
    steps). None: the number of data-parallel ranks (shard x replicate), i.e. the mean, as DDP
    and FSDP2 by default. 1.0: the plain sum, for a loss already divided by the global token
    count (torchtitan's default); exact: no division runs. Any other value f > 0: the sum
    divided by f, once, after the reduction (as FSDP2 does with a factor). Also the experts'
    divisor under expert parallelism. Saved in `overlap.checkpoint` and restored from it."""

    cpu_keep_freed_memory: bool = True
    """CPU only: ask glibc (mallopt) to keep freed large blocks in the heap for reuse instead of
    returning them to the OS, as CUDA's caching allocator does. ZeRO-3 frees and re-allocates
    every unit's unsharded buffer twice a step; with glibc's default each re-allocation is fresh
    mmap'd memory whose first touch page-faults (~7 ms per 12 MiB here). Process-wide: it affects
    every allocation of the process, and resident memory stays at its high-water mark.
    Why it stays on by default: with the reduce-scatter inputs bounded (`max_reduce_inputs`) the
    memory it costs is small, and the time it saves is not. Measured on the 12-layer encoder
    workload of `overlap bench memory` (2 ranks, AdamW): peak RSS 2,094 MiB per rank with it,
    2,020 without (+3.6%), both below FSDP2's 2,310; on W1 the step is 1.317x its compute floor
    with it and 1.359x without (benchmarks/RESULTS.md). Turn it off when RSS matters more than
    step time."""

    collective_timeout_s: float | None = None
    """Seconds a wait on an all-gather or reduce-scatter may take before it raises (a dead or
    stuck rank becomes an error instead of a hang). None: the process group's own timeout
    (`init_process_group(timeout=...)`). On a stream-ordered backend (CUDA tensors over NCCL)
    it does not bound the training collectives, and `wrap` warns when it is set: a wait with a
    timeout there blocks the CPU until the collective is done, which would cancel every overlap.
    A hang there ends in NCCL's watchdog abort after `init_process_group(timeout=...)`, the
    setting to use. It still bounds the blocking waits of wrap's rank-0 sync and of the full
    state dict's export and load."""

    trace_dir: str | None = None
    """Write a Chrome/Perfetto trace of the last few steps (one `trace_rank{r}.json` per rank)
    into this folder; the environment variable OVERLAP_TRACE=dir does the same. None: off."""

    metrics_file: str | None = None
    """Append one JSON line of telemetry per step (step and gap times, exposed comm, bytes, RSS,
    CPU time; GPU memory, utilization, power, PCIe/NVLink through NVML on GPUs). "{rank}" in the
    path is replaced by the rank. None: off."""

    alert_exposed_comm_share: float | None = None
    """Warn (logger "overlap") when exposed communication exceeds this share of a step."""

    alert_collective_slowdown: float | None = None
    """Warn when a collective takes more than this multiple of its running median."""

    alert_step_gap_ms: float | None = None
    """Warn when the time between steps (optimizer, data loading) exceeds this."""

    alert_memory_bytes: int | None = None
    """Warn when GPU memory in use (or RSS on CPU) exceeds this."""

    param_compression: str | None = None
    """Codec for the weight all-gather: None, "bf16", "int8" or "fp8" (blockwise absmax), or a
    name added with `overlap.compression.register_codec`. The fp32 master shards stay exact; only
    the copy on the wire is compressed, and every rank (this one included) computes with the
    decoded values."""

    grad_compression: str | None = None
    """Codec for the gradient reduce-scatter: None, "bf16", "int8" or "int4", or a name added
    with `overlap.compression.register_codec`. Compressed gradients travel by all-to-all (each
    rank's chunk for rank r is encoded and sent to r) and are decoded and summed in fp32 on the
    receiver."""

    compression_block_size: int | None = None
    """Elements per scale for the blockwise codecs (None: the codec's default, 256 for int8 and
    fp8, 128 for int4)."""

    stochastic_rounding: bool = False
    """Round gradient codes stochastically (unbiased, no extra memory) instead of to nearest."""

    error_feedback: bool = False
    """Carry what gradient quantization dropped into the next step's gradient (needs
    `grad_compression`). Costs a residual of (world_size - 1) / world_size of the unsharded
    gradient per rank (this rank's own chunk is never quantized), in `error_feedback_dtype`.
    The residuals are training state (checkpoints keep them)."""

    error_feedback_dtype: torch.dtype = torch.float32
    """How the residual is stored ([Note: error feedback residual] in compression/feedback.py):
    - float32: 4 bytes per element; exact (decoded + residual == gradient): nothing is lost.
    - bfloat16: 2 bytes; each residual rounded to 8 significant bits.
    - int8: 1 + 4 / block bytes (int8 codes and an fp32 scale per codec block); for the
      blockwise codecs "int8" and "int4" only. Each element within 1/254 of its block's
      quantization bound; that rounding is not fed back (a drift of at most bound / 254 per step).
    At two ranks with fp32 AdamW, int8 gradients + feedback keep 10 B/param of state with a
    float32 residual (0.625x DDP's 16), 9 with bfloat16 (0.5625x), 8.51 with int8 (0.532x;
    measured by `overlap bench memory`). Use int8 where that memory decides what fits: it kept
    the effect of feedback in our runs (int4, 200 steps, tiny LM: parameter error against DDP
    0.189 with an int8 residual, 0.178 float32, 0.430 without feedback; a 100-step GPT run
    of benchmarks/convergence.py within noise of float32), and costs ~1.7x the encode time of
    the fused float32 path on CPU (a decode and an encode of the residual per chunk). float32
    stays the default: exact, and the cheapest encode. It is about (world_size - 1) / world_size
    of the fp32 model per device, often more than the sharded state beside it: on an accelerator
    `wrap` warns the bytes it will take and this knob (on the CPU it says nothing). Names
    ("float32", "bfloat16", "int8") are accepted too."""

    sync_module_states: bool = True
    """Every rank starts from rank 0's parameter and buffer values, as DDP promises: `wrap`
    scatters each unit's shards from rank 0 (one collective per unit; the source sends the model
    once, no rank receives more than its shards) and broadcasts the buffers. On a 2-D mesh the
    source is mesh[0][0] and every replica gets its values. A meta-device model is then
    initialized on rank 0 only. False skips this when the values are already identical on every
    rank (meta-device init under one seed, or a checkpoint loaded afterwards): each rank shards
    its own values, and ranks seeded differently silently train a mix of initializations. See
    [Note: sync from the source] in source_values.py."""

    autotune: bool = False
    """Tune the schedule's knobs while training: `prefetch_depth`, `max_inflight_allgather_bytes`
    (when set), `reduce_scatter_bucket_bytes` (not with `grad_compression`),
    `keep_for_backward_bytes` and `max_reduce_inputs` move toward a faster step (first the
    settings the tools' model, fitted to the first steps, predicts fastest; then one knob at a
    time), measured on every rank, within `autotune_memory_bytes`; every rank takes the same decision at
    the same step. The knobs decide when collectives run, not what they carry: on gloo the numbers
    do not change; on NCCL a bucket move can change the last bit of a reduced gradient (NCCL's
    algorithm follows the message size). It settles after a few dozen steps, then looks again
    every 50 steps and searches again when the step drifts by more than 10%. The configured
    values are where it starts. `overlap.tuned_config(model)` is the result. See [Note: autotune] in
    engine/autotune_policy.py. Off by default (README "Tuning": when it pays)."""

    autotune_memory_bytes: int | None = None
    """With `autotune`: the cap on each rank's measured memory peak (CUDA `max_memory_allocated`,
    CPU the process's peak RSS), read with the optimizer state in: a move predicted to cross it is
    never tried, one measured over it never kept. None: 90% of the device's memory (CPU: of the
    RAM), shared by the ranks on it. See [Note: autotune memory] in engine/autotune_memory.py."""

    autotune_dir: str | None = None
    """With `autotune`: rank 0 writes `autotune.json` (each decision, and per step the knobs and
    times; `overlap report DIR` draws it) and `tuned_config.json` (this config with the best knobs
    so far, autotune off) here at each decision. None: `trace_dir` when set, else nothing is written (the
    decisions are still logged, logger "overlap.autotune"). Also `calibration.json`: the model
    fitted to this run's first steps, for `overlap plan --calibration` and `overlap tune
    --calibration` ([Note: the model fitted online] in overlap/step_model/online.py)."""

    autotune_calibration: str | None = None
    """With `autotune`: a calibration file (`overlap plan --calibrate FILE`, or an earlier run's
    `calibration.json`) the tuner's model starts from: its links, contention and host work; the
    link and compute scales are then fitted to this run's first steps. None: the tools' defaults
    for the backend. See [Note: the model fitted online]."""

    def __post_init__(self) -> None:
        policy = self.unit_policy
        if isinstance(policy, (set, list, tuple)):
            object.__setattr__(self, "unit_policy", frozenset(policy))
            policy = self.unit_policy
        if not (policy == "auto" or callable(policy) or isinstance(policy, frozenset)):
            raise ValueError(f"unit_policy must be 'auto', a set of nn.Module classes or a callable, got {policy!r}")
        if isinstance(policy, frozenset) and not all(isinstance(c, type) and issubclass(c, nn.Module) for c in policy):
            raise ValueError(f"unit_policy set must hold nn.Module classes, got {set(policy)!r}")
        non_negative = ("min_unit_numel", "prefetch_depth", "reduce_scatter_bucket_bytes", "keep_for_backward_bytes")
        for name in non_negative:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if (
            not isinstance(self.max_reduce_inputs, int)
            or isinstance(self.max_reduce_inputs, bool)
            or self.max_reduce_inputs < 1
        ):
            raise ValueError(f"max_reduce_inputs must be an int >= 1, got {self.max_reduce_inputs!r}")
        if self.reduce_scatter_impl not in ("auto", "native", "all_to_all"):
            raise ValueError(
                f"reduce_scatter_impl must be 'auto', 'native' or 'all_to_all', got {self.reduce_scatter_impl!r}"
            )
        if self.all_gather_impl not in ("auto", "native", "all_to_all"):
            raise ValueError(f"all_gather_impl must be 'auto', 'native' or 'all_to_all', got {self.all_gather_impl!r}")
        if self.shared_memory not in ("auto", "off"):
            raise ValueError(f"shared_memory must be 'auto' or 'off', got {self.shared_memory!r}")
        if self.hybrid_mode not in ("replicate", "secondary"):
            raise ValueError(f"hybrid_mode must be 'replicate' or 'secondary', got {self.hybrid_mode!r}")
        timeout = self.collective_timeout_s
        if timeout is not None and (isinstance(timeout, bool) or not timeout > 0):
            raise ValueError(f"collective_timeout_s must be None or > 0, got {timeout!r}")
        cap = self.max_inflight_allgather_bytes
        if cap is not None and (not isinstance(cap, int) or cap <= 0):
            raise ValueError(f"max_inflight_allgather_bytes must be None or an int > 0, got {cap!r}")
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if isinstance(value, str):
                if value not in _DTYPES:
                    raise ValueError(f"{name} must be one of {sorted(_DTYPES)}, got {value!r}")
                object.__setattr__(self, name, _DTYPES[value])
            elif value is not None and value not in _DTYPES.values():
                raise ValueError(f"{name} must be a floating torch.dtype or None, got {value!r}")
        check_divide_factor(self.gradient_divide_factor)
        check_codec_name("param_compression", self.param_compression)
        check_codec_name("grad_compression", self.grad_compression)
        ef_dtype = self.error_feedback_dtype
        if isinstance(ef_dtype, str):
            ef_dtype = _RESIDUAL_DTYPES.get(ef_dtype, ef_dtype)
            object.__setattr__(self, "error_feedback_dtype", ef_dtype)
        if ef_dtype not in _RESIDUAL_DTYPES.values():
            raise ValueError(
                "error_feedback_dtype must be torch.float32, torch.bfloat16 or torch.int8 (or "
                f"their names), got {ef_dtype!r}"
            )
        blockwise = block_residual_codecs()
        if self.error_feedback and ef_dtype == torch.int8 and self.grad_compression not in blockwise:
            raise ValueError(
                "error_feedback_dtype=torch.int8 stores the residual per codec block: it needs "
                f"grad_compression={' or '.join(map(repr, blockwise))}, "
                f"got {self.grad_compression!r}; use "
                "error_feedback_dtype=torch.float32 or torch.bfloat16"
            )
        block = self.compression_block_size
        if block is not None and (not isinstance(block, int) or block <= 0 or block % 2):
            raise ValueError(f"compression_block_size must be None or an even int > 0, got {block!r}")
        if self.error_feedback and self.grad_compression is None:
            raise ValueError("error_feedback=True needs a grad_compression codec")
        if not isinstance(self.sync_module_states, bool):
            raise ValueError(f"sync_module_states must be True or False, got {self.sync_module_states!r}")
        if not isinstance(self.autotune, bool):
            raise ValueError(f"autotune must be True or False, got {self.autotune!r}")
        cap = self.autotune_memory_bytes
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap <= 0):
            raise ValueError(f"autotune_memory_bytes must be None or an int > 0, got {cap!r}")
        cal = self.autotune_calibration
        if cal is not None and not isinstance(cal, str):
            raise ValueError(f"autotune_calibration must be None or a file path, got {cal!r}")

    def replace(self, **overrides: Any) -> OverlapConfig:
        """A copy with `overrides` applied; unknown names raise `TypeError`."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise TypeError(f"unknown OverlapConfig field(s) {unknown}; fields are {sorted(names)}")
        return dataclasses.replace(self, **overrides)

    def to_dict(self) -> dict[str, Any]:
        if self.unit_policy != "auto":
            raise ValueError("only unit_policy='auto' can be saved as JSON")
        out = dataclasses.asdict(self)
        out["param_dtype"] = _dtype_name(self.param_dtype)
        out["reduce_dtype"] = _dtype_name(self.reduce_dtype)
        out["error_feedback_dtype"] = _dtype_name(self.error_feedback_dtype)
        return out

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> OverlapConfig:
        return cls(**json.loads(Path(path).read_text()))


DEFAULT_CONFIG = OverlapConfig()
