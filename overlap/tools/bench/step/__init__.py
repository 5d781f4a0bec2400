"""`overlap bench step`: one training step side by side: overlap vs FSDP2 vs DDP vs two floors,
and the peers a user would pick instead (DeepSpeed ZeRO-3, DDP compression hooks, PowerSGD).

    overlap bench step                                     # W1, 2 gloo ranks, the base contenders
    overlap bench step --model gpt --layers 4 --dim 256 --heads 4 --nproc 1,2,4
    overlap bench step --overlap-config prefetch_depth=2 --json out/w1.json
    overlap bench step --link 1gbit                        # ranks behind an emulated 1 Gbit/s link
    overlap bench step --hsdp 2 --nproc 4                  # HSDP 2 x 2: overlap and FSDP2 on a 2-D mesh
    overlap bench step --contenders overlap,ddp,deepspeed,deepspeed-tuned,ddp-bf16 \
        --overlap-config grad_compression=int8,error_feedback=True   # peers beside our codecs

Models (`--model`): `w1`, the core issue's workload, a stack of `--layers`
nn.TransformerEncoderLayer(d=`--dim`, ff=`--ff`) trained on a fixed random input with loss
mean(out^2); `gpt`, the package's byte-level GPT (overlap.tools.workloads.gpt) on a fixed batch of the
stdlib's bytes (overlap.tools.workloads.data) with its own cross-entropy. The unit of sharding is a layer (W1) or
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

HSDP (`--hsdp R`): overlap and the fsdp2 contenders run on a (R, world / R) DeviceMesh
("replicate", "shard"; overlap.tools.bench.peers.data_mesh): overlap.wrap(group=mesh) (its
hybrid_mode "replicate") and fully_shard(mesh=mesh) (FSDP2's HSDP) both shard over world / R
consecutive ranks and all-reduce the reduced gradient shards across the R replicas. DDP, its hook
peers and floor-compute are the same whatever the mesh; floor-compute||comm keeps ZeRO-3's
collectives over every rank and the DeepSpeed peers stay ZeRO-3 over every rank (a WARNING says
so). Every world size of `--nproc` must divide by R. Each overlap row's "transport" line names
the strategy that carried its all-gathers, reduce-scatters (the shard group) and all-reduces
(the replicate group): shared memory (Shm*) or gloo (Gloo*).

[Note: what floor-compute||comm issues, and when]
Per unit, in the sizes ZeRO-3 would use (the unit's numel padded to a multiple of the world size,
fp32): an all-gather from its forward pre-hook, an all-gather when the gradient of its output
arrives (a tensor hook, i.e. the start of its backward) and a reduce-scatter once all its
parameters have accumulated gradients. The root's own parameters (gpt: embeddings, final norm,
head) are gathered once before the forward and reduce-scattered once, as FSDP2 keeps the root
unsharded between forward and backward. All are async_op=True on preallocated buffers that
nothing reads, so no compute ever waits on them; the step waits for all of them at its end.
On gloo they are the exchanges overlap's CPU transport uses, the cheapest gloo has: at two ranks
the gather of a pair, and the reduction through all-to-all, both posted receives first
([Note: receive before send] in overlap/transport/pairwise.py); gloo's own all-gather and
reduce-scatter (twice the bytes) would make the floor slower than what overlap reaches.
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
of a spawned rank] in protocol.py) at the end; reported is the largest rank. It covers the whole process (torch import, model build, steps), the same baseline
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

Layout: the workload (models, units, batch, loss) is overlap/tools/workloads/step.py; here, the
config in config.py, the contenders in contenders.py, the protocol every rank runs in
protocol.py, the numbers, tables and JSON in report.py; this module runs the worlds (the timed
one, then the memory pass) and holds the command line, whose flags are StepBenchConfig's fields.
Every name those modules define is importable from here.
"""

from __future__ import annotations

import argparse
import statistics
import warnings
from dataclasses import dataclass, replace

from overlap.tools.bench import mesh, peers
from overlap.tools.bench.peers import parse_overrides
from overlap.tools.bench.step.config import ALL_CONTENDERS, DEFAULT_CONTENDERS, StepBenchConfig
from overlap.tools.bench.step.contenders import (
    Contender,
    attach_zero3_comm,
    build_contender,
    build_contenders,
    contender_names,
    from_trainer,
    make_floor_with_comm,
    make_overlap,
    standard,
    train_setup,
    trainer_step,
    transport_names,
)
from overlap.tools.bench.step.protocol import (
    PARITY_RTOL,
    WARMUP_STEPS,
    check_parity,
    peak_rank,
    process_peak_rss_bytes,
    run_segment,
    set_up_rank,
    step_rank,
    warm_up_and_account,
)
from overlap.tools.bench.step.report import (
    RATIO_BASES,
    StepReport,
    StepRun,
    format_report,
    format_scaling,
    json_path_for,
    summarize,
    write_json,
)
from overlap.tools.flags import add_flags, comma_list, config_or_exit, from_flags
from overlap.tools.workloads.step import (
    GPT_CORPUS_BYTES,
    MODELS,
    Batch,
    ModelName,
    Workload,
    build_model,
    compute_loss,
    describe,
    make_batch,
    root_params,
    shard_units,
    train_step,
)
from overlap.tools.worlds.launch import run_local_world
from overlap.tools.worlds.link import LinkSpec, run_linked_world

