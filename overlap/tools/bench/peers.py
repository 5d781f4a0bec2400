"""Every contender of the benchmarks as one `Trainer`: overlap, FSDP2, DDP and the peers a user
would pick instead of overlap (DeepSpeed ZeRO-3, DDP compression hooks, FSDP2 with a bf16 reduce).

`overlap bench step`, `overlap bench memory` and benchmarks/convergence.py build their contenders
here, so each one is set up once, the same way everywhere:

    trainer = build_trainer("deepspeed-tuned", model, setup)
    loss = compute(trainer.model, batch); trainer.backward(loss); trainer.step(); trainer.zero_grad()

Contenders (same model, data, seed and optimizer for all: `TrainSetup.make_optimizer`, fp32)
  overlap[...]       overlap.wrap with "key=value,..." OverlapConfig overrides (`parse_overrides`)
  ddp                DistributedDataParallel
  fsdp2              fully_shard per unit, then the root; defaults
  fsdp2-tuned        + explicit next/previous-unit prefetch and async unshard (see `shard_fsdp2`)
  deepspeed          DeepSpeed ZeRO-3, its defaults (see [Note: DeepSpeed ZeRO-3 configs])
  deepspeed-tuned    ZeRO-3 with bucket sizes for the model's width
  ddp-bf16           DDP + torch's bf16_compress_hook (gradients all-reduced in bf16)
  ddp-fp16           DDP + fp16_compress_hook
  ddp-powersgd1      DDP + powerSGD_hook, rank 1 (see [Note: PowerSGD settings])
  ddp-powersgd4      DDP + powerSGD_hook, rank 4
  fsdp2-bf16reduce   fsdp2-tuned with MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)

A peer whose package is missing (`REQUIRES`) is dropped by `available` on the launcher, with one
line saying so, before any rank starts: a benchmark never crashes on it.

[Note: DeepSpeed ZeRO-3 configs]
Both run fp32 (no "fp16"/"bf16" section) with the caller's torch.optim.AdamW passed in, and
`train_micro_batch_size_per_gpu` = the per-rank batch. "deepspeed" sets nothing else that changes
the schedule: ZeRO-3's defaults (deepspeed/runtime/zero/config.py, 0.19.x) are overlap_comm=True,
reduce_bucket_size=5e8, stage3_prefetch_bucket_size=5e7, stage3_param_persistence_threshold=1e5
elements (smaller parameters are not partitioned at all). "deepspeed-tuned" sizes them for the
model's hidden size h the way the Hugging Face DeepSpeed integration fills its "auto" values
(transformers docs, "DeepSpeed" > ZeRO-3 config; transformers/integrations/deepspeed.py,
`trainer_config_finalize`): reduce_bucket_size = h*h, stage3_prefetch_bucket_size = 0.9*h*h,
stage3_param_persistence_threshold = 10*h, and overlap_comm=True stated explicitly. DeepSpeed's
own config docs describe these knobs without a sizing rule. Both set steps_per_print very high:
logging only. On CPU DeepSpeed needs DS_ACCELERATOR=cpu before its import (set here unless the
environment says otherwise), LOCAL_RANK (set to the rank for spawned local worlds), and it
JIT-builds a small shared-memory op on first use (~40-100 s, needs g++, cached under
TORCH_EXTENSIONS_DIR). Its CPU training path runs collectives through the torch gloo group we
already initialized (deepspeed.comm.TorchBackend); the shm op serves only inference all-reduce.

[Note: PowerSGD settings]
`PowerSGDState(process_group=None, matrix_approximation_rank=r, start_powerSGD_iter=
TrainSetup.powersgd_start_iter (2), use_error_feedback=True, warm_start=True, random_seed=0)`,
torch's other defaults (min_compression_rate=2: a tensor that would not shrink 2x, and every 1-D
tensor, is all-reduced uncompressed). torch requires start_powerSGD_iter >= 2 with error
feedback or warm start (DDP rebuilds its buckets after iteration 1); its default, 1000, would
never compress in a short run. Iterations before it are plain fp32 all-reduces. The hook imports
numpy.
On gloo the hook's chained collectives race: it all-reduces P, and the all-reduce of Q is issued
from P's completion callback, which runs on a gloo worker thread while the training thread goes on
launching the next bucket's all-reduce; the two ranks can then issue them in different orders
(seen: gloo aborting with "Received data size doesn't match expected size" in a few percent of
runs of `overlap bench step --contenders ddp,ddp-fp16,ddp-powersgd1`). `serialized_powersgd_hook`
waits for each bucket's chain before DDP launches the next one, so every collective is issued in
one order on every rank; PowerSGD then overlaps no communication with backward here. On NCCL the
callbacks run in stream order and the race does not arise.
"""

