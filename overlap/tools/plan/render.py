"""Text of `overlap plan`: the assumptions with their sources, the prediction, the best config
found, the run's cost and the scaling table. Pure formatting of a `PlanResult`."""

from __future__ import annotations

from overlap.tools.plan.estimate import Estimate
from overlap.tools.plan.models import DEFAULT_MFU
from overlap.tools.plan.result import PlanResult, RunCost
from overlap.tools.plan.search import describe

GIB = 2**30
AC_TEXT = {
    "none": "no activation checkpointing",
    "selective": "selective (op-level) activation checkpointing: half the matmul forward recomputed",
    "full": "full activation checkpointing: every block's forward recomputed",
}


def si(x: float, unit: str = "") -> str:
    """3 significant digits with a K/M/B/T suffix: 5.72M."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{suffix}{unit}"
    return f"{x:.3g}{unit}"


def _duration(seconds: float) -> str:
    if seconds >= 2 * 86400:
        return f"{seconds / 86400:.1f} days"
    if seconds >= 2 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.1f} min"


def _summary(e: Estimate) -> str:
    fits = "fits" if e.fits else "DOES NOT FIT"
    return (
        f"step {e.step_s:.3f} s, {e.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, MFU {100 * e.mfu:.1f}%, "
        f"exposed comm {100 * e.exposed_share:.1f}%, memory {e.memory.total_bytes / GIB:.1f} GiB ({fits})"
    )


def _assumptions(r: PlanResult) -> list[str]:
    p, c, req = r.profile, r.cluster, r.request
    tokens = p.seq_len * p.local_batch
    share = 100 * c.achieved_tflops / c.gpu.peak_tflops
    kernels = c.kernels is not None and p.shape is not None
    if kernels:
        e = r.estimate
        executed = (
            p.executed_flops_per_token * e.tokens_per_gpu_step / max(e.prediction.compute_s - e.optimizer_s, 1e-12)
        )
        rate = (
            f"the kernel model's rates ({c.kernels}: GEMMs, attention, element-wise bytes on this GPU) = "
            f"{executed / 1e12:.0f} TFLOPs executed, {100 * executed / 1e12 / c.gpu.peak_tflops:.0f}% of"
        )
    elif req.tflops is not None:
        rate = f"{c.achieved_tflops:.1f} TFLOPs (--tflops) = {share:.0f}% of"
    else:
        src = (
            "--mfu" if req.mfu is not None else f"default {DEFAULT_MFU}: Llama 3 paper Table 4, 38-43% BF16 MFU on H100"
        )
        rate = f"{c.achieved_tflops:.1f} TFLOPs = {share:.0f}% ({src}) of"
    nodes = f" = {c.num_nodes} nodes x {c.gpus_per_node}" if c.num_gpus > c.gpus_per_node else " in one node"
    config = "--config" if req.config is not None else "plan default: bf16 params, fp32 gradient reduction"
    cluster = (
        f"cluster    {c.num_gpus} x {c.gpu.name}{nodes}; intra {c.intra.name} ({c.intra.busbw_gbps:g} GB/s "
        f"busbw), inter {c.inter.name} ({c.inter.busbw_gbps:g} GB/s busbw per adapter, one per GPU: a ring with k "
        f"ranks per node drives k, up to NVLink)"
    )
    batch = (
        f"batch      {p.local_batch} x {p.seq_len} = {tokens:,} tokens/GPU/step, "
        f"{si(tokens * c.num_gpus)} tokens/step in all; {AC_TEXT[p.ac]}"
    )
    compute = (
        f"compute    kernels at {rate} {c.gpu.peak_tflops:g} peak bf16; HBM {c.gpu.hbm_gib:g} GiB, "
        f"{c.gpu.hbm_tbps:g} TB/s"
    )
    lines = [
        f"model      {p.name}: {p.num_params / 1e9:.2f} B parameters ({p.description})",
        f"           {p.model_flops_per_token / 1e9:.1f} GFLOPs/token (6N + attention); source: {p.source}",
        cluster,
        batch,
        compute,
        f"config     ({config}) {describe(r.config, p)}",
    ]
    b = r.estimate.parallel
    if b is not None:
        d, lay = b.layout.dims, b.layout
        schedule = d.pp_schedule + (f", {d.virtual_stages} stages/rank" if d.virtual_stages > 1 else "")
        lines[3] = (f"batch      {p.local_batch} x {p.seq_len} per data-parallel rank = {r.estimate.tokens_per_gpu_step:,.0f} "
                    f"tokens/GPU/step, {si(p.local_batch * p.seq_len * lay.dp)} tokens/step in all; {AC_TEXT[p.ac]}")  # fmt: skip
        lines.append(
            f"parallel   tp {d.tp} x pp {d.pp} x dp {lay.dp}: overlap shards over dp ({lay.dp_link.name}, "
            f"{'across nodes' if lay.dp_crosses_nodes else 'inside a node'}); tp on {lay.tp_link.name} "
            f"({'async: hidden' if d.async_tp else 'exposed'}, sequence parallel)"
            + (f"; pp {schedule}, {d.num_microbatches} micro-batches of {b.microbatch_size}, sends on "
               f"{lay.pp_link.name}" if d.pp > 1 else "")
        )  # fmt: skip
    return lines


def _memory(e: Estimate, ac: str) -> list[str]:
    m, pred = e.memory, e.prediction
    fits = "fits" if e.fits else f"DOES NOT FIT: {(m.total_bytes - e.hbm_bytes) / GIB:.1f} GiB over"
    if m.activation_bytes is None:
        act = "not estimated (module path)"
    else:
        act = f"{m.activation_bytes / GIB:8.2f} GiB  estimate: saved tensors per block ({ac} AC) + logits"
    lines = [
        f"  memory per GPU   {m.total_bytes / GIB:.2f} GiB of {e.hbm_bytes / GIB:g} GiB: {fits}",
        f"    sharded params+grads+AdamW {m.sharded_state_bytes / GIB:8.2f} GiB  16 B/param / {e.num_gpus} GPUs"
        if e.parallel is None
        else f"    sharded params+grads+AdamW {m.sharded_state_bytes / GIB:8.2f} GiB  16 B/param of one rank's stage "
        f"(1/{e.parallel.layout.dims.tp} wide) / dp {e.parallel.layout.dp}",
        f"    root unit, unsharded       {m.root_bytes / GIB:8.2f} GiB  embeddings, final norm, head",
        f"    units in flight (peak)     {m.units_in_flight_bytes / GIB:8.2f} GiB  "
        + f"{pred.peak_unsharded_units} units gathered at once (simulator)",
        f"    gradient buffers (peak)    {m.grad_buffer_bytes / GIB:8.2f} GiB  "
        + "buckets in reduction (simulator) + one unit",
    ]
    if m.error_feedback_bytes:
        lines.append(f"    error-feedback residual    {m.error_feedback_bytes / GIB:8.2f} GiB")
    lines.append(f"    activations                {act}")
    return lines


def _parallel_step(e: Estimate) -> tuple[str, str]:
    """The step line and the breakdown of a plan with tensor or pipeline parallelism."""
    b, pred = e.parallel, e.prediction
    assert b is not None
    d, m = b.layout.dims, b.layout.dims.num_microbatches
    step = (
        f"  step time        {e.step_s:.3f} s = compute {pred.compute_s - e.optimizer_s:.3f} s + exposed comm "
        f"{pred.exposed_s:.3f} s ({100 * e.exposed_share:.1f}%) + bubble {b.bubble_s:.3f} s "
        f"({100 * b.bubble_s / e.step_s:.1f}%) + optimizer {e.optimizer_s:.3f} s"
    )
    lines = []
    if d.pp > 1:
        lines.append(
            f"  pipeline         ({m} + {d.pp - 1}/{d.virtual_stages}) x {b.microbatch_s:.3f} s per micro-batch "
            f"(bubble {100 * b.bubble_fraction:.1f}% of the slots) + reduce tail {b.reduce_tail_s:.3f} s; "
            f"{b.layers_per_rank} layers/rank"
        )
    lines.append(
        f"  micro-batch      FSDP fwd+bwd {b.fsdp_microbatch_s:.3f} s (simulator, {pred.num_allgathers // m} all-gathers "
        f"over {e.num_units} units + root) + TP {b.tp.exposed_s:.3f} s exposed + sends {b.p2p_microbatch_s:.4f} s"
    )
    if d.tp > 1:
        lines.append(
            f"  tensor parallel  {b.tp.num_collectives} collectives/micro-batch of {b.tp.bytes_each / 1e6:,.0f} MB, "
            f"{m * b.tp.busy_s:.3f} s busy/step, {m * b.tp.exposed_s:.3f} s exposed"
        )
    if b.layout.dp > 1:
        lines.append(
            f"  data parallel    {pred.num_allgathers} all-gathers + {pred.num_reduce_scatters} reduce-scatters per step "
            f"over dp {b.layout.dp} ({b.layout.dp_link.name})"
        )
    else:
        lines.append("  data parallel    dp 1: no data-parallel collectives")
    return step, "\n".join(lines)


def _prediction(r: PlanResult) -> list[str]:
    e = r.estimate
    pred = e.prediction
    compute = pred.compute_s - e.optimizer_s
    step = (
        f"  step time        {e.step_s:.3f} s = compute {compute:.3f} s + exposed comm "
        f"{pred.exposed_s:.3f} s ({100 * e.exposed_share:.1f}%) + optimizer {e.optimizer_s:.3f} s"
    )
    comm = (
        f"  comm             {pred.num_allgathers} all-gathers + {pred.num_reduce_scatters} "
        f"reduce-scatters over {e.num_units} units + root, {pred.comm_busy_s:.3f} s busy on one NCCL lane"
    )
    if e.parallel is not None:
        step, comm = _parallel_step(e)
    return [
        "prediction (planned config, simulated steady-state step)",
        step,
        comm,
        f"  tokens/s         {e.tokens_per_s_per_gpu:,.0f} per GPU, {si(e.tokens_per_s)} total",
        f"  MFU              {100 * e.mfu:.1f}% (model FLOPs / step time / peak)",
        *_memory(e, r.profile.ac),
    ]


def _best(r: PlanResult) -> list[str]:
    if r.search is None:
        return []
    b, e = r.search.best, r.estimate
    head = f"best config found ({r.search.num_simulated} configs simulated)"
    if b.config == r.config:
        return [head, "  the planned config itself: " + _summary(b)]
    gain = (e.step_s - b.step_s) / e.step_s
    return [
        head,
        f"  {describe(b.config, r.profile, r.config)}",
        f"  {_summary(b)}",
        f"  {100 * gain:.1f}% shorter step than the planned config",
    ]


def _cost_line(label: str, c: RunCost) -> str:
    return (
        f"  {label:<15} {_duration(c.wall_s)} wall-clock, {c.gpu_hours:,.0f} GPU-hours, "
        f"cost {c.cost:,.0f} at {c.gpu_hour_price:g} per GPU-hour"
    )


def _costs(r: PlanResult) -> list[str]:
    planned = r.run_cost()
    if planned is None:
        return []
    lines = [f"run of {si(planned.tokens)} tokens on {r.cluster.num_gpus} GPUs", _cost_line("planned config", planned)]
    if r.search is not None and r.search.best.config != r.config:
        best = r.run_cost(r.search.best)
        assert best is not None
        lines.append(_cost_line("best config", best))
    return lines


def _scaling(r: PlanResult) -> list[str]:
    if not r.scaling:
        return []
    priced = r.request.tokens is not None
    head = (
        f"{'GPUs':>5} {'nodes':>5} {'step s':>7} {'exposed':>7} {'tok/s/GPU':>9} {'tok/s':>7} {'MFU':>6} {'mem GiB':>7}"
    )
    head += f" {'days':>6} {'cost':>7}" if priced else ""
    head += f" | {'best: step s':>12} {'tok/s/GPU':>9} {'MFU':>6} {'blocks/unit':>11} {'prefetch':>8} {'ZeRO':>4}"
    title = (
        "scaling curve (local batch fixed; best = local search at each size; * = planned size; "
        "! = does not fit in memory)"
    )
    lines = [title, head]
    block = max(r.profile.block_numels)
    for pt in r.scaling:
        g, b = pt.given, pt.best
        mark = "*" if pt.num_gpus == r.request.num_gpus else " "
        nodes = max(1, pt.num_gpus // r.cluster.gpus_per_node)
        line = (
            f"{pt.num_gpus:>4}{mark} {nodes:>5} {g.step_s:>7.3f} {100 * g.exposed_share:>6.1f}% "
            f"{g.tokens_per_s_per_gpu:>9,.0f} {si(g.tokens_per_s):>7} {100 * g.mfu:>5.1f}% "
            f"{g.memory.total_bytes / GIB:>6.1f}{' ' if g.fits else '!'}"
        )
        if priced:
            cost = r.run_cost(g)
            assert cost is not None
            days = cost.wall_s / 86400
            line += (f" {days:>6.1f}" if days < 1000 else f" {si(days):>6}") + f" {si(cost.cost):>7}"
        per_unit = max(1, -(-b.config.min_unit_numel // block))
        zero = 3 if b.config.reshard_after_forward else 2
        line += (
            f" | {b.step_s:>12.3f} {b.tokens_per_s_per_gpu:>9,.0f} {100 * b.mfu:>5.1f}% {per_unit:>11} "
            f"{b.config.prefetch_depth:>8} {zero:>4}"
        )
        lines.append(line)
    return lines


def format_report(r: PlanResult) -> str:
    """The whole `overlap plan` report."""
    sections = [
        [f"overlap plan  ({r.elapsed_s:.1f} s)", *_assumptions(r)],
        _prediction(r),
        _best(r),
        _costs(r),
        _scaling(r),
        [f"note: {n}" for n in r.notes],
    ]
    return "\n\n".join("\n".join(s) for s in sections if s)
