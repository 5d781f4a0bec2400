"""`overlap plan --tp/--pp`: the 3-D layout's links, the tensor-parallel collectives, the pipeline
bubble, the per-rank FSDP units, the CLI and its errors. Simulator only: no GPU, a few seconds."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from overlap.step_model.cost import LINKS, Link, Topology, ring_time_s
from overlap.tools.cli import main
from overlap.tools.plan.command import PLAN_DEFAULT_CONFIG, PlanConfig, plan
from overlap.tools.plan.estimate import Cluster, build_units, estimate
from overlap.tools.plan.layout import ParallelDims, bubble_fraction, make_layout, stage_profile, tp_cost
from overlap.tools.plan.models import gpu_spec, load_model

SLOW = Link("slow", 1e-5, 1.0)
FAST = Link("fast", 1e-6, 1000.0)


def _cluster(
    num_gpus: int, dims: ParallelDims, intra: Link = LINKS["nvlink4"], inter: Link = LINKS["ndr400"]
) -> Cluster:
    return Cluster(num_gpus=num_gpus, gpus_per_node=8, gpu=gpu_spec("h100-sxm"), intra=intra, inter=inter,
                   achieved_tflops=400.0, dims=dims)  # fmt: skip


def test_tp_divides_the_per_rank_gather_bytes():
    profile = load_model("llama-8b", 8192, 2, "selective")
    one = build_units(stage_profile(profile, ParallelDims()), PLAN_DEFAULT_CONFIG, _cluster(8, ParallelDims()))
    two = build_units(stage_profile(profile, ParallelDims(tp=2)), PLAN_DEFAULT_CONFIG, _cluster(8, ParallelDims()))
    assert len(one) == len(two)
    for a, b in zip(one, two):
        assert b.param_bytes == pytest.approx(a.param_bytes / 2, rel=1e-6)
        assert b.forward_s == pytest.approx(a.forward_s / 2)


def test_tp_collectives_are_timed_on_the_intra_node_link():
    profile = load_model("llama-8b", 8192, 2, "full")
    dims = ParallelDims(tp=8)
    layout = make_layout(dims, 64, 8, SLOW, FAST)
    cost = tp_cost(profile, dims, layout, num_layers=32, microbatch=2)
    size = 2 * 8192 * 4096 * 2  # micro-batch x seq x hidden x bf16
    per_block = 4 + 4 + 4  # forward, backward, full AC's recompute
    assert cost.num_collectives == 32 * per_block + 4
    assert cost.bytes_each == size
    assert cost.exposed_s == pytest.approx(
        cost.num_collectives * ring_time_s("all_gather", size, Topology(8, 8, SLOW, SLOW))
    )
    other = tp_cost(profile, dims, make_layout(dims, 64, 8, SLOW, SLOW), 32, 2)  # the inter link does not matter
    assert other.busy_s == pytest.approx(cost.busy_s)
    hidden = tp_cost(profile, replace(dims, async_tp=True), layout, 32, 2)
    assert hidden.exposed_s == 0.0 and hidden.busy_s == pytest.approx(cost.busy_s)


def test_bubble_fraction():
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(8, 8) == pytest.approx(7 / 15)
    assert bubble_fraction(8, 8, virtual_stages=2) == pytest.approx(3.5 / 11.5)
    assert bubble_fraction(1, 4) == 0.0


def test_dp_link_follows_the_layout():
    intra, inter = LINKS["nvlink4"], LINKS["ndr400"]
    spans = make_layout(ParallelDims(tp=8), 32, 8, intra, inter)  # dp 4, one rank per node
    assert (spans.dp, spans.dp_ranks_per_node, spans.dp_link.name, spans.dp_crosses_nodes) == (4, 1, "ndr400", True)
    fits = make_layout(ParallelDims(tp=2), 8, 8, intra, inter)  # tp x dp = 8 in one node
    assert (fits.dp, fits.dp_link.name, fits.pp_link.name) == (4, "nvlink4", "nvlink4")
    staged = make_layout(ParallelDims(tp=2, pp=2), 16, 8, intra, inter)  # dp 4 in a node; stages on two
    assert (staged.dp, staged.dp_link.name, staged.pp_link.name) == (4, "nvlink4", "ndr400")
    # the same step gets slower when only the inter-node link does, iff dp crosses nodes
    profile = load_model("llama-8b", 8192, 2, "selective")
    a = estimate(profile, PLAN_DEFAULT_CONFIG, _cluster(8, ParallelDims(tp=2), inter=FAST))
    b = estimate(profile, PLAN_DEFAULT_CONFIG, _cluster(8, ParallelDims(tp=2), inter=SLOW))
    assert a.step_s == b.step_s
    c = estimate(profile, PLAN_DEFAULT_CONFIG, _cluster(32, ParallelDims(tp=8), inter=FAST))
    d = estimate(profile, PLAN_DEFAULT_CONFIG, _cluster(32, ParallelDims(tp=8), inter=SLOW))
    assert d.step_s > 1.5 * c.step_s


def test_pipeline_step_assembles_microbatches_bubble_and_tail():
    profile = load_model("llama-8b", 8192, 8, "full")
    dims = ParallelDims(tp=2, pp=4, microbatches=8)
    e = estimate(profile, PLAN_DEFAULT_CONFIG, _cluster(64, dims))
    b = e.parallel
    assert b is not None and b.layers_per_rank == 8 and b.microbatch_size == 1 and b.layout.dp == 8
    assert b.bubble_s == pytest.approx(3 * b.microbatch_s)
    assert e.step_s == pytest.approx(11 * b.microbatch_s + b.reduce_tail_s + e.optimizer_s)
    assert e.step_s == pytest.approx(e.prediction.compute_s + e.prediction.exposed_s + b.bubble_s)
    assert e.tokens_per_gpu_step == pytest.approx(8 * 8192 / 8)  # local batch x seq / (tp x pp)
    interleaved = estimate(profile, PLAN_DEFAULT_CONFIG,
                           _cluster(64, replace(dims, pp_schedule="interleaved", virtual_stages=2)))  # fmt: skip
    assert interleaved.parallel is not None and interleaved.parallel.bubble_s < b.bubble_s
    assert interleaved.step_s < e.step_s
    assert e.prediction.num_reduce_scatters <= b.layers_per_rank + 1  # one reduction per step


def test_pipeline_stage_keeps_its_units_across_micro_batches_unless_capped():
    """[Note: pipeline step]: the stage's units stay gathered from the first micro-batch to the
    last when they fit `max_inflight_allgather_bytes` (no cap by default): one micro-batch's
    gathers per step, every unit held; under a cap they do not fit, every micro-batch gathers."""
    profile = load_model("llama-8b", 8192, 8, "full")
    dims = ParallelDims(tp=2, pp=4, microbatches=8)
    kept = estimate(profile, PLAN_DEFAULT_CONFIG, _cluster(64, dims))
    capped = estimate(profile, PLAN_DEFAULT_CONFIG.replace(max_inflight_allgather_bytes=1), _cluster(64, dims))
    per_microbatch = capped.prediction.num_allgathers // 8
    assert per_microbatch > 0 and capped.prediction.num_allgathers == 8 * per_microbatch
    assert kept.prediction.num_allgathers == per_microbatch
    assert kept.prediction.exposed_s < capped.prediction.exposed_s and kept.step_s < capped.step_s
    stage_units = kept.parallel.layers_per_rank  # one block per unit by default
    assert kept.prediction.peak_unsharded_units == stage_units > capped.prediction.peak_unsharded_units
    assert kept.memory.units_in_flight_bytes == kept.prediction.peak_unsharded_bytes
    for e in (kept, capped):
        assert e.step_s == pytest.approx(e.prediction.compute_s + e.prediction.exposed_s + e.parallel.bubble_s)


def test_cli_tp_pp_prints_and_writes_the_new_fields(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = main(["plan", "--model", "llama-8b", "--gpus", "64", "--tp", "8", "--pp", "4", "--microbatches", "4",
               "--local-batch", "4", "--no-search", "--json", str(out)])  # fmt: skip
    assert rc == 0
    text = capsys.readouterr().out
    assert "tp 8 x pp 4 x dp 2" in text and "bubble" in text and "tensor parallel" in text
    par = json.loads(out.read_text())["planned"]["parallel"]
    assert (par["tp"], par["pp"], par["dp"], par["microbatches"], par["layers_per_rank"]) == (8, 4, 2, 4, 8)
    assert (par["tp_link"], par["dp_link"], par["pp_link"]) == ("nvlink4", "ndr400", "ndr400")
    assert par["bubble_fraction"] == pytest.approx(3 / 7)
    assert par["tp_exposed_s"] > 0 and par["bubble_s"] > 0


def test_issue_command_runs_with_the_preset_batch_per_microbatch(tmp_path, capsys):
    """The issue's `overlap plan --model llama-70b --gpus 1024 --tp 8 --pp 4`: without
    --local-batch each of the (default --pp) micro-batches is the preset's per-GPU batch."""
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "llama-70b", "--gpus", "1024", "--tp", "8", "--pp", "4", "--no-search",
                 "--json", str(out)]) == 0  # fmt: skip
    assert "4 micro-batches of 1" in capsys.readouterr().out
    par = json.loads(out.read_text())["planned"]["parallel"]
    assert (par["dp"], par["microbatches"]) == (32, 4)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--gpus", "64", "--tp", "8", "--pp", "3"], "not divisible by --tp 8 x --pp 3"),
        (["--gpus", "64", "--tp", "16"], "must divide --gpus-per-node 8"),
        (["--gpus", "64", "--microbatches", "4"], "give --pp > 1"),
        (["--gpus", "64", "--pp", "2", "--pp-schedule", "interleaved"], "needs --virtual-stages >= 2"),
        (
            ["--gpus", "64", "--pp", "2", "--microbatches", "3", "--local-batch", "4"],
            "does not split into --microbatches 3",
        ),
    ],
)
def test_cli_errors(argv, message):
    with pytest.raises(SystemExit, match=message):
        main(["plan", "--model", "llama-8b", "--no-search", *argv])


def test_plan_scaling_skips_sizes_the_layout_cannot_take():
    result = plan(PlanConfig(model="llama-8b", num_gpus=64, tp=8, pp=2, search=False, scaling_gpus=(8, 16, 32, 128)))
    assert [p.num_gpus for p in result.scaling] == [16, 32, 64, 128]
