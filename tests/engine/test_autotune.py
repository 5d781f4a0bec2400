"""Self-tuning while training ([Note: autotune] in overlap/engine/autotune_policy.py).

The policy alone, on a synthetic step-time landscape (no ranks): it finds the fastest setting by
coordinate moves, keeps the defaults where they are best, respects the memory cap and the
hysteresis, and searches again when the step drifts. Then two ranks training: every rank takes
the same decisions, and the tuned run is bitwise the run with its final knobs set from the start.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace

import pytest
import torch
from helpers.harness import World
from helpers.models import batch, tiny_lm, train_steps

import overlap
from overlap.engine.autotune_policy import (
    HYSTERESIS,
    MAX_PREFETCH_DEPTH,
    RECHECK,
    WARMUP,
    Knobs,
    Measurement,
    Mode,
    Proposal,
    TunePolicy,
)
from overlap.step_model.online import TIE, StepModel, exposed
from overlap.step_model.tuning import TunerView

DEFAULTS = Knobs(
    prefetch_depth=1,
    max_inflight_allgather_bytes=None,
    reduce_scatter_bucket_bytes=0,
    keep_for_backward_bytes=128 << 20,
    max_reduce_inputs=1,
)


def drive(
    policy: TunePolicy, step_ms, steps: int = 400, memory=lambda k: 0, drift_at=None, device=lambda k: 0
) -> list[Knobs]:
    """Run `steps` training steps of a model whose step time under knobs k is `step_ms(k)`, whose
    library peak is `memory(k)` and whose device peak `device(k)` (a high-water mark: the most
    of any step so far): the policy's windows and decisions exactly as engine/autotune.py drives
    them (CPU: no lag)."""
    knobs_at: list[Knobs] = []
    high = [0]
    for t in range(steps):
        knobs_at.append(policy.current)
        high.append(max(high[-1], device(policy.current)))
        scale = 1.5 if drift_at is not None and t >= drift_at else 1.0

        def measured(first: int, end: int) -> list[Measurement]:
            return [
                Measurement(step_ms(knobs_at[s]) * scale, 0.0, 0.0, memory(knobs_at[s]), high[-1])
                for s in range(first, end)
            ]

        if policy.mode is Mode.SETTLED:
            window = policy.recheck_window(t)
            if window is not None:
                policy.recheck(t, measured(*window))
        else:
            first, end = policy.window()
            if t == end - 1:
                policy.decide(t, measured(first, end))
    return knobs_at


def signature(k: Knobs):
    return (
        k.prefetch_depth,
        k.max_inflight_allgather_bytes,
        k.reduce_scatter_bucket_bytes,
        min(k.keep_for_backward_bytes, 256 << 20),
        k.max_reduce_inputs,
    )


def landscape(k: Knobs) -> float:
    """Fastest at prefetch depth 3 and a 4 MiB bucket; the rest does not matter."""
    bucket_mib = max(k.reduce_scatter_bucket_bytes, 1 << 19) / (1 << 20)
    return 100.0 + 8.0 * abs(k.prefetch_depth - 3) + 6.0 * abs(math.log2(bucket_mib / 4))


def test_policy_finds_the_fastest_setting_and_settles():
    policy = TunePolicy(DEFAULTS, None, signature)
    knobs_at = drive(policy, landscape)
    assert policy.mode is Mode.SETTLED
    assert (policy.best.prefetch_depth, policy.best.reduce_scatter_bucket_bytes) == (3, 4 << 20), policy.best
    settled_at = next(d.step for d in policy.decisions if d.action == "settle")
    assert settled_at < 200, settled_at  # five kept moves and the failed ones, 10 steps each
    assert all(k == policy.best for k in knobs_at[settled_at + 1 :])  # no trial once settled
    assert all(d.reason for d in policy.decisions)  # each decision says why


def test_policy_keeps_the_defaults_where_they_are_best():
    policy = TunePolicy(DEFAULTS, None, signature)
    drive(policy, lambda k: 100.0 + 10 * (k != DEFAULTS))
    assert policy.mode is Mode.SETTLED and policy.current == DEFAULTS
    assert not [d for d in policy.decisions if d.action == "keep"]


def test_policy_hysteresis_ignores_small_gains():
    policy = TunePolicy(DEFAULTS, None, signature)
    gain = HYSTERESIS / 2
    drive(policy, lambda k: 100.0 * (1 - gain) if k.prefetch_depth == 2 else 100.0)
    assert policy.current == DEFAULTS


def test_policy_never_keeps_a_setting_over_the_memory_cap():
    """Unpriced moves: a trial whose measured peak rose over the cap is reverted, however fast."""
    policy = TunePolicy(DEFAULTS, 1000, signature)
    # deeper prefetch is faster but holds more than the cap
    drive(policy, lambda k: 100.0 - 10 * k.prefetch_depth, device=lambda k: 600 * k.prefetch_depth)
    assert policy.current.prefetch_depth == 1
    assert any("measured peak 1200 B over the cap 1000 B" in d.reason for d in policy.decisions), policy.decisions
    # the library's own account tells too: its peak above the baseline's, added to the measured one
    policy = TunePolicy(DEFAULTS, 1000, signature)
    drive(
        policy, lambda k: 100.0 - 10 * k.prefetch_depth, memory=lambda k: 300 * k.prefetch_depth, device=lambda k: 800
    )
    assert policy.current.prefetch_depth == 1
    assert any("library peak 600 B puts the measured peak at 1100 B" in d.reason for d in policy.decisions), (
        policy.decisions
    )


def test_policy_never_tries_a_move_priced_over_the_cap():
    """Priced moves: deeper prefetch costs 300 B a level over a baseline peak of 800 B under a
    cap of 1000 B: depth 2 is never run (refused, with the bytes), depth 0 (frees) is tried."""
    ran: set[int] = set()

    def step_ms(k: Knobs) -> float:
        ran.add(k.prefetch_depth)
        return 100.0 - 10 * k.prefetch_depth

    def price(a: Knobs, b: Knobs) -> int:
        return 300 * (b.prefetch_depth - a.prefetch_depth)

    policy = TunePolicy(DEFAULTS, 1000, signature, price=price)
    drive(policy, step_ms, device=lambda k: 800 + 300 * (k.prefetch_depth - 1))
    assert policy.mode is Mode.SETTLED and policy.best.prefetch_depth == 1
    assert ran == {0, 1}, ran  # depth 2 never ran a step
    refused = [d for d in policy.decisions if d.action == "refuse"]
    assert refused and refused[0].knob == "prefetch_depth" and refused[0].new == 2, policy.decisions
    assert "predicted peak 1100 B (baseline 800 B, +300 B) over the cap 1000 B" in refused[0].reason
    # the same cap with room: the move is tried and kept
    ran.clear()
    roomy = TunePolicy(DEFAULTS, 2000, signature, price=price)
    drive(roomy, step_ms, device=lambda k: 800 + 300 * (k.prefetch_depth - 1))
    assert 2 in ran and roomy.best.prefetch_depth > 1


def test_policy_searches_again_when_the_step_drifts():
    policy = TunePolicy(DEFAULTS, None, signature)
    drive(policy, landscape, steps=400, drift_at=250)
    retunes = [d for d in policy.decisions if d.action == "retune"]
    assert len(retunes) == 1 and retunes[0].step >= 250, policy.decisions
    assert policy.mode is Mode.SETTLED  # and settled again
    quiet = TunePolicy(DEFAULTS, None, signature)
    drive(quiet, landscape, steps=WARMUP + 4 * RECHECK)
    assert not [d for d in quiet.decisions if d.action == "retune"]  # no drift, no search


def test_policy_tries_the_models_joint_move_first():
    """Each knob alone is flat; only the two together are fast. Coordinate moves keep nothing,
    the model's joint proposal is measured first and kept."""
    joint = Knobs(3, None, 0, 128 << 20, 2)

    def step_ms(k: Knobs) -> float:
        return 80.0 if (k.prefetch_depth, k.max_reduce_inputs) == (3, 2) else 100.0

    calls = []

    def ranker(start: Knobs, measured: Measurement) -> list[Proposal]:
        calls.append((start, measured.step_ms))
        slower = Proposal(Knobs(0, None, 0, 128 << 20, 1), 120.0, 100.0, 0)  # predicted slower: never tried
        return [Proposal(joint, 90.0, 100.0, 0, " (test)"), slower]

    alone = TunePolicy(DEFAULTS, None, signature)
    drive(alone, step_ms)
    assert alone.best == DEFAULTS  # no single move helps
    policy = TunePolicy(DEFAULTS, None, signature, ranker=ranker)
    drive(policy, step_ms)
    assert policy.best == joint and policy.mode is Mode.SETTLED
    tries = [d for d in policy.decisions if d.action == "try"]
    assert tries[0].knob == "model" and "model predicts 90.00 ms vs 100.00 ms" in tries[0].reason, tries[0]
    assert not any(d.new == Knobs(0, None, 0, 128 << 20, 1) for d in tries)
    assert calls == [(DEFAULTS, 100.0)]  # once, at the baseline, with its score


