"""Parameters gathered once per pipeline step, not once per micro-batch: `set_reshard_after_backward`
([Note: retained across micro-batches] in overlap/engine/unit_state.py) under torch's pipeline
schedules and plain gradient accumulation.

Pipelines: a (pp=2, dp=2) mesh on four gloo ranks, two residual MLP blocks per stage, Schedule1F1B
with 4 micro-batches, 3 AdamW steps. Each stage is wrapped by overlap over dp (under
overlap.integrations.pipelining's PipelineStage) or by FSDP2 (per block, then the stage, under
torch's), with reshard_after_forward on (ZeRO-3) and off (torchtitan's setting under PP). The
all-gathers of each step are counted (overlap: the runtime's gathers; FSDP2: its foreach
all-gathers), and losses and parameters are compared with FSDP2's bitwise, as
tests/parity/test_compose.py does. The baseline "per micro-batch" is the same overlap stage with the
retention switched off: what every micro-batch gathered before.

Accumulation: three no_sync micro-batches and a synced one per step on two ranks, against DDP,
bitwise, with fewer gathers than without the setting; and mixed precision (bf16 parameters, fp32
reduction) bitwise equal to the same run without it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn as nn
from helpers.models import batch, loss_of, tiny_lm
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import overlap
from overlap.engine.schedule import Free, Gather, Retain, Schedule, ScheduleConfig, UnitState

DIM = 16
STEPS = 3
MICROBATCHES = 4
BLOCKS_PER_STAGE = 2
_PP_MESH: list[DeviceMesh] = []
KINDS = ("fsdp2", "overlap", "overlap, per micro-batch", "overlap, capped")


class _Stage(nn.Module):
    """Stage `stage` of two: two of four residual MLP blocks (each block one unit, no root)."""

    def __init__(self, stage: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        blocks = [nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.ReLU(), nn.Linear(4 * DIM, DIM)) for _ in range(4)]
        self.layers = nn.ModuleList(blocks[stage * BLOCKS_PER_STAGE : (stage + 1) * BLOCKS_PER_STAGE])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


def _count_overlap_gathers(module: nn.Module) -> list[int]:
    """Every all-gather the wrapped module's runtime issues, appended to the returned list."""
    runtime = module._overlap_state.runtime
    calls: list[int] = []
    original = runtime.gather
    runtime.gather = lambda *a, **k: (calls.append(1), original(*a, **k))[1]
    return calls


