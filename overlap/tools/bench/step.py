"""`overlap bench step`: one training step side by side: overlap vs FSDP2 vs DDP vs two floors,
and the peers a user would pick instead (DeepSpeed ZeRO-3, DDP compression hooks, PowerSGD).

    overlap bench step                                     # W1, 2 gloo ranks, the base contenders
    overlap bench step --model gpt --layers 4 --dim 256 --heads 4 --nproc 1,2,4
    overlap bench step --overlap-config prefetch_depth=2 --json out/w1.json
    overlap bench step --link 1gbit                        # ranks behind an emulated 1 Gbit/s link
    overlap bench step --contenders overlap,ddp,deepspeed,deepspeed-tuned,ddp-bf16 \
        --overlap-config grad_compression=int8,error_feedback=True   # peers beside our codecs

Models (`--model`): `w1`, the core issue's workload, a stack of `--layers`
nn.TransformerEncoderLayer(d=`--dim`, ff=`--ff`) trained on a fixed random input with loss
mean(out^2); `gpt`, the package's byte-level GPT (overlap.tools.models.gpt) on a fixed batch of the
stdlib's bytes (overlap.data) with its own cross-entropy. The unit of sharding is a layer (W1) or
a Block (gpt); the GPT's embeddings, final norm and head are the root's.

Each world size of `--nproc` (a comma list, e.g. 1,2,4) is its own spawned gloo world of that many
ranks x `--threads` threads; every contender is a fresh, identically initialized model in the same
processes. Rounds interleave the contenders (order rotated each round); a round gives each
contender 2 warm-up steps and `--steps` timed steps, each timed after a barrier and taken as the
slowest rank. Reported: the median over rounds of each round's median step, and the min-max of
those round medians. With more than one world size a scaling table follows: tokens/s per world
size (the global batch grows with the ranks: `--batch` is per rank) and the speedup over the
smallest world size given; ideal is the ratio of the world sizes.

Contenders (the first six are the default; overlap.tools.bench.peers builds all but the floors)
  overlap[...]         overlap.wrap (default config, plus one per --overlap-config)
  fsdp2                fully_shard per unit, then the root; defaults
  fsdp2-tuned          + explicit next/previous-unit prefetch and _set_unshard_async_op(True)
  ddp                  DistributedDataParallel
  floor-compute        the plain local step: no communication
  floor-compute||comm  the plain local step with ZeRO-3's collectives running beside it
  deepspeed            DeepSpeed ZeRO-3 with its defaults, fp32, our AdamW passed in
  deepspeed-tuned      ZeRO-3 with bucket sizes for the model width (peers.py's Note on configs)
  ddp-bf16, ddp-fp16   DDP + torch's bf16_compress_hook / fp16_compress_hook
  ddp-powersgd1, -4    DDP + powerSGD_hook, rank 1 / 4, error feedback, warm start, from step 2
  fsdp2-bf16reduce     fsdp2-tuned with MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
A peer whose package (deepspeed, numpy) is missing is skipped with one line saying so. Each
contender steps through its own API (DeepSpeed: engine.backward(loss), engine.step()).

[Note: what floor-compute||comm issues, and when]
Per unit, in the sizes ZeRO-3 would use (the unit's numel padded to a multiple of the world size,
fp32): an all-gather from its forward pre-hook, an all-gather when the gradient of its output
arrives (a tensor hook, i.e. the start of its backward) and a reduce-scatter once all its
parameters have accumulated gradients. The root's own parameters (gpt: embeddings, final norm,
head) are gathered once before the forward and reduce-scattered once, as FSDP2 keeps the root
unsharded between forward and backward. All are async_op=True on preallocated buffers that
nothing reads, so no compute ever waits on them; the step waits for all of them at its end.
Launching them at the hooks spreads the traffic over the step like a real ZeRO-3 schedule would,
instead of front-loading it all at step start. On 2 cores the gloo worker threads take CPU from
compute, so this is "the best this machine can overlap", not compute time alone.

Parity guard: after the up-front warm-up, every data-parallel contender's loss at step 1 (after
one AdamW update) must match DDP's on each rank within 1e-5 relative, else a WARNING line (the
floors train on local gradients and are not checked). A lossy contender (compression, a bf16 or
fp16 reduce) gets a "parity (lossy)" line with its difference instead of a warning.
Exposed communication: overlap reports its own (StepStats.exposed_comm_ms, median over steps);
for the others it is estimated as step - floor-compute (marked "~").
Memory: state = per-rank bytes of parameters + gradients + optimizer state + communication
state (error-feedback residuals, PowerSGD memories) by accounting (local shards of DTensors;
DeepSpeed: its partitions, fp32 copy, gradient partitions and AdamW moments; DDP's buckets,
DeepSpeed's reduce bucket and overlap's/FSDP2's transient unsharded buffers excluded).
peak RSS is per contender: after the timed rounds, each contender runs again in a world of its
own freshly spawned processes (same world size and threads, no --link), 2 warm-up steps plus 1,
and each rank reads the OS's high-water mark of its resident memory (VmHWM; see [Note: ru_maxrss
of a spawned rank]) at the end; reported is the largest rank. It covers the whole process (torch import, model build, steps), the same baseline
for every contender. "train" is that peak less the RSS the rank had just before the contender
was built (torch, the process group and the contender's package loaded): what training adds,
the CPU's counterpart of CUDA's max_memory_allocated, without the ~600 MB of interpreter and
libraries that make peak RSS of a small model mostly baseline. `--memory-repeats N` runs N
worlds per contender, in turn, and reports the medians. In the timing processes all contenders
live side by side, so no honest per-contender peak exists there. `--no-memory` skips this pass
(peak: n/a). For more (CUDA peaks, base and train RSS, the library's own accounting) see
`overlap bench memory`.

JSON (`--json PATH`): `{"world_size", "link", "model", "config", "runs": [{"name",
"median_step_ms", "spread_ms", "tokens_per_s", "exposed_comm_ms", "peak_mem_bytes",
"train_mem_bytes", "train_mem_range_bytes", "state_bytes", "lossy", "settings", ...}]}`, one
file per world size: PATH itself for a single world size, else PATH with `.n<world size>` before
its suffix (out/w1.json -> out/w1.n1.json, out/w1.n2.json, ...).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, get_args

import torch
import torch.distributed as dist
from torch import nn

from overlap.tools.bench import peers
from overlap.tools.bench.comm import all_gather_single, reduce_scatter_single
from overlap.tools.bench.link import LinkSpec, active_link, run_linked_world
from overlap.tools.bench.peers import parse_overrides, state_bytes
from overlap.tools.launch import run_local_world
from overlap.tools.models.gpt import GPT, GPTConfig
from overlap.observe.monitor import rss_bytes

ModelName = Literal["w1", "gpt"]
MODELS: tuple[ModelName, ...] = get_args(ModelName)
DEFAULT_CONTENDERS = ("overlap", "fsdp2", "fsdp2-tuned", "ddp", "floor-compute", "floor-compute||comm")
ALL_CONTENDERS = DEFAULT_CONTENDERS + peers.PEERS
WARMUP_STEPS = 2
"""Untimed steps per contender per round (and once up front, where step 1 is the parity check)."""
PARITY_RTOL = 1e-5
RATIO_BASES = ("fsdp2", "fsdp2-tuned", "floor-compute||comm", "ddp", *peers.PEERS)
"""Each overlap row's step time is printed as a ratio to these, where they ran."""
GPT_CORPUS_BYTES = 2**20
"""The gpt batch is cut from this much stdlib text: plenty for a fixed batch, read in a blink."""

