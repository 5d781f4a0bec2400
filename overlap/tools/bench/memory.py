"""`overlap bench memory`: peak memory per rank, each contender in its own fresh process world.

    overlap bench memory                          # 12 x TransformerEncoderLayer(1024): 151 M params
    overlap bench memory --layers 2 --d-model 256 --ff 1024 --heads 4 --nproc 1,2 --json out/mem.json
    overlap bench memory --overlap-config prefetch_depth=2 --contenders overlap,fsdp2
    overlap bench memory --contenders overlap,ddp,deepspeed,deepspeed-tuned,ddp-powersgd4 \
        --overlap-config grad_compression=int8,error_feedback=True

Workload: `--layers` x nn.TransformerEncoderLayer(`--d-model`, `--heads`, `--ff`, dropout=0,
batch_first=True) on a fixed random input (`--batch`, `--seq`, d) per rank, loss mean(out^2),
AdamW, `--steps` steps. Built on the rank's device with the same seed everywhere, then wrapped.

Contenders, each run in a world of its own freshly spawned processes (one per world size), so no
contender's high-water mark includes another's (built by overlap.tools.bench.peers, as in `overlap
bench step`; the first three are the default)
  overlap[...]  overlap.wrap (default config, plus one per --overlap-config)
  fsdp2         fully_shard per layer, then the root; defaults
  ddp           DistributedDataParallel
  peers         deepspeed, deepspeed-tuned, ddp-bf16, ddp-fp16, ddp-powersgd1, ddp-powersgd4,
                fsdp2-bf16reduce (see overlap/tools/bench/peers/); one missing its package is skipped
                with one line saying so

Measured in each rank at the end, then the largest rank (all ranks in the JSON)
  peak RSS      the OS's high-water mark of the rank process's resident memory (VmHWM; not
                ru_maxrss, which in a spawned rank also counts its launcher: see [Note: ru_maxrss
                of a spawned rank] in bench/step/protocol.py): torch import, model build before
                sharding, every step; read before the train-RSS reset and at the end, the larger
                of the two
  base RSS      RSS after the process group is up, before the model is built (the same for all)
  train RSS     the high-water mark from the first step on: VmHWM reset after setup
                (/proc/self/clear_refs), None where the kernel does not allow it
  CUDA          torch.cuda.max_memory_allocated / max_memory_reserved over the process, and the
                allocated peak from the first step on
Beside them, per rank:
  state         parameters + gradients + optimizer state + communication state (error feedback,
                PowerSGD memories) by accounting, while the last step's gradients live (local
                shards of DTensors; DeepSpeed's partitions and fp32 copy; transient buffers
                excluded); PowerSGD allocates its error feedback at step 2, so --steps >= 3
  ideal ZeRO-3  (params + grads + 2 Adam moments) x 4 bytes / world size
  overlap acct  overlap.memory_stats(model).peak_total_bytes, the library's own high-water mark of
                its buffers (per kind in the JSON), where this version of overlap has it
On CPU, overlap.wrap raises glibc's malloc thresholds (OverlapConfig.cpu_keep_freed_memory, its
default), which keeps freed memory resident; FSDP2 and DDP run with glibc's defaults.

JSON (`--json PATH`): `{"config", "model", "params", "runs": [{"name", "world_size", "device",
"peak_rss_bytes", "base_rss_bytes", "train_peak_rss_bytes", "cuda_max_allocated_bytes",
"cuda_max_reserved_bytes", "cuda_train_max_allocated_bytes", "state_bytes",
"ideal_zero3_bytes", "library_peak_bytes", "library_peak", "ranks": [...]}]}`.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from overlap.observe.monitor import rss_bytes
from overlap.tools.bench import peers
from overlap.tools.bench.peers import parse_overrides
from overlap.tools.bench.step import process_peak_rss_bytes
from overlap.tools.flags import JSON_FLAG, OVERLAP_CONFIG_FLAG, WORLD_SIZES_FLAG, command, flag, write_json
from overlap.tools.workloads.step import Workload, build_model
from overlap.tools.worlds.launch import current_device, default_world, run_local_world

DEFAULT_CONTENDERS = ("overlap", "fsdp2", "ddp")
CONTENDERS = DEFAULT_CONTENDERS + peers.PEERS
Device = Literal["auto", "cpu", "cuda"]
BYTES_PER_PARAM_ZERO3 = 16
"""fp32 parameter + gradient + Adam's two moments."""


