"""`overlap plan`: what a model will do on a cluster before the cluster is spent on it.

    overlap plan --model llama-8b --gpus 1024 --gpus-per-node 8 --link ndr400
    overlap plan --model llama-70b --gpus 1024 --tp 8 --pp 4 --microbatches 8

prints the predicted step time, tokens/s (per GPU and total), MFU, exposed communication, memory
per GPU, the best config a small search on the simulator finds, and a scaling curve from 8 to
4,096 GPUs (--png draws it). With --gpu-hour-price and --tokens it prices the whole run. --tp and
--pp plan tensor and pipeline parallelism around the data-parallel FSDP step (layout.py, parallel.py).
A preset model's blocks are priced by the kernel model (`--stack`; overlap/step_model/kernels.py);
`--run FILE` predicts any published-style run from a RunSpec JSON (run_spec.py, run_step.py);
`--ep N` does so for a MoE preset with its experts split over N ranks (expert parallelism:
[Note: expert parallelism] in overlap/step_model/moe.py), ZeRO-3 over the rest.

Every prediction replays the runtime's own `Schedule` on the virtual clock of
`overlap.step_model.simulate`; the inputs are stated in the output with their sources (model shapes,
GPU datasheets, link presets, the achieved-TFLOPs assumption). Importable: `plan(PlanConfig(...))`
or `plan(model="llama-8b", num_gpus=1024)` returns a `PlanResult`.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from overlap.config import OverlapConfig
from overlap.step_model.calibration import Calibration
from overlap.step_model.cost import LINKS, Link, calibrate_from_bench
from overlap.step_model.kernels import STACKS
from overlap.tools.plan import calibrate
from overlap.tools.plan.estimate import Cluster, estimate
from overlap.tools.plan.layout import PP_SCHEDULES, fits_layout
from overlap.tools.plan.models import AC_POLICIES, DEFAULT_MFU, GPUS, MODELS, gpu_spec, load_model
from overlap.tools.plan.render import format_report
from overlap.tools.plan.result import PLAN_DEFAULT_CONFIG, PlanConfig, PlanResult, RunCost
from overlap.tools.plan.run_spec import GRAPH_SCOPES, ModelShape, RunSpec
from overlap.tools.plan.run_step import format_run, predict_run
from overlap.tools.plan.scaling import plot_scaling, scaling_curve, scaling_gpu_counts
from overlap.tools.plan.search import SearchSpace, search


def resolve_link(name: str) -> Link:
    """A link preset, or a Link fitted to an `overlap bench comm --json` file."""
    if name in LINKS:
        return LINKS[name]
    if name.endswith(".json") and Path(name).is_file():
        return calibrate_from_bench(name)
    raise ValueError(
        f"unknown link {name!r}; use a preset ({', '.join(LINKS)}) or an `overlap bench comm --json` output file"
    )


def plan(request: PlanConfig | None = None, /, **overrides: Any) -> PlanResult:
    """Plan `request` (or `PlanConfig(**overrides)`; both: the request with overrides applied)."""
    started = time.perf_counter()
    request = PlanConfig(**overrides) if request is None else replace(request, **overrides)
    profile = load_model(request.model, request.seq_len, request.local_batch, request.ac)
    if request.local_batch is None and request.dims is not None and request.dims.pp > 1:
        # not given: each micro-batch is the preset's per-GPU batch (the whole data-parallel
        # rank's batch is the micro-batches together, as in torchtitan)
        profile = replace(profile, local_batch=profile.local_batch * request.dims.num_microbatches)
    cluster = Cluster(
        num_gpus=request.num_gpus,
        gpus_per_node=request.gpus_per_node,
        gpu=gpu_spec(request.gpu),
        intra=resolve_link(request.intra_link),
        inter=resolve_link(request.link),
        achieved_tflops=request.achieved_tflops,
        kernels=request.kernels,
        dims=request.dims,
    )
    config = PLAN_DEFAULT_CONFIG if request.config is None else request.config
    notes: list[str] = []
    if request.calibration is not None:
        cal = Calibration.load(request.calibration)
        cluster = cluster.with_calibration(cal)
        terms = ("NCCL lanes, contention and host work from it" if cal.backend == "nccl"
                 else "a gloo (CPU) calibration: its links only, GPUs keep NCCL's lanes and no host work")  # fmt: skip
        notes.append(f"calibration {request.calibration}: {cal.source}; its {cal.gather_link.name} link "
                     f"({cal.gather_link.busbw_gbps:.3g} GB/s busbw) is the {cal.level}-node link; {terms}; "
                     "compute from --mfu/--tflops")  # fmt: skip
    if config.param_dtype is None:
        notes.append("config has no param_dtype: planned with fp32 all-gathers (compute still at the bf16 rate)")
    space = None
    if request.search:
        space = SearchSpace.with_codecs() if request.search_codecs else SearchSpace()
    planned = estimate(profile, config, cluster)
    found = search(profile, config, cluster, space) if space is not None else None
    counts = (
        scaling_gpu_counts(request.gpus_per_node, request.num_gpus, request.scaling_gpus)
        if request.scaling_gpus
        else []
    )
    counts = [n for n in counts if fits_layout(cluster.dims, n, request.gpus_per_node)]
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
    parser.add_argument(
        "--model",
        default=d.model,
        help=f"preset ({', '.join(MODELS)}) or package.module:factory returning an nn.Module",
    )
    parser.add_argument("--gpus", type=int, default=d.num_gpus, help="GPUs in the run")
    parser.add_argument("--gpus-per-node", type=int, default=d.gpus_per_node)
    parser.add_argument("--link", default=d.link, help=f"inter-node link: {', '.join(LINKS)} or a bench comm JSON")
    parser.add_argument("--intra-link", default=d.intra_link, help="link inside a node (default nvlink4)")
    parser.add_argument("--gpu", default=d.gpu, help=f"GPU preset: {', '.join(GPUS)}")
    parser.add_argument(
        "--config", type=Path, default=None, help="OverlapConfig JSON to plan (default: bf16/fp32 mixed precision)"
    )
    parser.add_argument("--seq-len", type=int, default=None, help="sequence length (default: the model preset's)")
    parser.add_argument(
        "--local-batch",
        type=int,
        default=None,
        help="sequences per GPU per step; with --tp/--pp per data-parallel rank (default: the preset's)",
    )
    parser.add_argument(
        "--ac", choices=AC_POLICIES, default=None, help="activation checkpointing (default: the preset's)"
    )
    rate = parser.add_mutually_exclusive_group()
    rate.add_argument(
        "--mfu",
        type=float,
        default=None,
        help="achieved share of peak in the compute kernels, instead of the kernel model "
        f"(module-path models: default {DEFAULT_MFU}, Llama 3 paper, Table 4)",
    )
    rate.add_argument("--tflops", type=float, default=None, help="achieved TFLOPs per GPU in the compute kernels")
    parser.add_argument("--gpu-hour-price", type=float, default=None, help="price per GPU-hour (with --tokens)")
    parser.add_argument(
        "--tokens", type=_token_count, default=None, help="tokens of the whole run, e.g. 15T (with --gpu-hour-price)"
    )
    parser.add_argument("--png", type=Path, default=None, help="draw the scaling curve into this PNG")
    parser.add_argument("--json", type=Path, default=None, help="write the numbers as JSON here")
    parser.add_argument("--no-search", action="store_true", help="predict the given config only")
    parser.add_argument(
        "--search-codecs", action="store_true", help="also search the lossy codecs (int8/bf16 on the wire)"
    )
    parser.add_argument("--calibration", default=None, metavar="FILE",
                        help="measured costs (from --calibrate): links of their level, contention, host work")  # fmt: skip
    par = parser.add_argument_group("tensor and pipeline parallelism (overlap shards over the data-parallel rest)")
    par.add_argument("--tp", type=int, default=d.tp, help="tensor-parallel degree, inside a node (default 1)")
    par.add_argument("--pp", type=int, default=d.pp, help="pipeline stages (default 1)")
    par.add_argument("--microbatches", type=int, default=None, help="pipeline micro-batches per step (default: --pp)")
    par.add_argument(
        "--pp-schedule", choices=PP_SCHEDULES, default=d.pp_schedule, help="pipeline schedule (default 1f1b)"
    )
    par.add_argument("--virtual-stages", type=int, default=d.virtual_stages, help="stages per rank, interleaved only")
    par.add_argument("--async-tp", action="store_true", help="tensor-parallel collectives hidden behind the matmuls")
    moe = parser.add_argument_group("expert parallelism (a MoE preset: priced by the run model, run_step.py)")
    moe.add_argument("--ep", type=int, default=1, help="expert-parallel degree: each MoE layer's experts over N ranks")
    moe.add_argument("--dispatcher", choices=("alltoall", "flex"), default="alltoall",
                     help="token dispatch: a copy per routed expert (alltoall) or per destination rank and node (flex)")  # fmt: skip
    moe.add_argument("--cuda-graphs", nargs="*", default=[], choices=GRAPH_SCOPES, metavar="SCOPE",
                     help=f"layer parts run as CUDA graphs ({', '.join(GRAPH_SCOPES)}; default none)")  # fmt: skip
    parser.add_argument(
        "--run",
        type=Path,
        default=None,
        metavar="FILE",
        help="predict the run a RunSpec JSON describes (every parallel degree, data-parallel mode, "
        "precision, kernel stack: overlap/tools/plan/run_spec.py) and exit",
    )
    parser.add_argument(
        "--stack",
        choices=sorted(STACKS),
        default=d.stack,
        help="kernels a preset model runs on, priced by the kernel model (ignored with --mfu/--tflops)",
    )
    calibrate.add_arguments(parser)


_PLAN_ARGS = ("model", "num_gpus", "gpus_per_node", "link", "intra_link", "gpu", "seq_len", "local_batch", "ac", "mfu",
              "tflops", "gpu_hour_price", "tokens", "search_codecs", "calibration", "tp", "pp", "microbatches",
              "pp_schedule", "virtual_stages", "async_tp", "stack")  # fmt: skip
"""`PlanConfig` fields that `overlap plan`'s options set as they are."""
_ARG_OF_FIELD = {"num_gpus": "gpus"}
"""The options whose name differs from their `PlanConfig` field."""