def test_policy_model_proposal_over_the_memory_cap_is_not_tried():
    def ranker(start: Knobs, measured: Measurement) -> list[Proposal]:
        return [Proposal(Knobs(4, None, 0, 128 << 20, 1), 50.0, 100.0, extra_bytes=2000)]

    policy = TunePolicy(DEFAULTS, 1000, signature, ranker=ranker)
    drive(policy, lambda k: 100.0)
    assert not [d for d in policy.decisions if d.knob == "model" and d.action == "try"]
    assert [d.action for d in policy.decisions][:2] == ["baseline", "model"]


def test_policy_tries_the_deepest_prefetch_after_a_flat_step():
    """Depth 2 is as fast as 1 (within the hysteresis); the deepest is faster: one step at a
    time never gets there, the stride does."""
    policy = TunePolicy(DEFAULTS, None, signature)
    drive(policy, lambda k: 80.0 if k.prefetch_depth == MAX_PREFETCH_DEPTH else 100.0)
    assert policy.best.prefetch_depth == MAX_PREFETCH_DEPTH, policy.decisions


W1_LIKE = TunerView(
    (1 << 20,) + (12 << 20,) * 8, (1 << 20,) + (12 << 20,) * 8, tuple(range(9)), 0, True, "gloo", 2, 1, True
)