Batch = tuple[torch.Tensor, ...]


@dataclass(frozen=True, kw_only=True)
class StepBenchConfig:
    """One side-by-side comparison. Defaults are W1 on 2 ranks: a few minutes on 2 CPU cores."""

    model: ModelName = "w1"
    contenders: tuple[str, ...] = DEFAULT_CONTENDERS
    overlap_configs: tuple[str, ...] = ()
    """Extra overlap contenders, one per "key=value[,key=value]" of OverlapConfig overrides."""
    rounds: int = 3
    steps: int = 6
    """Timed steps per contender per round."""
    layers: int = 8
    dim: int = 512
    heads: int = 8
    ff: int = 2048
    """W1's feed-forward width (gpt: always 4 x dim)."""
    batch: int = 4
    """Sequences per rank per step."""
    seq: int = 128
    lr: float = 1e-4
    seed: int = 0
    nproc: tuple[int, ...] = (2,)
    """World sizes, one spawned world each, run in this order."""
    threads: int = 1
    """Torch threads per rank."""
    keep_freed_memory: bool = True
    """Apply overlap's CPU allocator setting to every contender (see [Note: one allocator ...])."""
    memory: bool = True
    """Measure each contender's peak RSS in a fresh world of its own (see the module docstring)."""
    memory_repeats: int = 1
    """Fresh worlds per contender in the memory pass (taken in turn); the medians are reported."""
    timeout_s: float = 300.0
    """Process-group timeout: a hung collective fails after this long."""
    link: str | None = None
    """Emulated link for every world, e.g. "1gbit" or "1gbit,200us" (overlap.tools.bench.link)."""
    json_path: str | None = None

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"StepBenchConfig.model: {self.model!r} is not one of {MODELS}")
        unknown = sorted(set(self.contenders) - set(ALL_CONTENDERS))
        if unknown or not self.contenders:
            raise ValueError(
                f"StepBenchConfig.contenders: unknown {unknown}; choose from {ALL_CONTENDERS}"
            )
        if min(self.rounds, self.steps, self.memory_repeats) < 1:
            raise ValueError("StepBenchConfig: rounds, steps and memory_repeats must be >= 1")
        if min(self.layers, self.dim, self.heads, self.ff, self.batch, self.seq, self.threads) < 1:
            raise ValueError("StepBenchConfig: model sizes, batch, seq and threads must be >= 1")
        if self.dim % self.heads:
            raise ValueError(
                f"StepBenchConfig: dim={self.dim} must be divisible by heads={self.heads}"
            )
        if not self.nproc or min(self.nproc) < 1 or len(set(self.nproc)) != len(self.nproc):
            raise ValueError(
                f"StepBenchConfig.nproc: need distinct world sizes >= 1, got {self.nproc}"
            )
        for spec in self.overlap_configs:
            parse_overrides(spec)
        if self.link is not None:
            LinkSpec.parse(self.link)  # fail here, not in the ranks


# ---------------------------------------------------------------------------------------------
# workloads: model, units, batch, loss