from __future__ import annotations

import ast
import importlib.util
import logging
import os
import typing
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

DEEPSPEED_PEERS = ("deepspeed", "deepspeed-tuned")
DDP_HOOK_PEERS = ("ddp-bf16", "ddp-fp16", "ddp-powersgd1", "ddp-powersgd4")
PEERS: tuple[str, ...] = (*DEEPSPEED_PEERS, *DDP_HOOK_PEERS, "fsdp2-bf16reduce")
"""The peer contenders, in report order."""
BASELINES: tuple[str, ...] = ("overlap", "fsdp2", "fsdp2-tuned", "ddp")
REQUIRES: dict[str, str] = {
    "deepspeed": "deepspeed",
    "deepspeed-tuned": "deepspeed",
    "ddp-powersgd1": "numpy",
    "ddp-powersgd4": "numpy",
}
"""The package (beyond torch) a contender imports: `pip install 'overlap[bench]'` brings both."""
POWERSGD_RANKS = {"ddp-powersgd1": 1, "ddp-powersgd4": 4}
LOSSY_OVERRIDES = ("param_dtype", "reduce_dtype", "param_compression", "grad_compression")
"""overlap overrides that change the numbers on the wire (the loss then drifts from DDP's)."""
DEEPSPEED_QUIET_STEPS = 10**9
"""`steps_per_print`: DeepSpeed's periodic log line, never in a benchmark."""


# ---------------------------------------------------------------------------------------------
# what every contender trains with, and the trainer it becomes


@dataclass(frozen=True, kw_only=True)
class TrainSetup:
    """What every contender shares. The model itself is passed to `build_trainer`, fresh and
    identically initialized for each contender."""

    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
    """Builds the optimizer over the parameters it is given (the same AdamW for everyone)."""
    units_of: Callable[[nn.Module], list[nn.Module]]
    """The model's blocks in forward order: FSDP2's `fully_shard` units."""
    micro_batch: int
    """Sequences per rank per step (DeepSpeed's `train_micro_batch_size_per_gpu`)."""
    hidden_size: int
    """The model's width: deepspeed-tuned's bucket sizes ([Note: DeepSpeed ZeRO-3 configs])."""
    max_grad_norm: float | None = None
    """Clip gradients by their global norm before each optimizer step (None: no clipping)."""
    powersgd_start_iter: int = 2
    """First iteration PowerSGD compresses ([Note: PowerSGD settings]); must be >= 2."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Where the model lives; "cuda" also selects DeepSpeed's CUDA accelerator."""

    def __post_init__(self) -> None:
        if self.micro_batch < 1 or self.hidden_size < 1:
            raise ValueError("TrainSetup: micro_batch and hidden_size must be >= 1")
        if self.powersgd_start_iter < 2:
            raise ValueError(
                f"TrainSetup.powersgd_start_iter={self.powersgd_start_iter}: torch's PowerSGD "
                "needs >= 2 with error feedback and warm start"
            )


@dataclass
class Trainer:
    """A model trained the way one contender trains it. Per step: call `model` for the forward
    (it may be a wrapper: DDP, a DeepSpeed engine), then `backward(loss)`, `step()` (clips when
    the setup asks, then updates) and `zero_grad()`."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    """The torch optimizer `TrainSetup.make_optimizer` built: LR schedulers act on it (also
    under DeepSpeed, which steps it as its inner optimizer)."""
    backward: Callable[[torch.Tensor], None]
    step: Callable[[], None]
    zero_grad: Callable[[], None]
    state_bytes: Callable[[], int]
    """Parameters + gradients + optimizer state + communication state (error feedback, PowerSGD
    memories) this rank holds, by accounting; transient buffers (DDP buckets, gathered units,
    DeepSpeed's reduce bucket) excluded."""
    lossy: bool = False
    """Its communication changes the numbers (compression, low precision): not DDP-exact."""
    settings: dict[str, Any] = field(default_factory=dict)
    """What it was configured with beyond its defaults, for the report (JSON-safe)."""


def parse_overrides(spec: str) -> dict[str, Any]:
    """ "key=value[,key=value]" -> overlap.wrap overrides; values as Python literals, else str."""
    overrides: dict[str, Any] = {}
    for item in filter(None, spec.split(",")):
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"--overlap-config expects key=value[,key=value], got {item!r}")
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


