"""Pruning by the planner: profile the model once, predict every grid candidate's step, keep the
most promising ones for measurement.

[Note: codec bytes in the simulator]
A codec shrinks what a collective puts on the wire, not the buffers: each unit goes to the
simulator with its real unsharded bytes (the schedule's in-flight cap and buckets count those, as
the runtime does) and the codec's wire bytes (`UnitCost.gather_wire_bytes` / `reduce_wire_bytes`,
which set the ring times). On CPU the host work around each collective (encoding, decoding,
copies) comes from the calibration per codec path ([Note: one model] in
overlap/step_model/calibration.py; a codec it did not measure is charged as uncompressed); GPU
codec kernels are not charged. Either way every codec keeps its own best candidate through
pruning, and measurement, not the model, decides between codecs.

[Note: pruning]
Measurement is the expensive part, so the planner picks what gets measured: `num_keep` distinct
candidates (candidates with the same schedule signature are one), fastest predicted first. Where
predictions tie (within TIE_TOLERANCE, common when compute hides all communication in the model
but not on the machine), the next pick is the tied candidate that differs from every pick so far
in the most fields, so measurement sees a spread of settings rather than the first few in grid
order. Then the fastest candidate of every codec not yet represented joins, and the base config,
so the tuner never prefers something over the default without measuring the default.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from overlap.compression import make_grad_codec, make_param_codec
from overlap.config import OverlapConfig
from overlap.engine.units import group_units
from overlap.step_model.calibration import Calibration, codec_path, default_world_calibration
from overlap.step_model.cost import LINKS, Topology, UnitCost
from overlap.step_model.simulate import Prediction
from overlap.tools.tune.space import Codec, unit_numels
from overlap.tools.worlds.link import LinkSpec

StepFn = Callable[[nn.Module, torch.optim.Optimizer], Any]
OptimizerFn = Callable[[Any], torch.optim.Optimizer]

BACKWARD_FACTOR = 2.0
"""Backward compute per unit as a multiple of its forward when the profile could not time the
backward (2 N T vs 4 N T FLOPs of a dense unit); see `ModelProfile.backward_factor`."""
TIE_TOLERANCE = 0.03
"""Predictions closer than this (relative) are ties for pruning: the planner aims at 15% of a
measured step, so a few percent between two predictions say nothing about which
candidate is faster (see [Note: pruning])."""


@dataclass(frozen=True)
class UnitProfile:
    """One unit module of the unmerged model: its size and forward time on this device."""

    fqn: str
    numel: int
    forward_s: float


@dataclass(frozen=True)
class ModelProfile:
    """The plain (unwrapped) model's step on this rank's device, split by unit."""

    units: tuple[UnitProfile, ...]
    root_numel: int
    root_forward_s: float
    """Forward time outside every unit (embeddings, head); 0 when the root holds no parameters."""
    step_s: float
    """One whole local step: forward, backward, optimizer."""
    param_dtype: torch.dtype
    device_type: str = "cpu"
    backward_s: float | None = None
    """The whole backward: from the model output's gradient to the last parameter gradient
    accumulated. None (not measured): `BACKWARD_FACTOR` x forward."""

    @property
    def forward_s(self) -> float:
        return self.root_forward_s + sum(u.forward_s for u in self.units)

    @property
    def backward_factor(self) -> float:
        """Backward over forward, measured (each unit's backward is charged this multiple of its
        forward), else `BACKWARD_FACTOR`."""
        if self.backward_s is None or self.forward_s <= 0:
            return BACKWARD_FACTOR
        return self.backward_s / self.forward_s

    def optimizer_s(self, world_size: int) -> float:
        """What the step spends beyond forward and backward, on a 1/world_size shard."""
        return max(0.0, self.step_s - (1 + self.backward_factor) * self.forward_s) / world_size


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_model(
    model: nn.Module, step_fn: StepFn, optimizer_fn: OptimizerFn, unit_policy: Any, num_steps: int = 2
) -> ModelProfile:
    """Time `num_steps` local steps of the plain `model` (after one untimed step), forward per
    unit module by hooks, the whole backward from the output's gradient to the last gradient
    accumulated; medians over the steps. No communication: every rank profiles its own copy at
    the same time, so the cores are as busy as they will be in training."""
    numels = unit_numels(model, unit_policy)
    modules = dict(model.named_modules())
    device = next(model.parameters()).device
    fwd: dict[str, list[float]] = {fqn: [] for fqn in [*numels, ""]}
    started: dict[str, float] = {}
    handles = []

    def arm(fqn: str, module: nn.Module) -> None:
        def pre(_m: nn.Module, _args: Any) -> None:
            _sync(device)
            started[fqn] = time.perf_counter()

        def post(_m: nn.Module, _args: Any, _out: Any) -> None:
            _sync(device)
            fwd[fqn][-1] += time.perf_counter() - started.pop(fqn)

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))

    marks: dict[str, float] = {}

    def stamp(key: str) -> None:
        _sync(device)
        marks[key] = time.perf_counter()

    def on_output(_m: nn.Module, _args: Any, out: Any) -> None:  # backward begins at its gradient
        leaf = _first_grad_leaf(out)
        if leaf is not None:
            leaf.register_hook(lambda _g: None if "backward" in marks else stamp("backward"))

    arm("", model)
    for fqn in numels:
        arm(fqn, modules[fqn])
    handles.append(model.register_forward_hook(on_output))
    handles += [p.register_post_accumulate_grad_hook(lambda _p: stamp("accumulated"))
                for p in model.parameters() if p.requires_grad]  # fmt: skip
    opt = optimizer_fn(model.parameters())
    steps: list[float] = []
    backward: list[float] = []
    try:
        for i in range(num_steps + 1):
            for times in fwd.values():
                times.append(0.0)
            marks.clear()
            _sync(device)
            t0 = time.perf_counter()
            step_fn(model, opt)
            _sync(device)
            steps.append(time.perf_counter() - t0)
            if i == 0:  # warm-up: allocator, lazy init
                steps.pop()
                for times in fwd.values():
                    times.pop()
            elif "backward" in marks and "accumulated" in marks:
                backward.append(marks["accumulated"] - marks["backward"])
    finally:
        for h in handles:
            h.remove()

    def median(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2]

    units = tuple(UnitProfile(fqn, numels[fqn], median(fwd[fqn])) for fqn in numels)
    total_numel = sum(p.numel() for p in model.parameters())
    root_numel = total_numel - sum(numels.values())
    root_fwd = max(0.0, median(fwd[""]) - sum(u.forward_s for u in units))
    dtype = next(model.parameters()).dtype
    backward_s = median(backward) if len(backward) == num_steps else None
    return ModelProfile(units, root_numel, root_fwd, median(steps), dtype, device.type, backward_s)


def _first_grad_leaf(out: Any) -> torch.Tensor | None:
    """The first tensor of a model's output that will receive a gradient (the loss of a Hugging
    Face output comes first), or None."""
    from torch.utils._pytree import tree_leaves

    values = list(out.values()) if isinstance(out, dict) else out  # ModelOutput is a dict
    return next((t for t in tree_leaves(values) if isinstance(t, torch.Tensor) and t.requires_grad), None)


def topology_for(world_size: int, backend: str, link: str | None) -> Topology:
    """The planner's links for this world without a calibration file: those of
    `default_world_calibration`, and on NCCL two levels, NVLink within a node and NDR InfiniBand
    across nodes."""
    if link or "nccl" not in backend:
        return default_world_calibration(world_size, backend, LinkSpec.parse(link) if link else None).topology()
    per_node = torch.cuda.device_count() if torch.cuda.is_available() else world_size
    return Topology(world_size, max(1, per_node), LINKS["nvlink4"], LINKS["ndr400"])


def calibration_for(
    world_size: int, backend: str, link: str | None, calibration: Calibration | None, shared_memory: bool = False
) -> tuple[Calibration, Topology]:
    """The model `overlap tune` prunes with ([Note: one model] in overlap/step_model/calibration.py):
    `calibration` on this world's ranks, or the defaults for this world (`shared_memory`: its
    ranks exchange through shared memory)."""
    if calibration is not None:
        return calibration, calibration.topology(num_ranks=world_size, num_replicas=1)
    spec = LinkSpec.parse(link) if link else None
    defaults = default_world_calibration(world_size, backend, spec, shared_memory=shared_memory and spec is None)
    return defaults, topology_for(world_size, backend, link)


@dataclass(frozen=True)
class PlannedCandidate:
    """One grid candidate as the planner sees it."""

    index: int
    step_s: float
    peak_unsharded_bytes: int
    signature: Hashable
    """Equal for candidates the schedule cannot tell apart (same units, codec and actions)."""


def predict(
    profile: ModelProfile,
    config: OverlapConfig,
    world_size: int,
    calibration: Calibration,
    topo: Topology | None = None,
) -> tuple[Prediction, Hashable]:
    """The simulator's steady step for `config`, and a signature of the schedule it ran: units
    from the profile's compute, the calibration's host work and links (or `topo`'s)."""
    fqns = [u.fqn for u in profile.units]
    by_fqn = {u.fqn: u for u in profile.units}
    groups = group_units(fqns, {u.fqn: u.numel for u in profile.units}, config.min_unit_numel)
    gather_dtype = config.param_dtype or profile.param_dtype
    reduce_dtype = config.reduce_dtype or config.param_dtype or profile.param_dtype
    block = config.compression_block_size
    param_codec = make_param_codec(config.param_compression, block_size=block)
    grad_codec = make_grad_codec(config.grad_compression, block_size=block)
    path = codec_path(config.param_compression, config.grad_compression)

    def cost(name: str, numel: int, forward_s: float) -> UnitCost:
        return calibration.unit(
            name,
            numel * gather_dtype.itemsize,
            numel * reduce_dtype.itemsize,
            forward_s,
            profile.backward_factor * forward_s,
            codec=path,
            num_ranks=world_size,
            gather_wire_bytes=param_codec.wire_bytes(numel, gather_dtype),
            reduce_wire_bytes=grad_codec.wire_bytes(numel, reduce_dtype),
        )

    units: list[UnitCost] = []
    root = None
    if profile.root_numel:
        root = 0
        units.append(cost("root", profile.root_numel, profile.root_forward_s))
    for members in groups:
        numel = sum(by_fqn[m].numel for m in members)
        units.append(cost(members[0], numel, sum(by_fqn[m].forward_s for m in members)))
    prediction = calibration.predict(
        units, config, topology=topo, root=root, optimizer_s=profile.optimizer_s(world_size), record=True
    )
    codec = Codec(config.param_compression, config.grad_compression, config.error_feedback)
    signature = (tuple(groups), codec, tuple(prediction.events))
    return prediction, signature


def plan_grid(
    profile: ModelProfile,
    grid: Sequence[OverlapConfig],
    world_size: int,
    calibration: Calibration,
    topo: Topology | None = None,
) -> list[PlannedCandidate]:
    """Every grid candidate predicted, fastest first (ties: grid order)."""
    planned = []
    for i, config in enumerate(grid):
        prediction, signature = predict(profile, config, world_size, calibration, topo)
        planned.append(PlannedCandidate(i, prediction.step_s, prediction.peak_unsharded_bytes, signature))
    return sorted(planned, key=lambda c: (c.step_s, c.index))


def _distance(a: tuple[Hashable, ...], b: tuple[Hashable, ...]) -> int:
    return sum(x != y for x, y in zip(a, b, strict=True))


def prune(
    planned: Sequence[PlannedCandidate],
    num_keep: int,
    stratum: Callable[[int], Hashable],
    features: Callable[[int], tuple[Hashable, ...]],
    must_keep: int | None = None,
    max_unsharded_bytes: int | None = None,
) -> list[int]:
    """Grid indices to measure, in predicted order (see [Note: pruning]).

    `stratum(i)`: candidate i's codec; `features(i)`: its tuned field values; `must_keep`: the
    base config's index. Candidates over `max_unsharded_bytes` (predicted peak) are dropped first.
    """
    if num_keep < 1:
        raise ValueError(f"prune: num_keep must be >= 1, got {num_keep}")
    seen: set[Hashable] = set()
    remaining: list[PlannedCandidate] = []
    for c in planned:
        if max_unsharded_bytes is not None and c.peak_unsharded_bytes > max_unsharded_bytes:
            continue
        if c.signature not in seen:
            seen.add(c.signature)
            remaining.append(c)
    if not remaining:
        raise ValueError(
            f"overlap.tune: every candidate's predicted peak of unsharded parameters exceeds "
            f"max_unsharded_bytes={max_unsharded_bytes}; raise it or add smaller units / caps"
        )
    distinct = list(remaining)
    keep: list[int] = []
    while remaining and len(keep) < num_keep:
        lead = remaining[0].step_s
        front = [c for c in remaining if c.step_s <= lead * (1 + TIE_TOLERANCE)]

        def spread(c: PlannedCandidate) -> int:
            return min((_distance(features(c.index), features(k)) for k in keep), default=0)

        pick = max(front, key=lambda c: (spread(c), -c.step_s, -c.index))
        keep.append(pick.index)
        remaining.remove(pick)
    strata = {stratum(i) for i in keep}
    for c in remaining:
        if stratum(c.index) not in strata:
            strata.add(stratum(c.index))
            keep.append(c.index)
    base = next((c for c in planned if c.index == must_keep), None)
    if base is not None:  # the base config, or the distinct candidate with its schedule
        stand_in = next((c for c in distinct if c.signature == base.signature), None)
        if stand_in is not None and stand_in.index not in keep:
            keep.append(stand_in.index)
    order = {c.index: k for k, c in enumerate(planned)}
    return sorted(keep, key=lambda i: order[i])


def num_to_keep(grid_size: int, keep_fraction: float, max_candidates: int | None) -> int:
    """ceil(keep_fraction x grid), at least 2 (a decision needs a comparison), at most
    `max_candidates` and the grid."""
    n = max(2, math.ceil(keep_fraction * grid_size))
    if max_candidates is not None:
        n = min(n, max_candidates)
    return max(1, min(n, grid_size))