def build_model(cfg: StepBenchConfig) -> nn.Module:
    torch.manual_seed(cfg.seed)  # same init on every rank and for every contender
    if cfg.model == "gpt":
        gpt_cfg = GPTConfig(
            n_layer=cfg.layers, n_head=cfg.heads, n_embd=cfg.dim, block_size=cfg.seq
        )
        return GPT(gpt_cfg)
    return nn.Sequential(
        *[
            nn.TransformerEncoderLayer(
                d_model=cfg.dim,
                nhead=cfg.heads,
                dim_feedforward=cfg.ff,
                batch_first=True,
                dropout=0.0,
            )
            for _ in range(cfg.layers)
        ]
    )


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules sharded one by one (FSDP2's fully_shard, the floor's collectives): the GPT's
    Blocks, W1's layers."""
    return list(model.blocks) if isinstance(model, GPT) else list(model.children())


def root_params(model: nn.Module, units: list[nn.Module]) -> list[nn.Parameter]:
    in_units = {id(p) for unit in units for p in unit.parameters()}
    return [p for p in model.parameters() if id(p) not in in_units]


def make_batch(cfg: StepBenchConfig, rank: int) -> Batch:
    """A fixed batch, different per rank: every step of every contender trains on it."""
    if cfg.model == "gpt":
        from overlap.tools.data import get_batch, load_stdlib_bytes, rank_generator

        data = load_stdlib_bytes(GPT_CORPUS_BYTES)
        return get_batch(data, cfg.batch, cfg.seq, rank_generator(cfg.seed, rank))
    gen = torch.Generator().manual_seed(1000 + rank)
    return (torch.randn(cfg.batch, cfg.seq, cfg.dim, generator=gen),)


def compute_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """gpt: its cross-entropy on (inputs, targets); W1: mean(out^2) of its one input."""
    if len(batch) == 2:
        return model(*batch)[1]
    return model(batch[0]).pow(2).mean()


def describe(cfg: StepBenchConfig) -> str:
    if cfg.model == "gpt":
        return f"GPT step: {cfg.layers} x Block(d={cfg.dim}, heads={cfg.heads}) on stdlib bytes"
    return f"W1 step: {cfg.layers} x TransformerEncoderLayer(d={cfg.dim}, ff={cfg.ff})"


# ---------------------------------------------------------------------------------------------
# contenders


@dataclass
class Contender:
    name: str
    model: nn.Module
    opt: torch.optim.Optimizer
    step: Callable[..., torch.Tensor]
    """One training step, `step(on_stepped=None)`; returns the (detached) loss."""
    exposed_comm_ms: Callable[[], float] | None = None
    """The contender's own measure of the last step's exposed communication, if it has one."""
    overlap_efficiency: Callable[[], float] | None = None
    """Hidden comm / total comm of one extra, untimed, traced step (after a round's timed
    steps), from the engine's own trace."""
    trains_like_ddp: bool = True
    lossy: bool = False
    """Its communication changes the numbers: the parity check reports, it does not warn."""
    state_fn: Callable[[], int] | None = None
    """Its own state accounting (peers.Trainer.state_bytes); None: `state_bytes(model, opt)`."""
    settings: dict[str, Any] | None = None
    """What it was configured with (peers.Trainer.settings), for the JSON."""
    step_ms: list[list[float]] = field(default_factory=list)  # per round, per timed step
    exposed_ms: list[float] = field(default_factory=list)
    efficiency: list[float] = field(default_factory=list)  # one per round, mean over ranks
    state_bytes: int = 0
    parity_rel: float | None = None
    keep_alive: tuple[Any, ...] = ()
    """What lives exactly as long as the contender (its trace's temporary directory)."""


def train_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batch: Batch,
    on_stepped: Callable[[], None] | None = None,
) -> torch.Tensor:
    loss = compute_loss(model, batch)
    loss.backward()
    opt.step()
    if on_stepped is not None:  # gradients still alive here: the accounting hook
        on_stepped()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def standard(name: str, model: nn.Module, batch: Batch, lr: float, **kw: Any) -> Contender:
    """A contender whose step is the plain `train_step` of `model` under AdamW."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)

    def step(on_stepped: Callable[[], None] | None = None) -> torch.Tensor:
        return train_step(model, opt, batch, on_stepped)

    return Contender(name, model, opt, step, **kw)


def train_setup(cfg: StepBenchConfig) -> peers.TrainSetup:
    """What every contender trains with: AdamW(lr), the model's units and width, no clipping."""
    return peers.TrainSetup(
        make_optimizer=lambda params: torch.optim.AdamW(params, lr=cfg.lr),
        units_of=shard_units,
        micro_batch=cfg.batch,
        hidden_size=cfg.dim,
    )


def trainer_step(
    t: peers.Trainer, batch: Batch, on_stepped: Callable[[], None] | None = None
) -> torch.Tensor:
    """`train_step` through a trainer's own API (a DeepSpeed engine steps and zeroes itself)."""
    loss = compute_loss(t.model, batch)
    t.backward(loss)
    t.step()
    if on_stepped is not None:  # gradients still alive here: the accounting hook
        on_stepped()
    t.zero_grad()
    return loss.detach()


def from_trainer(t: peers.Trainer, batch: Batch, **kw: Any) -> Contender:
    def step(on_stepped: Callable[[], None] | None = None) -> torch.Tensor:
        return trainer_step(t, batch, on_stepped)

    return Contender(
        t.name, t.model, t.optimizer, step, lossy=t.lossy, state_fn=t.state_bytes,
        settings=t.settings, **kw,
    )  # fmt: skip