@dataclass(frozen=True, kw_only=True)
class MemoryBenchConfig:
    """One memory comparison. The defaults (151 M parameters) need ~2.5 GB per DDP rank on CPU."""

    layers: int = 12
    """TransformerEncoderLayers in the model."""
    d_model: int = 1024
    """Model width."""
    heads: int = 16
    ff: int = 4096
    """Feed-forward width."""
    seq: int = 128
    batch: int = 2
    """Sequences per rank."""
    steps: int = 3
    """Training steps; PowerSGD allocates its error feedback at step 2, so >= 3 counts it."""
    lr: float = 1e-4
    seed: int = 0
    contenders: tuple[str, ...] = field(default=DEFAULT_CONTENDERS, metadata=flag(help=f"comma list from {CONTENDERS}"))
    overlap_configs: tuple[str, ...] = field(default=(), metadata=OVERLAP_CONFIG_FLAG)
    """Extra overlap contenders, one per "key=value[,key=value]" of OverlapConfig overrides."""
    nproc: tuple[int, ...] | None = field(default=None, metadata=WORLD_SIZES_FLAG)
    """World sizes; None: every local GPU, else 2 CPU ranks (overlap.launch.default_world)."""
    device: Device = "auto"
    """"cuda": NCCL, one GPU per rank; "cpu": gloo; "auto": cuda when there is a GPU."""
    threads: int | None = None
    """Torch threads per rank (None: the cores split evenly)."""
    timeout_s: float = 300.0
    """Deadline of each world: a rank still running then is named in the error."""
    json_path: str | None = field(default=None, metadata=JSON_FLAG)

    def __post_init__(self) -> None:
        sizes = (self.layers, self.d_model, self.heads, self.ff, self.seq, self.batch, self.steps)
        if min(sizes) < 1:
            raise ValueError("MemoryBenchConfig: sizes and steps must be >= 1")
        if self.d_model % self.heads:
            raise ValueError(f"MemoryBenchConfig: d_model={self.d_model} must be divisible by heads={self.heads}")
        unknown = sorted(set(self.contenders) - set(CONTENDERS))
        if unknown or not self.contenders:
            raise ValueError(f"MemoryBenchConfig.contenders: unknown {unknown}; choose from {CONTENDERS}")
        if self.nproc is not None and (not self.nproc or min(self.nproc) < 1):
            raise ValueError(f"MemoryBenchConfig.nproc: need world sizes >= 1, got {self.nproc}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"MemoryBenchConfig.device: {self.device!r} is not auto, cpu or cuda")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("MemoryBenchConfig.device='cuda' but CUDA is not available")
        for spec in self.overlap_configs:
            parse_overrides(spec)

    def workload(self) -> Workload:
        """The same model as `overlap bench step --model w1` at these sizes."""
        return Workload(layers=self.layers, dim=self.d_model, heads=self.heads, ff=self.ff, seed=self.seed)

    def contender_names(self) -> list[str]:
        names = []
        for name in self.contenders:
            names.append(name)
            if name == "overlap":
                names += [f"overlap[{spec}]" for spec in self.overlap_configs]
        return names


def reset_peak_rss() -> bool:
    """Reset the kernel's high-water mark (VmHWM) to the current RSS; False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def num_params(cfg: MemoryBenchConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in build_model(cfg.workload()).parameters())


def train_setup(cfg: MemoryBenchConfig, device: torch.device) -> peers.TrainSetup:
    return peers.TrainSetup(
        make_optimizer=lambda params: torch.optim.AdamW(params, lr=cfg.lr),
        units_of=lambda model: list(model.children()),  # the layers
        micro_batch=cfg.batch,
        hidden_size=cfg.d_model,
        device=device,
    )


def library_peak(model: nn.Module) -> tuple[int | None, dict[str, int] | None]:
    """overlap's own accounting of its buffers' high-water mark (`overlap.memory_stats`)."""
    import overlap

    stats = overlap.memory_stats(model)
    return int(stats.peak_total_bytes), {k: int(v) for k, v in stats.peak.items()}


def memory_rank(rank: int, world_size: int, cfg: MemoryBenchConfig, name: str) -> dict[str, Any]:
    """Build, wrap and train one contender in this fresh process; its memory figures."""
    device = current_device()
    cuda = device.type == "cuda"
    base_rss = rss_bytes()
    with device:  # built where it trains, as each contender's users would
        model = build_model(cfg.workload())
    trainer = peers.build_trainer(name, model, train_setup(cfg, device))
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(cfg.batch, cfg.seq, cfg.d_model, generator=gen).to(device)
    # Resetting VmHWM loses the setup's high-water mark: keep it, and take the process's peak as
    # the larger of it and the high-water mark at the end.
    setup_peak_rss = process_peak_rss_bytes()
    was_reset = reset_peak_rss()
    if cuda:
        torch.cuda.synchronize(device)
        setup_max_allocated = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    accounted = 0
    for i in range(cfg.steps):
        trainer.backward(trainer.model(x).pow(2).mean())
        trainer.step()
        if i == cfg.steps - 1:  # gradients still alive: the accounting point
            accounted = trainer.state_bytes()
        trainer.zero_grad()
    out: dict[str, Any] = {
        "rank": rank,
        "pid": os.getpid(),
        "peak_rss_bytes": max(setup_peak_rss, process_peak_rss_bytes()),  # VmHWM both
        "base_rss_bytes": base_rss,
        "train_peak_rss_bytes": process_peak_rss_bytes() if was_reset else None,
        "state_bytes": accounted,
        "library_peak_bytes": None,
        "library_peak": None,
    }
    if cuda:
        torch.cuda.synchronize(device)
        train_max = torch.cuda.max_memory_allocated(device)
        out["cuda_train_max_allocated_bytes"] = train_max
        out["cuda_max_allocated_bytes"] = max(setup_max_allocated, train_max)
        out["cuda_max_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    if peers.overlap_spec(name) is not None:
        out["library_peak_bytes"], out["library_peak"] = library_peak(trainer.model)
    return out


@dataclass(frozen=True, kw_only=True)
class MemoryRun:
    """One contender in one world: the largest rank's figures, every rank's in `ranks`."""

    name: str
    world_size: int
    device: str
    peak_rss_bytes: int
    base_rss_bytes: int
    train_peak_rss_bytes: int | None
    state_bytes: int
    ideal_zero3_bytes: int
    library_peak_bytes: int | None
    library_peak: dict[str, int] | None
    cuda_max_allocated_bytes: int | None = None
    cuda_max_reserved_bytes: int | None = None
    cuda_train_max_allocated_bytes: int | None = None
    ranks: list[dict[str, Any]] = field(default_factory=list)


def largest(ranks: list[dict[str, Any]], key: str) -> Any:
    values = [r[key] for r in ranks if r.get(key) is not None]
    return max(values) if values else None


def to_run(name: str, world_size: int, device: str, params: int, ranks: list[dict[str, Any]]) -> MemoryRun:
    lib = max(ranks, key=lambda r: r["library_peak_bytes"] or 0)
    return MemoryRun(
        name=name,
        world_size=world_size,
        device=device,
        peak_rss_bytes=largest(ranks, "peak_rss_bytes"),
        base_rss_bytes=largest(ranks, "base_rss_bytes"),
        train_peak_rss_bytes=largest(ranks, "train_peak_rss_bytes"),
        state_bytes=largest(ranks, "state_bytes"),
        ideal_zero3_bytes=BYTES_PER_PARAM_ZERO3 * params // world_size,
        library_peak_bytes=lib["library_peak_bytes"],
        library_peak=lib["library_peak"],
        cuda_max_allocated_bytes=largest(ranks, "cuda_max_allocated_bytes"),
        cuda_max_reserved_bytes=largest(ranks, "cuda_max_reserved_bytes"),
        cuda_train_max_allocated_bytes=largest(ranks, "cuda_train_max_allocated_bytes"),
        ranks=ranks,
    )


def describe(cfg: MemoryBenchConfig, params: int) -> str:
    return (
        f"{cfg.layers} x TransformerEncoderLayer(d={cfg.d_model}, heads={cfg.heads}, ff={cfg.ff}): "
        f"{params / 1e6:.1f} M params; input ({cfg.batch}, {cfg.seq}, {cfg.d_model}); AdamW, "
        f"{cfg.steps} steps"
    )


def format_table(cfg: MemoryBenchConfig, params: int, runs: list[MemoryRun]) -> str:
    mib = 2**20

    def cell(b: int | None) -> str:
        return "n/a" if b is None else f"{b / mib:.1f}"

    cuda = any(r.cuda_max_allocated_bytes is not None for r in runs)
    cols = ["peak RSS", "base RSS", "train RSS"]
    if cuda:
        cols += ["cuda alloc", "cuda rsvd", "train alloc"]
    cols += ["state", "ideal Z3", "overlap acct"]
    w = max(len("contender"), *(len(r.name) for r in runs))
    header = f"{'contender':<{w}} {'W':>3} " + " ".join(f"{c:>12}" for c in cols)
    lines = [f"\nmemory: {describe(cfg, params)}; MiB per rank (largest rank)", header, "-" * len(header)]
    for r in runs:
        vals = [r.peak_rss_bytes, r.base_rss_bytes, r.train_peak_rss_bytes]
        if cuda:
            vals += [r.cuda_max_allocated_bytes, r.cuda_max_reserved_bytes, r.cuda_train_max_allocated_bytes]
        vals += [r.state_bytes, r.ideal_zero3_bytes, r.library_peak_bytes]
        lines.append(f"{r.name:<{w}} {r.world_size:>3} " + " ".join(f"{cell(v):>12}" for v in vals))
    lines.append(
        "each contender ran in its own fresh processes.  peak RSS: the OS's VmHWM (whole "
        "process: import, build, steps); train RSS: from step 1 on; state: params+grads+optimizer "
        "by accounting; ideal Z3: 16 B x params / W; overlap acct: overlap.memory_stats peak"
    )
    return "\n".join(lines)


def bench_memory(cfg: MemoryBenchConfig) -> dict[str, Any]:
    """Every contender at every world size in a fresh spawned world; prints the table and
    returns (and writes, with `cfg.json_path`) the JSON payload."""
    gpus, _ = default_world()
    cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    backend = "nccl" if cuda else "gloo"
    nproc = cfg.nproc or ((gpus,) if cuda else (2,))
    params = num_params(cfg)
    names = peers.available(cfg.contender_names())
    runs = []
    for n in nproc:
        for name in names:
            ranks = run_local_world(
                memory_rank, n, cfg, name, backend=backend, timeout_s=cfg.timeout_s,
                threads_per_rank=cfg.threads,
            )  # fmt: skip
            runs.append(to_run(name, n, "cuda" if cuda else "cpu", params, ranks))
    print(format_table(cfg, params, runs), flush=True)
    payload = {
        "config": asdict(cfg),
        "model": describe(cfg, params),
        "params": params,
        "runs": [asdict(r) for r in runs],
    }
    if cfg.json_path:
        write_json(cfg.json_path, payload)
    return payload


add_arguments, run = command(MemoryBenchConfig, bench_memory, "overlap bench memory")