def _count_fsdp2_gathers() -> tuple[list[int], Callable[[], None]]:
    """Every FSDP2 all-gather (one per parameter group unshard), and how to stop counting."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group_module

    calls: list[int] = []
    original = group_module.foreach_all_gather
    group_module.foreach_all_gather = lambda *a, **k: (calls.append(1), original(*a, **k))[1]
    return calls, lambda: setattr(group_module, "foreach_all_gather", original)


def _stage(kind: str, reshard_after_forward: bool, mesh: DeviceMesh):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from overlap.integrations.pipelining import PipelineStage as OverlapPipelineStage

    index = mesh["pp"].get_local_rank()
    module = _Stage(index)
    if kind == "fsdp2":
        for block in module.layers:
            fully_shard(block, mesh=mesh["dp"], reshard_after_forward=reshard_after_forward)
        fully_shard(module, mesh=mesh["dp"], reshard_after_forward=reshard_after_forward)
        stage = PipelineStage(module, index, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    else:
        options = {"max_inflight_allgather_bytes": 1} if kind == "overlap, capped" else {}
        module = overlap.wrap(module, group=mesh["dp"], reshard_after_forward=reshard_after_forward, **options)
        if kind == "overlap, per micro-batch":  # the stage's call answered by nothing: units freed
            module.set_reshard_after_backward = lambda *a, **k: None
        stage = OverlapPipelineStage(module, index, 2, torch.device("cpu"), group=mesh["pp"].get_group())

    def loss_fn(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (y - target).pow(2).mean()

    return module, Schedule1F1B(stage, n_microbatches=MICROBATCHES, loss_fn=loss_fn)


def check_pipeline_gathers(rank: int, world_size: int) -> dict:
    """Per kind and reshard_after_forward: (losses, parameters, all-gathers per step)."""
    if not _PP_MESH:
        _PP_MESH.append(init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp")))
    mesh = _PP_MESH[0]
    first, last = mesh["pp"].get_local_rank() == 0, mesh["pp"].get_local_rank() == 1
    out: dict = {}
    for reshard_after_forward in (True, False):
        for kind in KINDS:
            module, pipe = _stage(kind, reshard_after_forward, mesh)
            if kind == "fsdp2":
                calls, restore = _count_fsdp2_gathers()
            else:
                calls, restore = _count_overlap_gathers(module), lambda: None
            opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
            losses: list[float] = []
            gathers: list[int] = []
            try:
                for step in range(STEPS):
                    gen = torch.Generator().manual_seed(10 * step + mesh["dp"].get_local_rank())
                    x, target = torch.randn(8, DIM, generator=gen), torch.randn(8, DIM, generator=gen)
                    step_losses: list[torch.Tensor] = []
                    calls.clear()
                    pipe.step(
                        *((x,) if first else ()), target=target if last else None, losses=step_losses if last else None
                    )
                    gathers.append(len(calls))
                    losses += [loss.item() for loss in step_losses]
                    opt.step()
                    opt.zero_grad()
            finally:
                restore()
            held = [] if kind == "fsdp2" else module._overlap_state.schedule.held_units()
            params = {n: p.full_tensor().detach() for n, p in module.named_parameters()}
            out[kind, reshard_after_forward] = (losses, params, gathers, held)
    return out


def test_1f1b_gathers_each_unit_once_per_step_and_matches_fsdp2_bitwise(world4):
    """After the first step (which also runs the stage's shape inference and the order checks),
    each unit is gathered once per step on both stages, with reshard_after_forward on or off:
    stage 0's warm-up forward keeps the units its first backward needs, that backward keeps them
    for the next micro-batches, the last backward frees them. FSDP2 on the same mesh gathers
    2 per step with reshard_after_forward off and 10 with it on (its post-forward reshards the
    units its backward kept); per micro-batch the same stage gathered each unit 4 times. A cap
    on unsharded bytes that the stage does not fit falls back to gathering per micro-batch."""
    results = world4.run(check_pipeline_gathers, timeout_s=300)
    for rank, result in enumerate(results):
        last_stage = rank >= 2
        for reshard_after_forward in (True, False):
            ref_losses, ref_params, fsdp2_gathers, _ = result["fsdp2", reshard_after_forward]
            where = (rank, reshard_after_forward)
            assert len(ref_losses) == (STEPS * MICROBATCHES if last_stage else 0), where
            for kind in KINDS[1:]:
                losses, params, _, held = result[kind, reshard_after_forward]
                assert losses == ref_losses, (where, kind, losses, ref_losses)
                assert all(torch.equal(params[n], ref_params[n]) for n in ref_params), (where, kind)
                assert not held, (where, kind, "units still unsharded after the step", held)
            gathers = result["overlap", reshard_after_forward][2]
            per_micro_batch = result["overlap, per micro-batch", reshard_after_forward][2]
            capped = result["overlap, capped", reshard_after_forward][2]
            assert gathers[1:] == [BLOCKS_PER_STAGE] * (STEPS - 1), (where, gathers)
            assert all(g <= f for g, f in zip(gathers[1:], fsdp2_gathers[1:])), (where, gathers, fsdp2_gathers)
            assert all(p >= MICROBATCHES * BLOCKS_PER_STAGE for p in per_micro_batch), (where, per_micro_batch)
            assert all(c >= MICROBATCHES * BLOCKS_PER_STAGE for c in capped), (where, capped)


# ---------------------------------------------------------------- the state machine


def _micro_batch(s: Schedule, n: int, sync: bool) -> list:
    """One forward through units 0..n-1 and its backward, as the hooks report them."""
    s.sync_grads = sync
    out = s.begin_forward()
    for u in range(n):
        out += s.pre_forward(u) + s.post_forward(u, True)
    out += s.end_forward(True)
    for u in reversed(range(n)):
        out += s.pre_backward(u) + s.post_backward(u)
    return out + s.end_backward()


def _schedule(num_units: int, max_inflight_allgather_bytes: int | None = None) -> Schedule:
    """A schedule of `num_units` units of 100 bytes, prefetch depth 1, no bucketing."""
    config = ScheduleConfig(prefetch_depth=1, max_inflight_allgather_bytes=max_inflight_allgather_bytes,
                            reshard_after_forward=True, reduce_scatter_bucket_bytes=0)  # fmt: skip
    return Schedule([100] * num_units, [100] * num_units, config)


def test_schedule_retains_units_until_a_backward_syncs():
    """[Note: retained across micro-batches]: the first micro-batch gathers, the next ones gather
    nothing and free nothing, the synced one frees and reduces every unit; under a cap the units
    do not fit, every micro-batch gathers and frees as before."""
    s = _schedule(3)
    _micro_batch(s, 3, sync=True)  # the order is recorded
    s.set_reshard_after_backward(False)
    first = _micro_batch(s, 3, sync=False)
    assert {a.unit for a in first if isinstance(a, Gather)} == {0, 1, 2}
    assert [a.unit for a in first if isinstance(a, Retain)] == [2, 1, 0]
    assert s.states == [UnitState.RETAINED] * 3 and s._parked == {0, 1, 2}
    second = _micro_batch(s, 3, sync=False)
    assert not [a for a in second if isinstance(a, (Gather, Free))], second
    last = _micro_batch(s, 3, sync=True)
    assert not [a for a in last if isinstance(a, Gather)]
    assert [a.unit for a in last if isinstance(a, Free)] == [2, 1, 0]
    assert s.states == [UnitState.SHARDED] * 3 and not s.held_units()
    capped = _schedule(3, max_inflight_allgather_bytes=250)
    capped.set_reshard_after_backward(False)
    for _ in range(2):
        actions = _micro_batch(capped, 3, sync=False)
        assert not [a for a in actions if isinstance(a, Retain)] and not capped.held_units()


def test_reshard_frees_retained_units():
    s = _schedule(2)
    s.set_reshard_after_backward(False)
    _micro_batch(s, 2, sync=False)
    assert s.held_units() == [0, 1]
    assert sorted(a.unit for a in s.reshard_all() if isinstance(a, Free)) == [0, 1]
    assert s.states == [UnitState.SHARDED] * 2 and not s.held_units() and not s._parked


# ---------------------------------------------------------------- plain gradient accumulation


def accumulate(rank: int, world_size: int, mixed: bool) -> dict:
    """Three no_sync micro-batches and a synced one, an AdamW step; three times. Overlap with
    set_reshard_after_backward(False) and without it (and, unless `mixed`, DDP): losses, the
    full parameters after each step, all-gathers per step, the units held after each no_sync
    backward and after the step."""
    base = tiny_lm()
    options = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32} if mixed else {}
    models: dict[str, nn.Module] = {
        "retained": overlap.wrap(copy.deepcopy(base), **options),
        "freed": overlap.wrap(copy.deepcopy(base), **options),
    }
    if not mixed:
        models["ddp"] = DDP(copy.deepcopy(base))
    models["retained"].set_reshard_after_backward(False)
    out: dict = {}
    for name, model in models.items():
        calls = _count_overlap_gathers(model) if name != "ddp" else []
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses, params, gathers, held = [], [], [], []
        for step in range(STEPS):
            calls.clear()
            for micro in range(MICROBATCHES):
                x = batch(base, rank, MICROBATCHES * step + micro)
                if micro < MICROBATCHES - 1:
                    with model.no_sync():
                        loss = loss_of(model(x))
                        loss.backward()
                    if name != "ddp":
                        held.append(_not_sharded(model))
                else:
                    loss = loss_of(model(x))
                    loss.backward()
                losses.append(loss.item())
            gathers.append(len(calls))
            opt.step()
            opt.zero_grad()
            if name != "ddp":
                held.append(_not_sharded(model))
                params.append(overlap.full_state_dict(model, rank0_only=False))
            else:
                params.append({k: v.detach().clone() for k, v in model.module.state_dict().items()})
        out[name] = (losses, params, gathers, held)
    out["num_units"] = models["retained"]._overlap_state.schedule.num_units
    return out


def _not_sharded(model: nn.Module) -> int:
    """The units (the root's included) whose unsharded parameters exist."""
    return sum(s is not UnitState.SHARDED for s in model._overlap_state.schedule.states)


def test_accumulation_keeps_units_and_equals_ddp_bitwise(world2):
    """Bitwise DDP's losses and parameters; each unit gathered in the first micro-batch only
    (the root's too), so fewer gathers than freeing after each backward; every unit retained
    after each no_sync backward, none held after the step."""
    for rank, result in enumerate(world2.run(accumulate, timeout_s=240, mixed=False)):
        ref_losses, ref_params, _, _ = result["ddp"]
        losses, params, gathers, held = result["retained"]
        freed_gathers = result["freed"][2]
        assert losses == ref_losses, (rank, losses, ref_losses)
        for ours, ref in zip(params, ref_params, strict=True):
            assert all(torch.equal(ours[n], ref[n]) for n in ref), rank
        assert all(g < f for g, f in zip(gathers, freed_gathers)), (rank, gathers, freed_gathers)
        num_units = result["num_units"]
        assert num_units > 1, rank
        # per step: three no_sync backwards (every unit retained), then the step (none held)
        assert held == ([num_units] * (MICROBATCHES - 1) + [0]) * STEPS, (rank, held)
        assert all(g <= 2 * num_units for g in gathers), (rank, gathers)


def test_accumulation_in_mixed_precision_is_unchanged_by_keeping_units(world2):
    """bf16 parameters, fp32 reduction: each no_sync backward still moves its gradients into the
    fp32 sums ([Note: no_sync in reduce_dtype] in overlap/engine/reduction.py), so keeping the
    units changes no bit and saves gathers."""
    for rank, result in enumerate(world2.run(accumulate, timeout_s=240, mixed=True)):
        losses, params, gathers, _ = result["retained"]
        ref_losses, ref_params, ref_gathers, _ = result["freed"]
        assert losses == ref_losses, (rank, losses, ref_losses)
        for ours, ref in zip(params, ref_params, strict=True):
            assert all(torch.equal(ours[n], ref[n]) for n in ref), rank
        assert all(g < f for g, f in zip(gathers, ref_gathers)), (rank, gathers, ref_gathers)