def make_overlap(cfg: StepBenchConfig, batch: Batch, name: str, overrides: dict) -> Contender:
    import overlap

    overrides = {"cpu_keep_freed_memory": cfg.keep_freed_memory, **overrides}
    trainer = peers.overlap_trainer(name, build_model(cfg), train_setup(cfg), overrides)
    model = trainer.model

    def exposed_comm_ms() -> float:
        stats = overlap.step_stats(model)  # None only before the first step
        return float("nan") if stats is None else stats.exposed_comm_ms

    # Overlap efficiency comes from the engine's trace (comm busy = union of the collectives'
    # issue->done spans, exposed = union of the waits; overlap.report), recorded in one extra
    # step after each round's timed steps: recording and rewriting the trace file cost 1-3% of
    # a step, which the timed steps must not carry (no other contender records anything).
    from overlap.observe.report import load_events, training_steps
    from overlap.observe.report import summarize as summarize_trace
    from overlap.observe.trace import TraceRecorder

    state = model._overlap_state
    # removed when the contender is collected or the process exits (TemporaryDirectory's finalizer)
    trace_dir = tempfile.TemporaryDirectory(prefix="overlap-bench-trace-")
    recorder = TraceRecorder(Path(trace_dir.name), dist.get_rank(), max_steps=2)
    contender = from_trainer(trainer, batch, exposed_comm_ms=exposed_comm_ms)

    def overlap_efficiency() -> float:
        """NaN when there is nothing to measure: world size 1 moves no bytes, or the trace has
        no complete training step."""
        if dist.get_world_size() == 1:
            return float("nan")
        state.trace = state.runtime.trace = recorder
        try:
            contender.step()  # untimed, traced
        finally:
            state.trace = state.runtime.trace = None
        try:
            events = load_events([recorder.path])
            steps = training_steps(events)
            summaries = summarize_trace(events, steps[-1]) if steps else []  # the step just traced
        except (FileNotFoundError, ValueError):
            return float("nan")
        return summaries[0].efficiency if summaries else float("nan")

    contender.overlap_efficiency = overlap_efficiency
    contender.keep_alive = (trace_dir,)
    return contender


