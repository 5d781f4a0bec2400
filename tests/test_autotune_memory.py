"""Autotune's memory side ([Note: autotune memory] in overlap/engine/autotune_memory.py), on two
gloo ranks: the cap is read at the baseline, once the optimizer state exists; a move priced over
it is never run. The policy alone: tests/test_autotune.py.
"""

from __future__ import annotations

import pytest
import torch

import overlap
from harness import World
from models import batch, loss_of, tiny_lm
from overlap.engine.autotune_memory import MEMORY_FRACTION, device_total_bytes, measured_peak_bytes
from overlap.engine.autotune_policy import TRIAL, WARMUP

CPU = torch.device("cpu")
BASELINE_STEP = WARMUP + TRIAL - 1  # CPU: no lag
WIDE = {"dim": 512, "hidden": 2048}  # units of ~8 MiB: the optimizer state shows in the process's peak


@pytest.fixture(scope="module")
def world():
    w = World(2)
    yield w
    w.close()


def train(model: torch.nn.Module, rank: int, steps: int, after_step=None) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(steps):
        loss_of(model(batch(model, rank, step))).backward()
        opt.step()
        opt.zero_grad()
        if after_step is not None:
            after_step(step)


def cap_after_optimizer_state(rank: int, world: int) -> dict:
    model = overlap.wrap(tiny_lm(**WIDE), config=overlap.OverlapConfig(autotune=True))
    tuner = model._overlap_state.autotuner
    at_wrap = measured_peak_bytes(CPU)
    state_bytes = 2 * sum(p.to_local().numel() * 4 for p in model.parameters())  # AdamW: two moments
    peaks, budgets = [], []

    def after_step(step: int) -> None:
        peaks.append(measured_peak_bytes(CPU))
        budgets.append(tuner.memory)

    train(model, rank, BASELINE_STEP + 2, after_step)
    return {"at_wrap": at_wrap, "state_bytes": state_bytes, "peaks": peaks, "budgets": budgets}


def test_the_cap_is_read_after_the_optimizer_state_exists(world):
    out = world.run(cap_after_optimizer_state)
    for rank, got in enumerate(out):
        budgets = got["budgets"]
        assert all(b is None for b in budgets[:BASELINE_STEP]), f"rank {rank}: read before the baseline: {budgets}"
        budget = budgets[BASELINE_STEP]
        assert budget is not None and budget.step == BASELINE_STEP, f"rank {rank}: {budget}"
        # the first optimizer step's state is in the process's peak, and in the baseline's
        assert got["peaks"][0] - got["at_wrap"] >= got["state_bytes"] // 2, f"rank {rank}: {got}"
        assert budget.baseline_peak_bytes >= max(o["peaks"][0] for o in out), f"rank {rank}: {budget}"
        # both ranks on this host: each may use its half of MEMORY_FRACTION of the RAM
        assert budget.limit_bytes == int(MEMORY_FRACTION * device_total_bytes(CPU)) // 2
        assert budget.headroom_bytes == budget.limit_bytes - budget.baseline_peak_bytes
    assert out[0]["budgets"][BASELINE_STEP] == out[1]["budgets"][BASELINE_STEP]  # one budget for all


def moves_under_a_tight_cap(rank: int, world: int) -> dict:
    # first a run of the same size without autotune: the process's peak reaches its steady state
    plain = overlap.wrap(tiny_lm(**WIDE), config=overlap.OverlapConfig())
    train(plain, rank, 3)
    del plain
    unit_bytes = 4 * sum(p.numel() for p in tiny_lm(**WIDE).blocks[0].parameters())
    # then under a cap half a unit above that peak (the ranks' highest: one config for all): a
    # move that holds one more unit would cross it
    peak = torch.tensor([measured_peak_bytes(CPU)], dtype=torch.int64)
    torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
    cap = int(peak) + unit_bytes // 2
    config = overlap.OverlapConfig(autotune=True, autotune_memory_bytes=cap)
    model = overlap.wrap(tiny_lm(**WIDE), config=config)
    train(model, rank, 60)
    tuner = model._overlap_state.autotuner
    knobs_run = [(h["prefetch_depth"], h["max_reduce_inputs"], h["bucket_bytes"], h["keep_bytes"]) for h in tuner.history]
    return {
        "decisions": [(d.step, d.action, d.knob, str(d.new), d.reason) for d in tuner.policy.decisions],
        "start": knobs_run[0],
        "knobs_run": knobs_run,
        "limit": tuner.memory.limit_bytes,
        "cap": cap,
    }


def test_a_move_priced_over_the_cap_is_never_tried(world):
    out = world.run(moves_under_a_tight_cap)
    assert out[0]["decisions"] == out[1]["decisions"]
    got = out[0]
    assert got["limit"] == got["cap"] == out[1]["cap"]
    refused = [d for d in got["decisions"] if d[1] == "refuse"]
    assert refused, got["decisions"]
    assert all("over the cap" in d[4] for d in refused), refused
    assert {d[2] for d in refused} >= {"prefetch_depth", "max_reduce_inputs"}, refused
    depth, inputs, _, keep = got["start"]
    for row in got["knobs_run"]:  # no step ran with more held than the start: nothing grew
        assert row[0] <= depth and row[1] <= inputs and row[3] <= keep, (row, got["decisions"])