def overlap_spec(name: str) -> str | None:
    """The override spec of an overlap contender name ("overlap" -> "", "overlap[a=1]" ->
    "a=1"); None for any other contender."""
    if name == "overlap":
        return ""
    if name.startswith("overlap[") and name.endswith("]"):
        return name[len("overlap[") : -1]
    return None


def is_known(name: str) -> bool:
    return name in BASELINES or name in PEERS or overlap_spec(name) is not None


# ---------------------------------------------------------------------------------------------
# availability (launcher side)


def missing_package(name: str) -> str | None:
    """The package contender `name` needs and this environment lacks, or None."""
    package = REQUIRES.get(name)
    if package is None or importlib.util.find_spec(package) is not None:
        return None
    return package


def available(names: Sequence[str], say: Callable[[str], None] = print) -> tuple[str, ...]:
    """`names` without the contenders whose package is missing; one line each for those."""
    kept = []
    for name in names:
        package = missing_package(name)
        if package is None:
            kept.append(name)
        else:
            say(
                f"{name}: skipped, the {package!r} package is not installed "
                "(pip install 'overlap[bench]', with DS_BUILD_OPS=0 on CPU)"
            )
    return tuple(kept)


def import_requirements(name: str, device: torch.device) -> None:
    """Import what contender `name` builds with (DeepSpeed joined to the default group), so
    that a memory figure taken next starts from the same loaded process for every contender."""
    if name in DEEPSPEED_PEERS:
        import_deepspeed(device)
    elif name in REQUIRES:
        importlib.import_module(REQUIRES[name])


# ---------------------------------------------------------------------------------------------
# memory accounting


def local_bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Parameters + gradients + optimizer state, per rank (local shards of DTensors)."""
    total = 0
    for p in model.parameters():
        total += local_bytes(p) + local_bytes(p.grad)
    for per_param in opt.state.values():
        total += sum(local_bytes(v) for v in per_param.values() if isinstance(v, torch.Tensor))
    return total


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


# ---------------------------------------------------------------------------------------------
# builders


def plain_trainer(
    name: str,
    model: nn.Module,
    setup: TrainSetup,
    clip: Callable[[float], object] | None = None,
    extra_state_bytes: Callable[[], int] = lambda: 0,
    **kw: Any,
) -> Trainer:
    """`model` under the setup's optimizer with autograd's backward; `clip(max_norm)` clips
    (default: torch's clip_grad_norm_ over `model.parameters()`)."""
    opt = setup.make_optimizer(model.parameters())
    clip = clip or (lambda max_norm: nn.utils.clip_grad_norm_(model.parameters(), max_norm))

    def step() -> None:
        if setup.max_grad_norm is not None:
            clip(setup.max_grad_norm)
        opt.step()

    return Trainer(
        name=name,
        model=model,
        optimizer=opt,
        backward=torch.Tensor.backward,
        step=step,
        zero_grad=lambda: opt.zero_grad(set_to_none=True),
        state_bytes=lambda: state_bytes(model, opt) + extra_state_bytes(),
        **kw,
    )


def build_trainer(name: str, model: nn.Module, setup: TrainSetup) -> Trainer:
    """Contender `name` (module docstring) wrapped around `model`, a fresh copy on
    `setup.device`. Collective: every rank of the default group calls it in the same order."""
    spec = overlap_spec(name)
    if spec is not None:
        return overlap_trainer(name, model, setup, parse_overrides(spec))
    if name == "ddp":
        return plain_trainer(name, ddp(model, setup), setup)
    if name in ("fsdp2", "fsdp2-tuned"):
        root = shard_fsdp2(model, setup, prefetch=name == "fsdp2-tuned")
        return plain_trainer(name, root, setup)
    if name == "fsdp2-bf16reduce":
        root = shard_fsdp2(model, setup, prefetch=True, reduce_dtype=torch.bfloat16)
        return plain_trainer(
            name, root, setup, lossy=True, settings={"reduce_dtype": "bfloat16", "prefetch": True}
        )
    if name in DDP_HOOK_PEERS:
        return ddp_hook_trainer(name, model, setup)
    if name in DEEPSPEED_PEERS:
        return deepspeed_trainer(name, model, setup)
    raise ValueError(f"unknown contender {name!r}: choose from {BASELINES + PEERS} or overlap[...]")


def overlap_trainer(
    name: str, model: nn.Module, setup: TrainSetup, overrides: dict[str, Any]
) -> Trainer:
    import overlap

    wrapped = overlap.wrap(model, **overrides)

    def residual_bytes() -> int:  # error feedback: (world-1)/world of the gradient, in error_feedback_dtype
        return overlap.memory_stats(wrapped).bytes["residuals"]

    return plain_trainer(
        name,
        wrapped,
        setup,
        clip=lambda max_norm: overlap.clip_grad_norm_(wrapped, max_norm),
        extra_state_bytes=residual_bytes,
        lossy=any(overrides.get(k) is not None for k in LOSSY_OVERRIDES),
        settings=overrides,
    )


def ddp(model: nn.Module, setup: TrainSetup) -> nn.parallel.DistributedDataParallel:
    ids = [setup.device.index] if setup.device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=ids)


