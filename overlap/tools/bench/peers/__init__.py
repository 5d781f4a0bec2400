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

HSDP (`TrainSetup.num_replicas` R > 1): overlap wraps with `group=`, and FSDP2's `fully_shard`
takes `mesh=`, a (R, world / R) DeviceMesh ("replicate", "shard") made by `data_mesh`:
both shard inside a group of world / R ranks and all-reduce the reduced shards across the R
replicas (overlap's hybrid_mode="replicate", FSDP2's HSDP). DDP and its hook peers are the same
whatever the mesh; DeepSpeed stays ZeRO-3 over every rank.

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

Layout: `TrainSetup`, `Trainer`, the state accounting and the plain trainer are in
trainer.py, the DDP-hook peers in ddp_hooks.py, the DeepSpeed peers in
deepspeed.py; this module names the contenders, checks their packages and builds them
(overlap, DDP and FSDP2 here). Every name those modules define is importable from here.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

# DDP with torch's communication hooks: overlap/tools/bench/peers/ddp_hooks.py
from overlap.tools.bench.peers.ddp_hooks import (
    POWERSGD_RANKS,
    bf16_hook,
    ddp_hook_trainer,
    powersgd_memory,
    serialized_powersgd_hook,
)

# DeepSpeed ZeRO-3: overlap/tools/bench/peers/deepspeed.py
from overlap.tools.bench.peers.deepspeed import (
    DEEPSPEED_QUIET_STEPS,
    deepspeed_config,
    deepspeed_trainer,
    import_deepspeed,
)

# Setup, trainer, accounting, plain trainer: overlap/tools/bench/peers/trainer.py
from overlap.tools.bench.peers.trainer import (
    Trainer,
    TrainSetup,
    ddp,
    local_bytes,
    plain_trainer,
    state_bytes,
    storage_bytes,
)

__all__ = [
    "BASELINES",
    "DDP_HOOK_PEERS",
    "DEEPSPEED_PEERS",
    "DEEPSPEED_QUIET_STEPS",
    "LOSSY_OVERRIDES",
    "PEERS",
    "POWERSGD_RANKS",
    "REQUIRES",
    "TrainSetup",
    "Trainer",
    "available",
    "bf16_hook",
    "build_trainer",
    "data_mesh",
    "ddp",
    "ddp_hook_trainer",
    "deepspeed_config",
    "deepspeed_trainer",
    "import_deepspeed",
    "import_requirements",
    "is_known",
    "local_bytes",
    "missing_package",
    "overlap_spec",
    "overlap_trainer",
    "parse_overrides",
    "plain_trainer",
    "powersgd_memory",
    "serialized_powersgd_hook",
    "shard_fsdp2",
    "state_bytes",
    "storage_bytes",
]

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


LOSSY_OVERRIDES = ("param_dtype", "reduce_dtype", "param_compression", "grad_compression")
"""overlap overrides that change the numbers on the wire (the loss then drifts from DDP's)."""


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
# builders


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
        return plain_trainer(name, root, setup, lossy=True, settings={"reduce_dtype": "bfloat16", "prefetch": True})
    if name in DDP_HOOK_PEERS:
        return ddp_hook_trainer(name, model, setup)
    if name in DEEPSPEED_PEERS:
        return deepspeed_trainer(name, model, setup)
    raise ValueError(f"unknown contender {name!r}: choose from {BASELINES + PEERS} or overlap[...]")


def data_mesh(setup: TrainSetup) -> DeviceMesh:
    """The mesh overlap and FSDP2 shard over: 1-D over every rank, or for HSDP (R =
    `setup.num_replicas` > 1) the 2-D (R, world / R) mesh ("replicate", "shard"), each shard
    group world / R consecutive ranks. Collective: every rank of the default group calls it."""
    world, num_replicas = dist.get_world_size(), setup.num_replicas
    if num_replicas == 1:
        return init_device_mesh(setup.device.type, (world,))
    if world % num_replicas:
        raise ValueError(
            f"HSDP: {world} ranks do not split into {num_replicas} replicate groups; pick a number "
            f"of replicas that divides the world size"
        )
    shape = (num_replicas, world // num_replicas)
    return init_device_mesh(setup.device.type, shape, mesh_dim_names=("replicate", "shard"))


def overlap_trainer(name: str, model: nn.Module, setup: TrainSetup, overrides: dict[str, Any]) -> Trainer:
    import overlap

    group = data_mesh(setup) if setup.num_replicas > 1 else None  # None: the default group, as before
    wrapped = overlap.wrap(model, group=group, **overrides)

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


def shard_fsdp2(
    model: nn.Module, setup: TrainSetup, prefetch: bool, reduce_dtype: torch.dtype | None = None
) -> nn.Module:
    """`fully_shard` on every unit, then on the root, over `data_mesh(setup)` (HSDP on a 2-D
    mesh). `prefetch`: FSDP2's implicit prefetch needs CUDA streams; on CPU only explicit
    next/previous-unit prefetch with async unshard overlaps its all-gathers (its reduce-scatter
    stays synchronous)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mesh = data_mesh(setup)  # 2-D under HSDP: FSDP2's hybrid sharding
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
