"""One config on a 2-D or 3-D cluster (FSDP x TP x PP): the FSDP step of the bottleneck rank
from the simulator, the tensor-parallel collectives, the pipeline sends and bubble around it.

`estimate()` in estimate.py comes here when `Cluster.dims` has tp or pp > 1; this module builds
on fsdp.py's cluster, units and FSDP step, and imports nothing above it. The simulator
replays one micro-batch of the rank's stage (its layers, 1/T of their parameters) over a
data-parallel group of D ranks on the link [Note: 3-D layout] in layout.py gives it, twice: once
without reduction (every micro-batch gathers) and once with (the last one reduces); the step is
assembled as [Note: pipeline step] in layout.py says.

[Note: memory with TP and PP]
    sharded state      16 bytes per parameter of the rank's stage (1/T of its layers and root),
                       divided by D
    root, units, grads the simulator's peaks for the stage's units (1/T wide), as for FSDP
    activations        the model's estimate per token x micro-batch tokens x the rank's share of
                       the layers x micro-batches in flight (`in_flight_microbatches`) / T
                       (sequence parallelism shards what tensor parallelism does not)
"""

from __future__ import annotations

from dataclasses import replace

from overlap.config import OverlapConfig
from overlap.step_model.simulate import Prediction
from overlap.tools.plan.fsdp import Cluster, Estimate, build_units, estimate_fsdp
from overlap.tools.plan.layout import (
    ParallelBreakdown,
    ParallelDims,
    in_flight_microbatches,
    make_layout,
    p2p_s,
    stage_profile,
    tp_cost,
)
from overlap.tools.plan.models import ModelProfile


def dp_cluster(cluster: Cluster) -> Cluster:
    """One data-parallel group as an FSDP cluster: D ranks, GPUs-per-node / T of them per node
    (so its ring runs on NVLink while the group fits in a node, on the inter-node link after)."""
    layout = make_layout(cluster.dims, cluster.num_gpus, cluster.gpus_per_node, cluster.intra, cluster.inter)
    return replace(cluster, num_gpus=layout.dp, gpus_per_node=layout.dp_ranks_per_node, dims=ParallelDims())


def estimate_parallel(profile: ModelProfile, config: OverlapConfig, cluster: Cluster) -> Estimate:
    """Predict one steady-state step of `config` with `cluster.dims` tensor/pipeline parallelism."""
    dims = cluster.dims
    layout = make_layout(dims, cluster.num_gpus, cluster.gpus_per_node, cluster.intra, cluster.inter)
    stage = stage_profile(profile, dims)
    group = dp_cluster(cluster)
    # min_unit_numel counts global elements (overlap.wrap sums DTensor shapes): 1/T of them here
    stage_config = config.replace(min_unit_numel=config.min_unit_numel // dims.tp)
    synced = estimate_fsdp(stage, stage_config, group)  # a micro-batch that reduces
    units = [replace(u, grad_bytes=0) for u in build_units(stage, stage_config, group)]
    unsynced = group.model().predict(units, stage_config, topology=group.topology(), root=0)
    num_layers = len(stage.block_numels)
    tp = tp_cost(profile, dims, layout, num_layers, stage.local_batch)
    p2p = p2p_s(profile, dims, layout, stage.local_batch)
    m = dims.num_microbatches
    fill = (dims.pp - 1) / dims.virtual_stages
    # [Note: pipeline step]: the stage keeps its units across micro-batches when they all fit
    stage_bytes = sum(u.param_bytes for u in units[1:])  # units[0]: the root, held all step anyway
    cap = stage_config.max_inflight_allgather_bytes
    gathering = 1 if cap is None or stage_bytes <= cap else m  # micro-batches that gather
    fsdp_s = (gathering * unsynced.step_s + (m - gathering) * unsynced.compute_s) / m
    microbatch_s = fsdp_s + tp.exposed_s + p2p
    reduce_tail_s = max(0.0, synced.prediction.step_s - synced.optimizer_s - unsynced.step_s)
    bubble_s = fill * microbatch_s
    step_s = (m + fill) * microbatch_s + reduce_tail_s + synced.optimizer_s
    s = synced.prediction
    held = (stage_bytes, len(units) - 1) if gathering == 1 else (s.peak_unsharded_bytes, s.peak_unsharded_units)
    prediction = Prediction(
        step_s=step_s,
        compute_s=m * unsynced.compute_s + synced.optimizer_s,
        exposed_s=gathering * unsynced.exposed_s + m * (tp.exposed_s + p2p) + reduce_tail_s,
        comm_busy_s=gathering * unsynced.comm_busy_s
        + m * (tp.busy_s + p2p)
        + max(0.0, s.comm_busy_s - unsynced.comm_busy_s),
        peak_unsharded_bytes=held[0],
        peak_unsharded_units=held[1],
        num_allgathers=gathering * unsynced.num_allgathers,
        num_reduce_scatters=s.num_reduce_scatters,
        peak_reduce_bytes=s.peak_reduce_bytes,
    )
    activation = synced.memory.activation_bytes
    if activation is not None:  # [Note: memory with TP and PP]: the profile's estimate was per GPU of a whole model
        share = num_layers / len(profile.block_numels)
        activation = activation * share * in_flight_microbatches(dims) / dims.tp
    breakdown = ParallelBreakdown(
        layout=layout,
        layers_per_rank=num_layers,
        microbatch_size=stage.local_batch,
        microbatch_s=microbatch_s,
        fsdp_microbatch_s=fsdp_s,
        reduce_tail_s=reduce_tail_s,
        tp=tp,
        p2p_microbatch_s=p2p,
        bubble_s=bubble_s,
    )
    tokens_per_gpu = profile.local_batch * profile.seq_len / (dims.tp * dims.pp)
    return replace(
        synced,
        config=config,
        prediction=prediction,
        memory=replace(synced.memory, activation_bytes=activation, units_in_flight_bytes=held[0]),
        num_gpus=cluster.num_gpus,
        tokens_per_gpu_step=tokens_per_gpu,
        model_flops_per_token=profile.model_flops_per_token,
        parallel=breakdown,
    )


__all__ = ["dp_cluster", "estimate_parallel"]