def request_from_args(args: argparse.Namespace) -> PlanConfig:
    config = None
    if args.config is not None:
        if not args.config.is_file():
            raise ValueError(f"--config {args.config}: no such file (an OverlapConfig JSON, see OverlapConfig.save)")
        config = OverlapConfig.load(args.config)
    fields = {name: getattr(args, _ARG_OF_FIELD.get(name, name)) for name in _PLAN_ARGS}
    return PlanConfig(config=config, search=not args.no_search, **fields)


NODE_OF_GPU = {"a100-40gb": "dgx-a100", "a100-80gb": "dgx-a100", "h100-sxm": "dgx-h100", "h100-96gb": "grand-teton",
               "h200": "dgx-h200", "b200": "dgx-b200", "gb200": "gb200-nvl72"}  # fmt: skip
"""The node preset (hardware.NODES) `--ep` plans a GPU preset on."""
ACCELERATOR_OF_GPU = {"h100-96gb": "h100-96gb-500w"}


def expert_run_spec(args: argparse.Namespace) -> RunSpec:
    """The run `--ep` prices: the preset model, ZeRO-3 over dp x cp with its experts over `ep`
    ranks (expert data parallel the rest), one micro-batch of the preset's (or --local-batch)
    sequences per step, on the GPU's node preset."""
    profile = load_model(args.model, args.seq_len, args.local_batch, args.ac)
    shape = MODELS.get(args.model)
    if shape is None or shape.moe is None:
        raise ValueError(f"--ep needs a MoE preset ({', '.join(n for n, m in MODELS.items() if m.moe)})")
    if args.gpu not in NODE_OF_GPU:
        raise ValueError(f"unknown GPU {args.gpu!r}; use one of {sorted(NODE_OF_GPU)}")
    model = ModelShape(**{f.name: getattr(shape, f.name) for f in fields(ModelShape)})
    batch = profile.local_batch
    dp = args.gpus // (args.tp * args.pp)
    ac = {"none": "none", "selective": "selective", "full": "full"}.get(profile.ac, "none")
    return RunSpec(model=model, gpu=ACCELERATOR_OF_GPU.get(args.gpu, args.gpu), node=NODE_OF_GPU[args.gpu],
                   num_gpus=args.gpus, seq_len=profile.seq_len, global_batch=batch * max(1, dp), micro_batch=batch,
                   tp=args.tp, pp=args.pp, ep=args.ep, dp_mode="zero3", ac=ac, stack=args.stack,
                   async_tp=args.async_tp, dispatcher=args.dispatcher, cuda_graph_scope=tuple(args.cuda_graphs),
                   schedule="interleaved" if args.virtual_stages > 1 else "1f1b",
                   virtual_stages=args.virtual_stages)  # fmt: skip


