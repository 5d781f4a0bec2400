"""The scaling curve: one config and the best found, from 8 to 4,096 GPUs, as a table and a PNG.

Weak scaling: the local batch stays fixed, so the global batch grows with the GPU count and the
per-GPU compute of a step does not change; what changes is the ring (more steps, the inter-node
link once the world spans nodes) and the sharded state. Per-GPU tokens/s is flat while the
communication hides behind compute and drops once it no longer does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from overlap.config import OverlapConfig
from overlap.tools.plan.estimate import Cluster, Estimate, estimate
from overlap.tools.plan.models import ModelProfile
from overlap.tools.plan.search import SearchSpace, refine

SCALING_GPUS: tuple[int, ...] = tuple(2**k for k in range(3, 13))  # 8 ... 4096


@dataclass(frozen=True)
class ScalingPoint:
    num_gpus: int
    given: Estimate
    """The planned config at this size."""
    best: Estimate
    """The best config the local search found at this size (never worse than `given`)."""

    @property
    def compute_bound_tokens_per_s_per_gpu(self) -> float:
        """The ceiling: tokens/s per GPU if no communication were exposed."""
        return self.given.tokens_per_gpu_step / self.given.prediction.compute_s


def scaling_gpu_counts(
    gpus_per_node: int, extra: int | None = None, counts: tuple[int, ...] = SCALING_GPUS
) -> list[int]:
    """`counts` that are whole nodes (or fit in one node), plus `extra` (the planned size)."""
    chosen = {n for n in counts if n <= gpus_per_node or n % gpus_per_node == 0}
    if extra is not None:
        chosen.add(extra)
    return sorted(chosen)


def scaling_curve(
    profile: ModelProfile,
    config: OverlapConfig,
    cluster: Cluster,
    counts: list[int],
    space: SearchSpace | None = None,
    start: OverlapConfig | None = None,
) -> list[ScalingPoint]:
    """Predict `config` at every size in `counts`, and refine the best config at each size
    starting from `config`, `start` (e.g. the best at the planned size) and the previous size's
    best. With `space` None no search runs and `best` is `given`."""
    points: list[ScalingPoint] = []
    previous: list[OverlapConfig] = []
    for n in counts:
        sized = cluster.with_gpus(n)
        starts = [config] + ([start] if start is not None else []) + previous
        if space is None:
            given = best = estimate(profile, config, sized)
        else:
            result = refine(profile, starts, sized, space)
            given, best = result.cache[config], result.best
            previous = [best.config]
        points.append(ScalingPoint(n, given, best))
    return points


def plot_scaling(points: list[ScalingPoint], path: Path, title: str) -> Path:
    """Two panels over the GPU count (log2): tokens/s per GPU (planned, best found, compute-bound
    ceiling) and the exposed-communication share of a step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpus = [p.num_gpus for p in points]
    fig, (ax_tps, ax_exp) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax_tps.plot(gpus, [p.given.tokens_per_s_per_gpu for p in points], "o-", label="planned config")
    ax_tps.plot(gpus, [p.best.tokens_per_s_per_gpu for p in points], "s--", label="best config found")
    ax_tps.plot(
        gpus, [p.compute_bound_tokens_per_s_per_gpu for p in points], ":", color="gray", label="compute-bound ceiling"
    )
    misfits = [p for p in points if not p.given.fits]
    if misfits:
        ax_tps.plot(
            [p.num_gpus for p in misfits],
            [p.given.tokens_per_s_per_gpu for p in misfits],
            "x",
            color="red",
            markersize=10,
            label="planned config does not fit in memory",
        )
    ax_tps.set_ylabel("tokens/s per GPU")
    ax_tps.set_ylim(bottom=0)
    ax_exp.plot(gpus, [100 * p.given.exposed_share for p in points], "o-", label="planned config")
    ax_exp.plot(gpus, [100 * p.best.exposed_share for p in points], "s--", label="best config found")
    ax_exp.set_ylabel("exposed communication, % of step")
    ax_exp.set_ylim(bottom=0)
    for ax in (ax_tps, ax_exp):
        ax.set_xscale("log", base=2)
        ax.set_xticks(gpus, [str(g) for g in gpus])
        ax.set_xlabel("GPUs (local batch fixed)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