def attach_zero3_comm(
    module: nn.Module,
    params: list[nn.Parameter],
    works: list[dist.Work],
    gather_in_backward: bool,
) -> None:
    """Hooks that issue the ZeRO-3 collectives of `params` (owned by `module`); see
    [Note: what floor-compute||comm issues, and when]."""
    world = dist.get_world_size()
    padded_numel = -(-sum(p.numel() for p in params) // world) * world
    shard = torch.zeros(padded_numel // world)
    gathered_fwd, gathered_bwd = torch.zeros(padded_numel), torch.zeros(padded_numel)
    grad_flat, grad_shard = torch.zeros(padded_numel), torch.zeros(padded_numel // world)
    num_grads_ready = 0

    def gather_fwd(_module: nn.Module, _inputs: Any) -> None:
        works.append(all_gather_single(gathered_fwd, shard, async_op=True))

    def gather_bwd(_grad: torch.Tensor) -> None:
        works.append(all_gather_single(gathered_bwd, shard, async_op=True))

    def arm_gather_bwd(_module: nn.Module, _inputs: Any, output: torch.Tensor) -> None:
        output.register_hook(gather_bwd)

    def reduce_when_ready(_param: torch.Tensor) -> None:
        nonlocal num_grads_ready
        num_grads_ready += 1
        if num_grads_ready == len(params):
            num_grads_ready = 0
            works.append(reduce_scatter_single(grad_shard, grad_flat, async_op=True))

    module.register_forward_pre_hook(gather_fwd)
    if gather_in_backward:
        module.register_forward_hook(arm_gather_bwd)
    for p in params:
        p.register_post_accumulate_grad_hook(reduce_when_ready)


def make_floor_with_comm(cfg: StepBenchConfig, batch: Batch) -> Contender:
    """The local step with ZeRO-3's collectives beside it, waited for at the end of the step."""
    model = build_model(cfg)
    works: list[dist.Work] = []
    units = shard_units(model)
    for unit in units:
        attach_zero3_comm(unit, list(unit.parameters()), works, gather_in_backward=True)
    own = root_params(model, units)
    if own:
        attach_zero3_comm(model, own, works, gather_in_backward=False)
    c = standard("floor-compute||comm", model, batch, cfg.lr, trains_like_ddp=False)
    local_step = c.step

    def step(on_stepped: Callable[[], None] | None = None) -> torch.Tensor:
        loss = local_step(on_stepped)
        for work in works:
            work.wait()
        works.clear()
        return loss

    c.step = step
    return c


def contender_names(cfg: StepBenchConfig) -> list[str]:
    """The contenders `cfg` asks for, in the report's order (ALL_CONTENDERS', each overlap
    config right after the default overlap)."""
    names = []
    for name in ALL_CONTENDERS:
        if name in cfg.contenders:
            names.append(name)
            if name == "overlap":
                names += [f"overlap[{spec}]" for spec in cfg.overlap_configs]
    return names


def build_contender(cfg: StepBenchConfig, batch: Batch, name: str) -> Contender:
    spec = peers.overlap_spec(name)
    if spec is not None:
        return make_overlap(cfg, batch, name, parse_overrides(spec))
    if name == "floor-compute":
        return standard(name, build_model(cfg), batch, cfg.lr, trains_like_ddp=False)
    if name == "floor-compute||comm":
        return make_floor_with_comm(cfg, batch)
    return from_trainer(peers.build_trainer(name, build_model(cfg), train_setup(cfg)), batch)


def build_contenders(cfg: StepBenchConfig, batch: Batch) -> list[Contender]:
    return [build_contender(cfg, batch, name) for name in contender_names(cfg)]


# ---------------------------------------------------------------------------------------------
# memory accounting


def process_peak_rss_bytes() -> int:
    """The OS's high-water mark of this process's resident memory (VmHWM).

    [Note: ru_maxrss of a spawned rank] getrusage(RUSAGE_SELF).ru_maxrss also counts the image
    the process had before exec: a spawned child is forked from its launcher first, so it reports
    at least the launcher's RSS (measured: 834 MB in a child whose own peak was 15 MB). VmHWM is
    the high-water mark of the current image only. ru_maxrss is the fallback without /proc."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


# ---------------------------------------------------------------------------------------------
# protocol (every rank)


def check_parity(contenders: list[Contender], losses: dict[str, list[float]]) -> None:
    """Loss at step 1 (after one optimizer step) vs DDP, on every rank; rank 0 warns."""
    ref = losses.get("ddp")
    for c in contenders:
        if c.name == "ddp" or not c.trains_like_ddp:
            continue
        rel = (
            float("nan")
            if ref is None
            else abs(losses[c.name][1] - ref[1]) / max(abs(ref[1]), 1e-30)
        )
        rel_t = torch.tensor([rel], dtype=torch.float64)  # parity report, once per contender (CPU)
        dist.all_reduce(rel_t, op=dist.ReduceOp.MAX)
        c.parity_rel = None if ref is None else rel_t.item()
        if dist.get_rank() != 0:
            continue
        if ref is None:
            print(f"note: ddp not selected, no parity check for {c.name}")
        elif c.lossy:
            print(f"parity (lossy): {c.name} loss at step 1 differs from ddp by {rel_t.item():.1e}")
        elif not rel_t.item() <= PARITY_RTOL:
            print(
                f"WARNING: {c.name} loss at step 1 differs from ddp by {rel_t.item():.2e} "
                f"relative (> {PARITY_RTOL:g})"
            )
        else:
            print(f"parity ok: {c.name} loss at step 1 within {rel_t.item():.1e} of ddp")


def warm_up_and_account(contenders: list[Contender]) -> None:
    """Steps 0 to 2 of every contender: the parity check on step 1's loss, state bytes taken
    while step 2's gradients live (PowerSGD allocates its error feedback at its first
    compressed step, 2)."""
    losses: dict[str, list[float]] = {}
    for c in contenders:
        # warm-up, once per contender, outside the timed steps: the loss read syncs on purpose
        losses[c.name] = [c.step().item(), c.step().item()]

        def account(c: Contender = c) -> None:
            c.state_bytes = c.state_fn() if c.state_fn else state_bytes(c.model, c.opt)

        c.step(account)
    state = torch.tensor([c.state_bytes for c in contenders], dtype=torch.int64)
    dist.all_reduce(state, op=dist.ReduceOp.MAX)
    for c, b in zip(contenders, state.tolist(), strict=True):
        c.state_bytes = b
    check_parity(contenders, losses)


def run_segment(c: Contender, num_steps: int) -> None:
    """One contender's turn in a round: warm-up, then timed steps."""
    for _ in range(WARMUP_STEPS):
        c.step()
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
    if c.overlap_efficiency is not None:
        eff = torch.tensor([c.overlap_efficiency()], dtype=torch.float64)
        dist.all_reduce(eff)  # NaN on any rank stays NaN: then nothing is recorded
        if not torch.isnan(eff).item():
            c.efficiency.append(float(eff) / dist.get_world_size())


def set_up_rank(cfg: StepBenchConfig) -> None:
    torch.set_num_threads(cfg.threads)
    # [Note: one allocator setting for all] overlap.wrap on CPU raises glibc's mmap/trim
    # thresholds (OverlapConfig.cpu_keep_freed_memory), which is process-wide; every contender
    # lives in this process, so apply it up front to all of them (order-independent and fair),
    # or to none with --no-keep-freed-memory.
    if cfg.keep_freed_memory:
        from overlap.transport.host import keep_freed_cpu_memory

        keep_freed_cpu_memory()


def step_rank(rank: int, world_size: int, cfg: StepBenchConfig) -> StepReport | None:
    """The comparison on one rank (all ranks call it); rank 0 returns the report."""
    from tqdm import tqdm

    set_up_rank(cfg)
    contenders = build_contenders(cfg, make_batch(cfg, rank))
    warm_up_and_account(contenders)
    bar = tqdm(
        total=cfg.rounds * len(contenders),
        desc=f"bench step {cfg.model} n={world_size}",
        unit="segment",
        disable=rank != 0,
        leave=False,
    )
    for r in range(cfg.rounds):
        k = r % len(contenders)
        for c in contenders[k:] + contenders[:k]:
            bar.set_postfix_str(f"round {r} {c.name}")
            run_segment(c, cfg.steps)
            bar.update()
    bar.close()
    if rank != 0:
        return None
    return summarize(cfg, world_size, contenders)


def peak_rank(rank: int, world_size: int, cfg: StepBenchConfig, name: str) -> tuple[int, int]:
    """Contender `name` alone in this fresh process: warm-up steps plus one. Returns the largest
    rank's lifetime peak RSS and the largest rank's peak above the RSS it had just before the
    contender was built (its packages already imported): what training adds."""
    set_up_rank(cfg)
    peers.import_requirements(name, train_setup(cfg).device)
    base = rss_bytes()
    c = build_contender(cfg, make_batch(cfg, rank), name)
    for _ in range(WARMUP_STEPS + 1):
        c.step()
    peak = process_peak_rss_bytes()
    both = torch.tensor([peak, peak - base], dtype=torch.int64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return int(both[0]), int(both[1])


@dataclass(frozen=True, kw_only=True)
class Peaks:
    """One contender's memory pass: medians over its worlds, and the range of the train figure."""

    peak_bytes: int
    train_bytes: int
    train_range_bytes: tuple[int, int]


def measure_peaks(cfg: StepBenchConfig, world_size: int) -> dict[str, Peaks]:
    """Each contender's peak RSS and peak above its pre-build RSS, each from worlds of
    `world_size` fresh processes of its own: `cfg.memory_repeats` worlds per contender, taken
    in turn."""
    names = contender_names(cfg)
    seen: dict[str, list[tuple[int, int]]] = {name: [] for name in names}
    for _ in range(cfg.memory_repeats):
        for name in names:
            seen[name].append(
                run_local_world(
                    peak_rank, world_size, cfg, name, timeout_s=cfg.timeout_s,
                    threads_per_rank=cfg.threads,
                )[0]
            )  # fmt: skip
    out = {}
    for name, runs in seen.items():
        train = [t for _, t in runs]
        out[name] = Peaks(
            peak_bytes=int(statistics.median(p for p, _ in runs)),
            train_bytes=int(statistics.median(train)),
            train_range_bytes=(min(train), max(train)),
        )
    return out


# ---------------------------------------------------------------------------------------------
# report


@dataclass(frozen=True, kw_only=True)
class StepRun:
    """One contender's numbers in one world (times: slowest rank; memory: largest rank)."""

    name: str
    median_step_ms: float
    spread_ms: tuple[float, float]
    """Min and max of the per-round medians."""
    tokens_per_s: float
    """Global: batch x seq x world size per median step."""
    exposed_comm_ms: float | None
    exposed_comm_estimated: bool
    """True: step - floor-compute, not the contender's own measure."""
    peak_mem_bytes: int | None
    """Peak RSS (VmHWM) of a fresh world that ran only this contender, largest rank; None
    when not measured (--no-memory). See "Memory" in the module docstring."""
    train_mem_bytes: int | None = None
    """The same peak less the RSS the rank had just before the contender was built (torch, the
    process group and the contender's package already loaded): the memory training adds (model,
    state, buffers, activations, the allocator's slack), largest rank; None when not measured."""
    train_mem_range_bytes: tuple[int, int] | None = None
    """Smallest and largest train figure over the memory pass's worlds (--memory-repeats)."""
    state_bytes: int
    """Parameters + gradients + optimizer state, per rank, by accounting."""
    parity_rel: float | None
    """Relative difference of the step-1 loss from DDP's; None when not checked."""
    overlap_efficiency: float | None = None
    """Hidden comm / total comm (median over rounds, from overlap's trace); None for others."""
    lossy: bool = False
    """Compressed or low-precision communication: its loss is not DDP's by design."""
    settings: dict[str, Any] | None = None
    """The contender's configuration beyond its defaults (overlap overrides, DeepSpeed's ZeRO
    section, the hook and its state); None for the floors."""


@dataclass(frozen=True, kw_only=True)
class StepReport:
    world_size: int
    link: str
    config: StepBenchConfig
    runs: list[StepRun]

    def run(self, name: str) -> StepRun | None:
        return next((r for r in self.runs if r.name == name), None)

    def to_json(self) -> dict[str, object]:
        return {
            "world_size": self.world_size,
            "link": self.link,
            "model": describe(self.config),
            "config": asdict(self.config),
            "runs": [asdict(r) for r in self.runs],
        }


def summarize(cfg: StepBenchConfig, world_size: int, contenders: list[Contender]) -> StepReport:
    tokens = cfg.batch * cfg.seq * world_size
    spreads = {c.name: [statistics.median(r) for r in c.step_ms] for c in contenders}
    floor_ms = statistics.median(spreads["floor-compute"]) if "floor-compute" in spreads else None
    runs = []
    for c in contenders:
        med = statistics.median(spreads[c.name])
        exposed: float | None
        estimated = False
        if c.exposed_ms:
            exposed = statistics.median(c.exposed_ms)
        elif c.name == "floor-compute":
            exposed = 0.0
        elif floor_ms is not None:
            exposed, estimated = med - floor_ms, True
        else:
            exposed = None
        runs.append(
            StepRun(
                name=c.name,
                median_step_ms=med,
                spread_ms=(min(spreads[c.name]), max(spreads[c.name])),
                tokens_per_s=tokens / (med / 1e3),
                exposed_comm_ms=exposed,
                exposed_comm_estimated=estimated,
                peak_mem_bytes=None,  # measured in fresh processes afterwards (bench_step)
                state_bytes=c.state_bytes,
                parity_rel=c.parity_rel,
                overlap_efficiency=statistics.median(c.efficiency) if c.efficiency else None,
                lossy=c.lossy,
                settings=c.settings,
            )
        )
    return StepReport(
        world_size=world_size, link=active_link() or "loopback", config=cfg, runs=runs
    )


def format_report(report: StepReport) -> str:
    cfg, rows, mib = report.config, report.runs, 2**20
    title = (
        f"\n{describe(cfg)}, B={cfg.batch} T={cfg.seq}, world={report.world_size} x "
        f"{cfg.threads} thread(s), gloo {report.link}; {cfg.rounds} rounds x {cfg.steps} steps"
    )
    lines = [title]
    w = max(len(row.name) for row in rows)
    header = (
        f"{'contender':<{w}} {'step ms':>9} {'spread ms':>15} {'tok/s':>8} {'exposed ms':>11} "
        f"{'overlap eff':>11} {'state MiB':>10} {'peak RSS MiB':>13} {'train MiB':>10}"
    )
    lines += [header, "-" * len(header)]
    for row in rows:
        lo, hi = row.spread_ms
        e = row.exposed_comm_ms
        e_str = "n/a" if e is None else ("~" if row.exposed_comm_estimated else "") + f"{e:.1f}"
        eff = "n/a" if row.overlap_efficiency is None else f"{row.overlap_efficiency:.0%}"
        peak = "n/a" if row.peak_mem_bytes is None else f"{row.peak_mem_bytes / mib:.1f}"
        train = "n/a" if row.train_mem_bytes is None else f"{row.train_mem_bytes / mib:.1f}"
        lines.append(
            f"{row.name:<{w}} {row.median_step_ms:>9.1f} {f'{lo:.1f}-{hi:.1f}':>15} "
            f"{row.tokens_per_s:>8.0f} {e_str:>11} {eff:>11} {row.state_bytes / mib:>10.1f} "
            f"{peak:>13} {train:>10}"
        )
    lines.append(
        "~ = estimate: step - floor-compute.  overlap eff = hidden comm / total comm from "
        "overlap's trace.  state = params + grads + optimizer + communication state "
        "(error feedback, PowerSGD), per rank.\n"
        "peak RSS = the OS's high-water mark (VmHWM) of a fresh world running only that contender "
        "(largest rank; whole process: import, build, steps); train = that peak less the RSS "
        "before the contender was built" + (
            f" (medians of {cfg.memory_repeats} worlds)" if cfg.memory_repeats > 1 else ""
        ) + ("" if cfg.memory else ": not measured (--no-memory)")
    )
    for row in rows:
        if not row.name.startswith("overlap"):
            continue
        ratios = [
            f"{row.name}/{other.name} = {row.median_step_ms / other.median_step_ms:.3f}"
            for other in map(report.run, RATIO_BASES)
            if other is not None
        ]
        ratios += [
            f"memory (state) {row.name}/{other.name} = {row.state_bytes / other.state_bytes:.3f}"
            for other in map(report.run, ("ddp", *peers.DEEPSPEED_PEERS))
            if other is not None and other.state_bytes
        ]
        lines.append("  " + "\n  ".join(ratios))
    return "\n".join(lines)


def format_scaling(reports: list[StepReport]) -> str:
    """tokens/s per contender per world size, and the speedup over the smallest world size."""
    reports = sorted(reports, key=lambda r: r.world_size)
    base = reports[0]
    names = list(dict.fromkeys(run.name for r in reports for run in r.runs))
    w = max(len("contender"), *map(len, names))
    col = 18
    n0 = base.world_size
    title = (
        f"\nscaling: global tokens/s at world size n (speedup vs n={n0}), "
        f"{base.config.batch} sequences per rank"
    )
    header = f"{'contender':<{w}}" + "".join(f"{f'n={r.world_size}':>{col}}" for r in reports)
    lines = [title, header, "-" * len(header)]
    for name in names:
        ref = base.run(name)
        cells = []
        for r in reports:
            run = r.run(name)
            if run is None:
                cells.append(f"{'-':>{col}}")
                continue
            speedup = f"({run.tokens_per_s / ref.tokens_per_s:.2f}x)" if ref is not None else "(-)"
            cells.append(f"{f'{run.tokens_per_s:.0f} {speedup}':>{col}}")
        lines.append(f"{name:<{w}}" + "".join(cells))
    ideal = "".join(f"{f'({r.world_size / n0:.2f}x)':>{col}}" for r in reports)
    lines.append(f"{'ideal':<{w}}" + ideal)
    return "\n".join(lines)


def json_path_for(path: str, world_size: int, num_worlds: int) -> Path:
    """PATH for a single world size; PATH with `.n<world size>` before its suffix otherwise."""
    p = Path(path)
    return p if num_worlds == 1 else p.with_name(f"{p.stem}.n{world_size}{p.suffix}")


def write_json(report: StepReport, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report.to_json(), indent=2) + "\n")
    print(f"wrote {path}")


def bench_step(cfg: StepBenchConfig) -> list[StepReport]:
    """The comparison once per world size in `cfg.nproc`, each in its own spawned gloo world
    (behind an emulated link if `cfg.link`); the reports in that order. Prints each world's
    table, then (with several world sizes) the scaling table; writes the JSON files. A peer
    whose package is missing is dropped first, with one line saying so."""
    kept = peers.available(cfg.contenders)
    if not kept:
        raise ValueError("overlap bench step: no contender left to run (see the line(s) above)")
    cfg = replace(cfg, contenders=kept)
    reports = []
    for n in cfg.nproc:
        if cfg.link is not None:
            spec = LinkSpec.parse(cfg.link)
            report = run_linked_world(step_rank, n, cfg, spec=spec)[0]
        else:
            report = run_local_world(
                step_rank, n, cfg, timeout_s=cfg.timeout_s, threads_per_rank=cfg.threads
            )[0]
        assert report is not None, f"rank 0 of world size {n} returned no report"
        if cfg.memory:
            peaks = measure_peaks(cfg, n)
            runs = [
                replace(
                    run,
                    peak_mem_bytes=peaks[run.name].peak_bytes,
                    train_mem_bytes=peaks[run.name].train_bytes,
                    train_mem_range_bytes=peaks[run.name].train_range_bytes,
                )
                for run in report.runs
            ]
            report = replace(report, runs=runs)
        print(format_report(report), flush=True)
        reports.append(report)
        if cfg.json_path:
            write_json(report, json_path_for(cfg.json_path, n, len(cfg.nproc)))
    if len(reports) > 1:
        print(format_scaling(reports), flush=True)
    return reports


# ---------------------------------------------------------------------------------------------
# command line


def parse_nproc(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--nproc expects a comma list of ints, got {text!r}"
        ) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = StepBenchConfig()
    parser.add_argument("--model", default=d.model, choices=MODELS)
    parser.add_argument(
        "--contenders", default=",".join(d.contenders), help=f"comma list from {ALL_CONTENDERS}"
    )
    parser.add_argument(
        "--overlap-config",
        dest="overlap_config",
        action="append",
        default=[],
        metavar="KEY=VALUE,...",
        help="one more overlap contender with these OverlapConfig overrides (repeatable)",
    )
    parser.add_argument(
        "--no-keep-freed-memory",
        dest="keep_freed_memory",
        action="store_false",
        help="leave glibc's malloc thresholds alone for every contender",
    )
    parser.add_argument(
        "--no-memory",
        dest="memory",
        action="store_false",
        help="skip the per-contender peak RSS pass (one fresh world per contender)",
    )
    parser.add_argument(
        "--memory-repeats",
        type=int,
        default=d.memory_repeats,
        help="fresh worlds per contender in the peak RSS pass (medians reported)",
    )
    parser.add_argument("--rounds", type=int, default=d.rounds)
    parser.add_argument(
        "--steps", type=int, default=d.steps, help="timed steps per contender per round"
    )
    parser.add_argument("--layers", type=int, default=d.layers)
    parser.add_argument("--dim", type=int, default=d.dim)
    parser.add_argument("--heads", type=int, default=d.heads)
    parser.add_argument("--ff", type=int, default=d.ff, help="W1's feed-forward width")
    parser.add_argument("--batch", type=int, default=d.batch, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=d.seq)
    parser.add_argument("--lr", type=float, default=d.lr)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument(
        "--nproc",
        type=parse_nproc,
        default=d.nproc,
        metavar="N[,N...]",
        help="world sizes, e.g. 1,2,4 (several: a scaling table)",
    )
    parser.add_argument("--threads", type=int, default=d.threads, help="torch threads per rank")
    parser.add_argument(
        "--timeout-s", type=float, default=d.timeout_s, help="process-group timeout"
    )
    parser.add_argument(
        "--link", default=None, metavar="RATE[,DELAY]", help="e.g. 1gbit, 1gbit,200us"
    )
    parser.add_argument(
        "--mesh",
        default=None,
        metavar="dp=N,tp=M",
        help="FSDP x TP: overlap beside FSDP2 on a (dp, tp) mesh (overlap.tools.bench.mesh)",
    )
    parser.add_argument(
        "--json",
        dest="json_path",
        default=None,
        metavar="PATH",
        help="one file per world size: PATH, or PATH with .n<N> before its suffix for several",
    )


def config_from_args(args: argparse.Namespace) -> StepBenchConfig:
    if args.model == "gpt" and args.ff != StepBenchConfig.ff:
        print(f"WARNING: --ff {args.ff} is ignored for --model gpt (its MLP is 4 x dim)")
    return StepBenchConfig(
        model=args.model,
        contenders=tuple(c.strip() for c in args.contenders.split(",") if c.strip()),
        overlap_configs=tuple(args.overlap_config),
        rounds=args.rounds,
        steps=args.steps,
        layers=args.layers,
        dim=args.dim,
        heads=args.heads,
        ff=args.ff,
        batch=args.batch,
        seq=args.seq,
        lr=args.lr,
        seed=args.seed,
        nproc=tuple(args.nproc),
        threads=args.threads,
        keep_freed_memory=args.keep_freed_memory,
        memory=args.memory,
        memory_repeats=args.memory_repeats,
        timeout_s=args.timeout_s,
        link=args.link,
        json_path=args.json_path,
    )


def run(args: argparse.Namespace) -> int:
    if args.mesh is not None:  # a benchmark of its own, sharing these flags
        from overlap.tools.bench import mesh

        return mesh.run(args)
    try:
        cfg = config_from_args(args)
    except (ValueError, TypeError) as e:
        raise SystemExit(f"overlap bench step: {e}") from None
    try:
        bench_step(cfg)
    except ValueError as e:  # every contender asked for was skipped
        raise SystemExit(str(e)) from None
    return 0