def test_online_model_fit_reproduces_the_baseline_and_recovers_its_scales():
    """A step made by the simulator itself (compute 0.5 s, links 4x the defaults'): the fit
    finds those scales back from the step and the exposed waits alone."""
    model = StepModel(W1_LIKE)
    made = model.predict(DEFAULTS, 0.5, 4.0)
    gather, reduce = exposed(made)
    fit = model.fit_to(DEFAULTS, Measurement(made.step_s * 1e3, gather * 1e3, reduce * 1e3, 0))
    assert math.isclose(fit.compute_s, 0.5, rel_tol=0.02), fit
    assert math.isclose(fit.link_scale, 4.0, rel_tol=0.02), fit
    assert math.isclose(fit.predicted_step_s, made.step_s, rel_tol=0.001), fit


def test_online_model_through_shared_memory_fits_the_pulls():
    """Through shared memory the exchange is host work (the pulls in the waits): the fitted
    scale multiplies it, and a step made at 3x the defaults' host work is found back."""
    view = replace(W1_LIKE, shared_memory=True)
    model = StepModel(view)
    assert model.base.shared_memory and model.base.host["none"].gather_wait_s > 0
    made = model.predict(DEFAULTS, 0.5, 3.0)
    assert made.step_s > model.predict(DEFAULTS, 0.5, 1.0).step_s  # host work, not a link, moves it
    gather, reduce = exposed(made)
    fit = model.fit_to(DEFAULTS, Measurement(made.step_s * 1e3, gather * 1e3, reduce * 1e3, 0))
    assert math.isclose(fit.compute_s, 0.5, rel_tol=0.02), fit
    assert math.isclose(fit.link_scale, 3.0, rel_tol=0.02), fit