def run(args: argparse.Namespace) -> int:
    if args.calibrate is not None:
        return calibrate.run(args)
    if args.run is not None:
        try:
            spec = RunSpec.from_dict(json.loads(args.run.read_text()))
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise SystemExit(f"overlap plan --run {args.run}: {e}") from None
        print(format_run(predict_run(spec)))
        return 0
    if args.ep > 1:
        try:
            print(format_run(predict_run(expert_run_spec(args))))
        except ValueError as e:
            raise SystemExit(f"overlap plan --ep: {e}") from None
        return 0
    try:
        result = plan(request_from_args(args))
    except ValueError as e:
        raise SystemExit(f"overlap plan: {e}") from None
    print(format_report(result))
    if args.png is not None:
        try:
            path = plot_scaling(
                result.scaling,
                args.png,
                f"overlap plan: {result.profile.name} on {result.cluster.gpu.name}, "
                f"{result.request.link} between nodes of {result.cluster.gpus_per_node}",
            )
        except ImportError:
            print("no PNG: matplotlib is not installed (pip install -e '.[plot]')")
            return 1
        print(f"wrote {path}")
    if args.json is not None:
        args.json.write_text(json.dumps(result.to_dict(), indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


__all__ = ["PLAN_DEFAULT_CONFIG", "PlanConfig", "PlanResult", "RunCost", "add_arguments", "plan", "run"]
