"""One config on one cluster: the planner's prediction of a training step, by the path the
cluster's parallelism asks for.

`estimate()` dispatches: FSDP alone (fsdp.py: units from the model profile, the simulator's step,
throughput, [Note: memory per GPU]) or, when `Cluster.dims` has tp or pp > 1, FSDP x TP x PP
(parallel.py, which builds on fsdp.py's units and memory). Both paths sit below this module and
neither calls back up. The cluster and the estimate's types are fsdp.py's, importable from here.
"""

from __future__ import annotations

from overlap.config import OverlapConfig
from overlap.tools.plan.fsdp import (
    MASTER_BYTES_PER_PARAM,
    OPTIMIZER_BYTES_PER_PARAM,
    SHARDED_STATE_BYTES_PER_PARAM,
    Cluster,
    Estimate,
    MemoryEstimate,
    build_units,
    check_whole_nodes,
    dtype_bytes,
    estimate_fsdp,
    group_blocks,
)
from overlap.tools.plan.models import ModelProfile
from overlap.tools.plan.parallel import estimate_parallel


def estimate(profile: ModelProfile, config: OverlapConfig, cluster: Cluster) -> Estimate:
    """Predict one steady-state training step through the cluster's calibration (by default
    nccl: one communicator, collectives in order; [Note: one model] in
    overlap/step_model/calibration.py). With tensor or pipeline parallelism (`cluster.dims`) the
    step is `parallel.estimate_parallel`'s, else `fsdp.estimate_fsdp`'s."""
    if cluster.dims.enabled:
        return estimate_parallel(profile, config, cluster)
    return estimate_fsdp(profile, config, cluster)


__all__ = [
    "MASTER_BYTES_PER_PARAM",
    "OPTIMIZER_BYTES_PER_PARAM",
    "SHARDED_STATE_BYTES_PER_PARAM",
    "Cluster",
    "Estimate",
    "MemoryEstimate",
    "build_units",
    "check_whole_nodes",
    "dtype_bytes",
    "estimate",
    "estimate_fsdp",
    "group_blocks",
]