def test_online_model_proposes_prefetch_behind_a_slow_link_and_nothing_where_comm_is_hidden():
    model = StepModel(W1_LIKE)
    slow = model.predict(DEFAULTS, 0.5, 20.0)  # comm far longer than compute: exposed
    proposals = model.propose(DEFAULTS, Measurement(slow.step_s * 1e3, *(x * 1e3 for x in exposed(slow)), 0))
    assert proposals and proposals[0].predicted_ms < proposals[0].baseline_predicted_ms * (1 - HYSTERESIS)
    assert proposals[0].knobs.prefetch_depth > DEFAULTS.prefetch_depth, proposals[0]
    fastest = min(p.predicted_ms for p in proposals)  # first, or tied with it and holding less
    assert proposals[0].predicted_ms <= fastest * (1 + TIE)
    assert proposals[0].extra_bytes <= min(p.extra_bytes for p in proposals if p.predicted_ms <= fastest * (1 + TIE))
    fast = model.predict(DEFAULTS, 0.5, 0.01)  # comm hidden under compute
    proposals = model.propose(DEFAULTS, Measurement(fast.step_s * 1e3, *(x * 1e3 for x in exposed(fast)), 0))
    assert not [p for p in proposals if p.predicted_ms < p.baseline_predicted_ms * (1 - HYSTERESIS)]


def test_online_model_starts_from_a_calibration_file_and_writes_what_it_fitted(tmp_path):
    from overlap.step_model.calibration import Calibration, default_world_calibration
    from overlap.step_model.cost import Link

    given = replace(default_world_calibration(4, "gloo", None), gather_link=Link("mine", 1e-4, 0.5))
    given.save(tmp_path / "given.json")
    view = replace(W1_LIKE, calibration=str(tmp_path / "given.json"), folder=str(tmp_path))
    model = StepModel(view)
    assert model.base.gather_link == Link("mine", 1e-4, 0.5) and model.base.num_ranks == 2
    made = model.predict(DEFAULTS, 0.5, 3.0)
    model.propose(DEFAULTS, Measurement(made.step_s * 1e3, *(x * 1e3 for x in exposed(made)), 0))
    fitted = Calibration.load(tmp_path / "calibration.json")  # what `overlap plan --calibration` reads
    assert fitted.source.startswith("fitted by autotune")
    assert math.isclose(fitted.gather_link.busbw_gbps, 0.5 / 3.0, rel_tol=0.02), fitted.gather_link
    nccl = StepModel(replace(view, backend="nccl", folder=None))  # a gloo file on an nccl run: the defaults
    assert nccl.base.backend == "nccl" and nccl.base.gather_link.name != "mine"
    with pytest.raises(ValueError, match="autotune_calibration"):
        overlap.OverlapConfig(autotune=True, autotune_calibration=3)


def test_a_model_that_fails_leaves_the_coordinate_moves(caplog, monkeypatch):
    """A model that raises must not stop training: the tuner logs it and proposes nothing."""
    from types import SimpleNamespace

    import overlap.engine.autotune as autotune

    class Broken(StepModel):
        def propose(self, start: Knobs, measured: Measurement) -> list[Proposal]:
            raise RuntimeError("no simulator here")

    schedule = SimpleNamespace(
        unit_bytes=[8], grad_bytes=[8], forward_order=(0,), root=None,
        config=SimpleNamespace(reshard_after_forward=True),
    )  # fmt: skip
    tuner = SimpleNamespace(
        schedule=schedule, device=torch.device("cpu"), num_ranks=2, num_replicas=1, tune_buckets=True,
        config=overlap.OverlapConfig(), folder=None, shared_memory=False,
    )  # fmt: skip
    monkeypatch.setattr(autotune, "StepModel", Broken)
    with caplog.at_level("WARNING", logger="overlap.autotune"):
        assert autotune.AutoTuner._propose(tuner, DEFAULTS, Measurement(100.0, 1.0, 1.0, 0)) == []
    assert "no simulator here" in caplog.text


STEPS = 60