__all__ = [
    "ALL_CONTENDERS",
    "DEFAULT_CONTENDERS",
    "GPT_CORPUS_BYTES",
    "MODELS",
    "PARITY_RTOL",
    "RATIO_BASES",
    "WARMUP_STEPS",
    "Batch",
    "Contender",
    "ModelName",
    "Peaks",
    "StepBenchConfig",
    "StepReport",
    "StepRun",
    "Workload",
    "add_arguments",
    "attach_zero3_comm",
    "bench_step",
    "build_contender",
    "build_contenders",
    "build_model",
    "check_parity",
    "compute_loss",
    "config_from_args",
    "contender_names",
    "describe",
    "format_report",
    "format_scaling",
    "from_trainer",
    "json_path_for",
    "make_batch",
    "make_floor_with_comm",
    "make_overlap",
    "measure_peaks",
    "parse_nproc",
    "parse_overrides",
    "peak_rank",
    "process_peak_rss_bytes",
    "root_params",
    "run",
    "run_segment",
    "set_up_rank",
    "shard_units",
    "standard",
    "step_rank",
    "summarize",
    "train_setup",
    "train_step",
    "trainer_step",
    "transport_names",
    "warm_up_and_account",
    "write_json",
]

parse_nproc = comma_list(int)
"""`--nproc 1,2,4` -> (1, 2, 4)."""


# ---------------------------------------------------------------------------------------------
# the worlds: timed comparison, then the memory pass


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
            ranks = run_local_world(
                peak_rank, world_size, cfg, name, timeout_s=cfg.timeout_s, threads_per_rank=cfg.threads
            )
            seen[name].append(ranks[0])
    out = {}
    for name, runs in seen.items():
        train = [t for _, t in runs]
        out[name] = Peaks(
            peak_bytes=int(statistics.median(p for p, _ in runs)),
            train_bytes=int(statistics.median(train)),
            train_range_bytes=(min(train), max(train)),
        )
    return out


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
            report = run_linked_world(step_rank, n, cfg, spec=LinkSpec.parse(cfg.link))[0]
        else:
            report = run_local_world(step_rank, n, cfg, timeout_s=cfg.timeout_s, threads_per_rank=cfg.threads)[0]
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """StepBenchConfig's fields as flags, and `--mesh`, the old spelling of `overlap bench mesh`."""
    add_flags(parser, StepBenchConfig)
    parser.add_argument(
        "--mesh",
        default=None,
        metavar="dp=N,tp=M",
        help="deprecated: `overlap bench mesh --dp N --tp M` (FSDP x TP, overlap beside FSDP2)",
    )


def config_from_args(args: argparse.Namespace) -> StepBenchConfig:
    if args.model == "gpt" and args.ff != StepBenchConfig.ff:
        print(f"WARNING: --ff {args.ff} is ignored for --model gpt (its MLP is 4 x dim)")
    cfg = from_flags(StepBenchConfig, args)
    flat = [name for name in cfg.contenders if name in ("floor-compute||comm", *peers.DEEPSPEED_PEERS)]
    if cfg.hsdp > 1 and flat:
        print(f"WARNING: --hsdp {cfg.hsdp} does not apply to {', '.join(flat)}: ZeRO-3 over every rank")
    return cfg


def run(args: argparse.Namespace) -> int:
    if args.mesh is not None:  # the old spelling of `overlap bench mesh`, sharing these flags
        warnings.warn(
            "overlap bench step --mesh dp=N,tp=M moved to overlap bench mesh --dp N --tp M (an alias for one release)",
            DeprecationWarning,
            stacklevel=2,
        )
        print("note: `overlap bench step --mesh` is now `overlap bench mesh --dp N --tp M`")
        return mesh.run_from_step_flags(args)
    cfg = config_or_exit("overlap bench step", lambda: config_from_args(args))
    try:
        bench_step(cfg)
    except ValueError as e:  # every contender asked for was skipped
        raise SystemExit(str(e)) from None
    return 0
