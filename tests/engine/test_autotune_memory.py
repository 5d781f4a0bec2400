"""Autotune's memory side ([Note: autotune memory] in overlap/engine/autotune_memory.py), on two
gloo ranks: the cap is read at the baseline, once the optimizer state exists; a move priced over
it is never run. The policy alone: tests/engine/test_autotune.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers.harness import World
from helpers.models import batch, loss_of, tiny_lm

import overlap
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
        # decided between steps, at the forward after the baseline window's last step
        assert all(b is None for b in budgets[: BASELINE_STEP + 1]), f"rank {rank}: read before the baseline: {budgets}"
        budget = budgets[BASELINE_STEP + 1]
        assert budget is not None and budget.step == BASELINE_STEP, f"rank {rank}: {budget}"
        # the first optimizer step's state is in the process's peak, and in the baseline's
        assert got["peaks"][0] - got["at_wrap"] >= got["state_bytes"] // 2, f"rank {rank}: {got}"
        assert budget.baseline_peak_bytes >= max(o["peaks"][0] for o in out), f"rank {rank}: {budget}"
        # both ranks on this host: each may use its half of MEMORY_FRACTION of the RAM
        assert budget.limit_bytes == int(MEMORY_FRACTION * device_total_bytes(CPU)) // 2
        assert budget.headroom_bytes == budget.limit_bytes - budget.baseline_peak_bytes
    assert out[0]["budgets"][BASELINE_STEP + 1] == out[1]["budgets"][BASELINE_STEP + 1]  # one budget for all


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
    knobs_run = [
        (h["prefetch_depth"], h["max_reduce_inputs"], h["reduce_scatter_bucket_bytes"], h["keep_for_backward_bytes"])
        for h in tuner.history
    ]
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


def oom_in_a_trial(rank: int, world: int, where: str) -> dict:
    """Rank 1 runs out of memory (injected) in the second step of the first trial, in forward or
    in backward; its loop skips the step, as a loop that survives an out-of-memory error does."""
    model = overlap.wrap(tiny_lm(), config=overlap.OverlapConfig(autotune=True))
    tuner = model._overlap_state.autotuner
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    armed = {"step": None}

    def run_out(*_: object) -> None:
        if rank == 1 and armed["step"] is not None:
            armed["step"] = None
            raise torch.OutOfMemoryError("injected: out of memory in a trial step")

    block = model.blocks[1]
    if where == "forward":
        block.register_forward_pre_hook(run_out)
    else:

        def in_backward(module: torch.nn.Module, args: object, out: torch.Tensor) -> None:
            out.register_hook(lambda grad: run_out())  # raises in backward, in autograd's hook

        block.register_forward_hook(in_backward)
    raised, trial_steps, knobs = [], 0, []
    for step in range(30):
        trial_steps += tuner.policy.guarded  # a move that adds memory in force
        if tuner.policy.guarded and trial_steps == 2 and not raised:
            armed["step"] = step
        try:
            loss = loss_of(model(batch(model, rank, step)))
            knobs.append((step, str(tuner.policy.current)))  # what this step ran with
            loss.backward()
        except torch.OutOfMemoryError as e:
            raised.append((step, type(e).__name__, str(e)))
            opt.zero_grad()
            continue
        opt.step()
        opt.zero_grad()
    return {
        "raised": raised,
        "decisions": [(d.step, d.action, d.knob, str(d.new), d.reason) for d in tuner.policy.decisions],
        "knobs": knobs,
        "loss": loss.item(),
    }


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_an_out_of_memory_error_in_a_trial_is_reverted_on_every_rank(world, where):
    out = world.run(oom_in_a_trial, timeout_s=240, where=where)  # a hang names the rank
    ((step, kind, _),) = out[1]["raised"]
    assert kind == "OutOfMemoryError" and "injected" in out[1]["raised"][0][2], out[1]["raised"]
    # the other rank raised in the same step, a torch.OutOfMemoryError naming rank 1
    ((step0, kind0, message0),) = out[0]["raised"]
    assert (step0, kind0) == (step, "TrialOutOfMemoryError") and "rank(s) [1]" in message0, out[0]["raised"]
    assert out[0]["decisions"] == out[1]["decisions"]
    ran = [{s: k for s, k in o["knobs"] if s != step} for o in out]  # the steps that ran whole
    assert ran[0] == ran[1], (step, out[0]["knobs"], out[1]["knobs"])
    reverts = [d for d in out[0]["decisions"] if d[1] == "revert" and d[4].startswith("out of memory")]
    assert [d[0] for d in reverts] == [step], out[0]["decisions"]
    # reverted at once, and never run again: from the next step on, other knobs
    failed = dict(out[0]["knobs"])[step]
    assert all(k != failed for s, k in ran[0].items() if s > step), out[0]["knobs"]
    assert all(math.isfinite(o["loss"]) for o in out)  # and training went on, in step


def decisions_between_steps(rank: int, world: int, stream_ordered: bool) -> dict:
    """The exchange as a stream-ordered device has it (a fake: each read records when it came)."""
    import overlap.engine.autotune as autotune

    model = overlap.wrap(tiny_lm(), config=overlap.OverlapConfig(autotune=True))
    tuner = model._overlap_state.autotuner
    tuner.stream_ordered = stream_ordered
    reads, ranked = [], []
    real_later, real_ranker = autotune.gather_floats_later, tuner.policy.ranker

    def later(values, group, device, timeout=None):
        issued, gathered = tuner.steps, real_later(values, group, device, timeout)

        class Pending:
            def rows(self):
                reads.append((issued, tuner.steps, torch._C._current_graph_task_id()))
                return gathered.rows()

        return Pending()

    def ranker(knobs, measured):
        ranked.append(torch._C._current_graph_task_id())
        return real_ranker(knobs, measured)

    autotune.gather_floats_later, tuner.policy.ranker = later, ranker
    try:
        train(model, rank, 24)
    finally:
        autotune.gather_floats_later = real_later
    return {"reads": reads, "ranked": ranked, "budget_step": tuner.memory.step,
            "decisions": [(d.step, d.action, d.knob, str(d.new)) for d in tuner.policy.decisions]}  # fmt: skip


@pytest.mark.parametrize("stream_ordered", [False, True])
def test_decisions_are_taken_between_steps_and_read_a_step_late_on_a_stream_ordered_device(world, stream_ordered):
    out = world.run(decisions_between_steps, stream_ordered=stream_ordered)
    assert out[0]["decisions"] == out[1]["decisions"]
    for rank, got in enumerate(out):
        assert len(got["reads"]) >= 3, got["reads"]
        # read when one more training step ended (stream-ordered) or at the next forward (CPU) ...
        assert {read - issued for issued, read, _ in got["reads"]} == {int(stream_ordered)}, (
            f"rank {rank}: {got['reads']}"
        )
        # ... and outside the autograd callback, the simulator too
        assert {task for _, _, task in got["reads"]} == {-1} and got["ranked"] == [-1], f"rank {rank}: {got}"
        assert got["budget_step"] == BASELINE_STEP + int(stream_ordered)