def train(rank: int, world: int, autotune: bool, config_json: str | None = None, folder: str | None = None) -> dict:
    torch.manual_seed(0)
    if config_json:
        config = overlap.OverlapConfig(**json.loads(config_json))
    else:
        config = overlap.OverlapConfig(autotune=autotune, autotune_dir=folder)
    model = overlap.wrap(tiny_lm(), config=config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, params = [], []
    for step, loss in train_steps(model, opt, rank, STEPS):
        losses.append(loss)
        params.append([p.detach().to_local().clone() for p in model.parameters()])
        if step % 3 == 2:  # evaluation forwards between steps are not training steps
            with torch.no_grad():
                model(batch(model, rank, step))
    state = model._overlap_state
    out = {"losses": losses, "params": params}
    if state.autotuner is not None:
        out["decisions"] = [(d.step, d.action, d.knob, d.new) for d in state.autotuner.policy.decisions]
        out["knobs_seen"] = len({tuple(h.items())[5:] for h in state.autotuner.history})
        out["config"] = json.dumps(overlap.tuned_config(model).to_dict())
    return out


def test_tuned_run_is_bitwise_the_run_with_its_final_knobs(tmp_path, capsys):
    world = World(2)
    try:
        tuned = world.run(train, autotune=True, folder=str(tmp_path))
        assert tuned[0]["decisions"] == tuned[1]["decisions"]  # the same decision at the same step
        assert tuned[0]["decisions"][0][1] == "baseline"
        # the tools' model was fitted at the baseline and said what it predicts
        assert [a for _, a, _, _ in tuned[0]["decisions"]][1] == "model", tuned[0]["decisions"]
        assert tuned[0]["knobs_seen"] > 1  # it did move the knobs during the run
        final = json.loads(tuned[0]["config"])
        assert final["autotune"] is False
        plain = world.run(train, autotune=False, config_json=tuned[0]["config"])
        for rank in range(2):
            assert tuned[rank]["losses"] == plain[rank]["losses"], f"rank {rank}"
            for step, (a, b) in enumerate(zip(tuned[rank]["params"], plain[rank]["params"])):
                assert all(torch.equal(x, y) for x, y in zip(a, b)), f"rank {rank} step {step}"
    finally:
        world.close()
    # what it wrote: the config to reuse, and the decisions `overlap report` prints and draws
    assert overlap.OverlapConfig.load(tmp_path / "tuned_config.json") == overlap.OverlapConfig(**final)
    from overlap.step_model.calibration import Calibration

    assert Calibration.load(tmp_path / "calibration.json").source.startswith("fitted by autotune")
    from overlap.observe import report

    parser = argparse.ArgumentParser()
    report.add_arguments(parser)
    assert report.run(parser.parse_args([str(tmp_path), "--png", str(tmp_path / "r.png")])) == 0
    printed = capsys.readouterr().out
    assert "baseline" in printed and ("keep" in printed or "revert" in printed), printed
    assert (tmp_path / "r_autotune.png").stat().st_size > 10_000


def test_policy_reverts_a_trial_that_ran_out_of_memory_and_refuses_as_much_again():
    def price(a: Knobs, b: Knobs) -> int:
        return 300 * (b.prefetch_depth - a.prefetch_depth) + 100 * (b.max_reduce_inputs - a.max_reduce_inputs)

    policy = TunePolicy(DEFAULTS, 10_000, signature, price=price)
    baseline = [Measurement(100.0, 0.0, 0.0, 0, 800)] * 4
    policy.decide(WARMUP + 3, baseline)
    assert policy.current.prefetch_depth == 2 and policy.guarded  # the first move adds 300 B
    knobs = policy.fail_trial(WARMUP + 5, "out of memory on rank(s) [1] at step 8")
    assert policy.decisions[-2].action == "revert" and policy.decisions[-2].reason.startswith("out of memory")
    assert policy.memory_cap == 800 + 300 - 1  # what the failed move was predicted to reach, less a byte
    assert knobs.prefetch_depth != 2 and knobs == policy.current
    deeper = Knobs(3, None, 0, 128 << 20, 1)
    assert "over the cap 1099 B" in (policy._refused(DEFAULTS, deeper) or "")  # as much again: refused
    assert policy._refused(DEFAULTS, replace(DEFAULTS, max_reduce_inputs=2)) is None  # less: tried