def shard_fsdp2(
    model: nn.Module,
    setup: TrainSetup,
    prefetch: bool,
    reduce_dtype: torch.dtype | None = None,
) -> nn.Module:
    """`fully_shard` on every unit, then on the root. `prefetch`: FSDP2's implicit prefetch
    needs CUDA streams; on CPU only explicit next/previous-unit prefetch with async unshard
    overlaps its all-gathers (its reduce-scatter stays synchronous)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(setup.device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    units = [fully_shard(u, mesh=mesh, mp_policy=policy) for u in setup.units_of(model)]
    root = fully_shard(model, mesh=mesh, mp_policy=policy)
    assert isinstance(root, FSDPModule), f"rank {dist.get_rank()}: fully_shard returned {root!r}"
    if prefetch:
        for i, unit in enumerate(units):
            if i + 1 < len(units):
                unit.set_modules_to_forward_prefetch([units[i + 1]])
            if i > 0:
                unit.set_modules_to_backward_prefetch([units[i - 1]])
        root._set_unshard_async_op(True)
    return root


def bf16_hook(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """torch's `bf16_compress_hook`, registered under another name.

    [Note: bf16 hook on CPU] DDP.register_comm_hook refuses a hook *named* bf16_compress_hook
    unless torch was built with CUDA and NCCL >= 2.10 (a guard from before gloo reduced bf16);
    torch's gloo backend all-reduces bf16 now, so on CPU we run the same hook through this
    one-line wrapper. (Gloo keeps the running sum in bf16 between hops, as NCCL does.)"""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(process_group, bucket)


# DDP checks a hook's annotations as objects; this module's are strings (future annotations).
bf16_hook.__annotations__ = typing.get_type_hints(bf16_hook)


def serialized_powersgd_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's `powerSGD_hook`, waited for before DDP launches the next bucket
    ([Note: PowerSGD settings]: its chained collectives race across buckets on gloo)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    future = psgd.powerSGD_hook(state, bucket)
    future.wait()
    return future


serialized_powersgd_hook.__annotations__ = typing.get_type_hints(serialized_powersgd_hook)


def ddp_hook_trainer(name: str, model: nn.Module, setup: TrainSetup) -> Trainer:
    """DDP with one of torch's communication hooks ([Note: PowerSGD settings])."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    wrapped = ddp(model, setup)
    state: psgd.PowerSGDState | None = None
    settings: dict[str, Any]
    if name == "ddp-bf16":
        wrapped.register_comm_hook(None, bf16_hook)
        settings = {"hook": "bf16_compress_hook"}
    elif name == "ddp-fp16":
        wrapped.register_comm_hook(None, default_hooks.fp16_compress_hook)
        settings = {"hook": "fp16_compress_hook"}
    else:
        state = psgd.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=POWERSGD_RANKS[name],
            start_powerSGD_iter=setup.powersgd_start_iter,
            use_error_feedback=True,
            warm_start=True,
            random_seed=0,
        )
        wrapped.register_comm_hook(state, serialized_powersgd_hook)
        settings = {
            "hook": "powerSGD_hook (each bucket waited for: [Note: PowerSGD settings])",
            "matrix_approximation_rank": state.matrix_approximation_rank,
            "start_powerSGD_iter": state.start_powerSGD_iter,
            "min_compression_rate": state.min_compression_rate,
            "use_error_feedback": True,
            "warm_start": True,
        }
    return plain_trainer(
        name,
        wrapped,
        setup,
        extra_state_bytes=lambda: 0 if state is None else storage_bytes(powersgd_memory(state)),
        lossy=True,
        settings=settings,
    )


def powersgd_memory(state: Any) -> Iterator[torch.Tensor]:
    """What a PowerSGDState keeps across steps: error feedback and the warm-start P and Q, per
    bucket (allocated at the first compressed step)."""
    for per_bucket in (state.error_dict, state.p_memory_dict, state.q_memory_dict):
        yield from per_bucket.values()


def deepspeed_config(name: str, setup: TrainSetup) -> dict[str, Any]:
    """The DeepSpeed config of contender `name` ([Note: DeepSpeed ZeRO-3 configs])."""
    zero: dict[str, Any] = {"stage": 3}
    if name == "deepspeed-tuned":
        h = setup.hidden_size
        zero |= {
            "overlap_comm": True,
            "reduce_bucket_size": h * h,
            "stage3_prefetch_bucket_size": int(0.9 * h * h),
            "stage3_param_persistence_threshold": 10 * h,
        }
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": setup.micro_batch,
        "zero_optimization": zero,
        "steps_per_print": DEEPSPEED_QUIET_STEPS,
    }
    if setup.max_grad_norm is not None:
        config["gradient_clipping"] = setup.max_grad_norm
    return config


def import_deepspeed(device: torch.device) -> Any:
    """deepspeed, imported for `device` and joined to the default process group."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if device.type == "cuda" else "cpu")
    # A spawned local world has no LOCAL_RANK (torchrun and the link launcher set it); every
    # rank of such a world is on this machine, so its local rank is its rank.
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
    # DeepSpeed calls torch's deprecated collective names (all_gather_into_tensor,
    # reduce_scatter_tensor) on every step, and the FutureWarning would repeat each time.
    warnings.filterwarnings(
        "ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning
    )
    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    backend = dist.get_backend()
    deepspeed.init_distributed(dist_backend=backend)  # reuses the initialized default group
    return deepspeed


def deepspeed_trainer(name: str, model: nn.Module, setup: TrainSetup) -> Trainer:
    """DeepSpeed ZeRO-3 around `model`; its engine runs backward, clipping, step and zeroing."""
    deepspeed = import_deepspeed(setup.device)
    opt = setup.make_optimizer(model.parameters())
    config = deepspeed_config(name, setup)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    zero_opt = engine.optimizer  # DeepSpeedZeroOptimizer_Stage3 around `opt`

    def state() -> int:
        """Partitions (persisted small parameters are whole), the flat fp32 partitions the
        optimizer updates (the same storage as the partitions in fp32), the gradient partitions
        and AdamW's moments."""
        params = list(engine.module.parameters())
        tensors: list[torch.Tensor | None] = [p.ds_tensor for p in params] + [p.data for p in params]
        tensors += zero_opt.fp32_partitioned_groups_flat
        tensors.append(zero_opt.grad_partitions_flat_buffer)
        tensors += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return storage_bytes(tensors)

    return Trainer(
        name=name,
        model=engine,
        optimizer=opt,
        backward=engine.backward,
        step=engine.step,  # clips (config "gradient_clipping"), steps, zeroes the gradients
        zero_grad=lambda: None,
        state_bytes=state,
        settings={"deepspeed": deepspeed.__version__, **config["zero_optimization"]},
    )
