"""The run model behind benchmarks/plan_published.py: rails, kernels, data-parallel modes, and
the published-runs data file (every row expressible, every source cited)."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from overlap.step_model import fp8 as fp8_model
from overlap.step_model.hardware import ACCELERATORS, NODES, ring_link
from overlap.step_model.kernels import STACKS, BlockShape, block_seconds
from overlap.tools.plan.run_spec import ModelShape, RunSpec
from overlap.tools.plan.run_step import _predict_rank, predict_run

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import plan_published as pp

LLAMA_8B = ModelShape(num_layers=32, hidden=4096, ffn_hidden=14336, num_heads=32, num_kv_heads=8, vocab_size=128256)


def test_ring_across_nodes_drives_one_rail_per_rank_of_the_node() -> None:
    gpu, node = ACCELERATORS["h100-sxm"], NODES["dgx-h100"]
    eight = ring_link(gpu, node, 64, 8)  # FSDP over 8 nodes, 8 ranks each: every rail
    one = ring_link(gpu, node, 8, 1)  # TP 8 inside the node: a data-parallel ring of 1 rank per node
    inside = ring_link(gpu, node, 8, 8)
    assert one.busbw_gbps == pytest.approx(node.rail_gbps())
    assert eight.busbw_gbps == pytest.approx(min(8 * node.rail_gbps(), inside.busbw_gbps))
    assert eight.busbw_gbps > 7 * one.busbw_gbps
    nvl72 = ring_link(ACCELERATORS["gb200"], NODES["gb200-nvl72"], 64, 4)  # 16 trays, one NVLink domain
    assert nvl72.name.startswith("nvlink")


def test_kernel_stack_precision_and_checkpointing_move_the_block_as_documented() -> None:
    shape, gpu = BlockShape(hidden=4096, ffn_hidden=14336, num_heads=32, num_kv_heads=8), ACCELERATORS["h100-sxm"]
    eager = block_seconds(shape, 16384, 8192, gpu, STACKS["torch-eager"])
    compiled = block_seconds(shape, 16384, 8192, gpu, STACKS["torch-compile"])
    fp8 = block_seconds(shape, 16384, 8192, gpu, STACKS["torch-compile"], fp8=True)
    full = block_seconds(shape, 16384, 8192, gpu, STACKS["torch-compile"], recompute="full")
    assert (
        compiled.gemm_forward_s == eager.gemm_forward_s
        and compiled.elementwise_forward_s < eager.elementwise_forward_s / 2
    )
    assert fp8.gemm_forward_s < 0.75 * compiled.gemm_forward_s
    assert full.recompute_s == pytest.approx(full.forward_s)
    a100 = block_seconds(shape, 16384, 8192, ACCELERATORS["a100-80gb"], STACKS["torch-compile"])
    assert 2.5 < a100.gemm_forward_s / compiled.gemm_forward_s < 3.5  # 312 x 0.80 vs 989 x 0.72


def test_pipeline_with_replicated_parameters_pays_no_per_microbatch_gathers() -> None:
    base = RunSpec(model=LLAMA_8B, gpu="h100-sxm", node="dgx-h100", num_gpus=64, seq_len=8192, global_batch=64,
                   micro_batch=1, tp=8, pp=4, dp_mode="zero1", stack="megatron-te")  # fmt: skip
    zero1 = predict_run(base)
    ddp = predict_run(replace(base, dp_mode="ddp"))
    assert zero1.pp_bubble_s > 0 and zero1.compute_s > 0
    assert ddp.optimizer_s > zero1.optimizer_s  # DDP keeps the whole optimizer on every rank
    slow = predict_run(replace(base, dp_overlap=False))
    assert slow.dp_exposed_s >= zero1.dp_exposed_s
    interleaved = predict_run(replace(base, schedule="interleaved", virtual_stages=2))
    assert interleaved.pp_bubble_s < zero1.pp_bubble_s


def test_fsdp_replays_the_schedule_and_more_microbatches_gather_more() -> None:
    spec = RunSpec(model=LLAMA_8B, gpu="h100-sxm", node="dgx-h100", num_gpus=16, seq_len=8192, global_batch=32,
                   micro_batch=2, ac="selective")  # fmt: skip
    one = predict_run(spec)
    accumulated = predict_run(replace(spec, global_batch=64))  # two micro-batches, each gathering and reducing
    assert accumulated.step_s == pytest.approx(2 * (one.step_s - one.optimizer_s) + one.optimizer_s, rel=1e-6)
    assert one.tokens_per_s_per_gpu > 0 and one.dp_exposed_s >= 0


def test_run_spec_refuses_what_it_cannot_lay_out() -> None:
    with pytest.raises(ValueError, match="tp 8 x pp 3"):
        RunSpec(
            model=LLAMA_8B,
            gpu="h100-sxm",
            node="dgx-h100",
            num_gpus=64,
            seq_len=8192,
            global_batch=64,
            micro_batch=1,
            tp=8,
            pp=3,
        )
    with pytest.raises(ValueError, match="unknown"):
        RunSpec(model=LLAMA_8B, gpu="tpu", node="dgx-h100", num_gpus=8, seq_len=8192, global_batch=8, micro_batch=1)


def test_every_published_row_is_expressible_and_cites_its_source() -> None:
    data, rows = pp.load_rows()
    assert len(rows) >= 100
    for row, spec, why in rows:
        assert spec is not None, (row["id"], why)
        source = data["sources"][row["source"]]
        assert source["url"].startswith("https://") and len(source["commit"]) == 40 and source["conversion"], row["id"]
        assert set(row["published"]) & {"tokens_per_s_per_gpu", "tflops_per_gpu", "mfu"}, row["id"]
    sources = {row["source"] for row, _, _ in rows}
    assert {"torchtitan-h100-2024", "torchtitan-perf-2024", "torchtitan-asynctp-2025", "torchtitan-h200-2025",
            "megatron-core-weak-2024", "megatron-2021"} <= sources  # fmt: skip
    assert any(row["held_out"] for row, _, _ in rows) and not all(row["held_out"] for row, _, _ in rows)


def test_published_conversions_match_the_sources_own_cross_checks() -> None:
    _, rows = pp.load_rows()
    by_id = {row["id"]: (row, spec) for row, spec, _ in rows}
    row, spec = by_id["mcore-weak-1.7b"]
    tokens = pp.published_tokens_per_s(row, spec.model, spec, row["source"])
    flops = 72 * 24 * 2048**2 + 12 * 24 * 2048 * 4096 + 6 * 131072 * 2048
    assert tokens == pytest.approx(408.8e12 / flops)
    assert tokens * flops / 989.4e12 == pytest.approx(0.41, abs=0.005)  # the table's MFU column
    row, spec = by_id["tt24-8b-8-fsdp"]
    assert pp.published_tokens_per_s(row, spec.model, spec, row["source"]) == 5762
    errors = pp.scale_out([
        dict(source="s", model="m", run={"num_gpus": 8, "global_batch": 8, "tp": 1}, predicted=110.0, published=100.0),
        dict(source="s", model="m", run={"num_gpus": 64, "global_batch": 64, "tp": 1}, predicted=99.0, published=100.0),
    ])  # fmt: skip
    assert errors == [pytest.approx(0.9 - 1)]


def test_zero3_under_a_pipeline_pays_a_gather_per_microbatch_that_a_kept_stage_does_not() -> None:
    """overlap's PipelineStage re-gathers every micro-batch (zero3); torchtitan keeps the stage
    gathered for the step (zero3-keep). With tensor parallel 8 each data-parallel ring has one
    rail, and 16 micro-batches of gathers dominate."""
    spec = RunSpec(model=LLAMA_8B, gpu="h100-sxm", node="dgx-h100", num_gpus=256, seq_len=4096, global_batch=128,
                   micro_batch=1, tp=8, pp=4, dp_mode="zero3-keep", stack="megatron-te", async_tp=True)  # fmt: skip
    kept = predict_run(spec)
    per_microbatch = predict_run(replace(spec, dp_mode="zero3"))
    assert spec.num_microbatches == 16
    assert per_microbatch.dp_exposed_s > 4 * kept.dp_exposed_s
    assert per_microbatch.step_s > 1.2 * kept.step_s


def test_overlap_plan_run_predicts_a_run_spec_file(tmp_path, capsys) -> None:
    from overlap.tools.cli import main

    spec = RunSpec(model=LLAMA_8B, gpu="a100-80gb", node="dgx-a100", num_gpus=64, seq_len=8192, global_batch=64,
                   micro_batch=1, ac="selective")  # fmt: skip
    path = tmp_path / "run.json"
    path.write_text(json.dumps(spec.to_dict()))
    assert RunSpec.from_dict(spec.to_dict()) == spec
    assert main(["plan", "--run", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"{predict_run(spec).tokens_per_s_per_gpu:,.0f} per GPU" in out and "zero3" in out
    with pytest.raises(SystemExit, match="--run"):
        main(["plan", "--run", str(tmp_path / "missing.json")])


def test_one_measured_size_calibrates_the_kernels_and_the_links_stay_the_models() -> None:
    from overlap.tools.plan.run_step import calibrate_compute

    small = RunSpec(model=LLAMA_8B, gpu="h100-sxm", node="dgx-h100", num_gpus=8, seq_len=8192, global_batch=16,
                    micro_batch=2, ac="selective")  # fmt: skip
    measured = 0.8 * predict_run(small).tokens_per_s_per_gpu
    scale = calibrate_compute(small, measured)
    assert predict_run(small, compute_scale=scale).tokens_per_s_per_gpu == pytest.approx(measured, rel=1e-3)
    big = replace(small, num_gpus=512, global_batch=1024)
    calibrated, default = predict_run(big, compute_scale=scale), predict_run(big)
    assert calibrated.compute_s == pytest.approx(scale * default.compute_s, rel=1e-6)
    assert 1.0 < scale < 1.4
    with pytest.raises(ValueError, match="compute_scale"):
        predict_run(small, compute_scale=0.0)


def test_megatron_2021_rows_carry_the_papers_own_launch_script() -> None:
    # examples/academic_paper_scripts/sc21/run_table_1.sh: micro-batch, interleaved stages and the
    # DDP implementation of each Table 1 row
    _, rows = pp.load_rows()
    specs = {row["id"]: spec for row, spec, _ in rows if row["source"] == "megatron-2021"}
    assert specs["meg21-1.7b"].micro_batch == 16 and specs["meg21-1.7b"].dp_overlap  # --DDP-impl torch
    assert specs["meg21-145b"].micro_batch == 2 and specs["meg21-145b"].virtual_stages == 2
    assert specs["meg21-530b"].virtual_stages == 3 and not specs["meg21-530b"].dp_overlap  # --DDP-impl local
    # its attention heads (NAH), not a 128-wide head assumed: 96-wide heads at 1.7B and 3.6B, 160-wide
    # at 530B and 1T (the materialized scores' traffic scales with the heads)
    nah = {"1.7b": 24, "3.6b": 32, "7.5b": 32, "18b": 48, "39b": 64, "76b": 80, "145b": 96, "310b": 128,
           "530b": 128, "1t": 160}  # fmt: skip
    assert {size: specs[f"meg21-{size}"].model.num_heads for size in nah} == nah
    one_f_one_b = predict_run(replace(specs["meg21-310b"], schedule="1f1b", virtual_stages=1))
    assert predict_run(specs["meg21-310b"]).pp_bubble_s < 0.6 * one_f_one_b.pp_bubble_s


def test_a_published_pipeline_layout_plans_every_rank_and_the_slowest_paces_the_step() -> None:
    base = RunSpec(model=LLAMA_8B, gpu="h100-sxm", node="dgx-h100", num_gpus=64, seq_len=8192, global_batch=64,
                   micro_batch=1, pp=4, schedule="interleaved", virtual_stages=2, dp_mode="zero1",
                   stack="megatron-te")  # fmt: skip
    (share,) = base.rank_shares()  # no layout: the bottleneck rank, the last layers, embedding and loss
    assert share.layers == tuple(range(24, 32)) and share.embedding and share.head
    spec = replace(base, pipeline_layout=(3, 4, 4, 4, 4, 4, 4, 5))
    shares = spec.rank_shares()
    assert [s.layers for s in shares] == [(0, 1, 2, 15, 16, 17, 18), (3, 4, 5, 6, 19, 20, 21, 22),
                                          (7, 8, 9, 10, 23, 24, 25, 26), (11, 12, 13, 14, 27, 28, 29, 30, 31)]  # fmt: skip
    assert [(s.embedding, s.head) for s in shares] == [(True, False), (False, False), (False, False), (False, True)]
    steps = [_predict_rank(spec, s, 1.0).step_s for s in shares]
    assert steps[-1] == max(steps) and predict_run(spec).step_s == steps[-1]
    assert steps[1] < predict_run(base).step_s  # eight layers without the root: less than the bound
    with pytest.raises(ValueError, match="pipeline_layout"):
        replace(base, pipeline_layout=(4,) * 7)
    with pytest.raises(ValueError, match="pipeline_layout"):
        replace(base, pipeline_layout=(4,) * 7 + (5,))


def test_fp8_cs_rows_run_current_scaling_and_only_mxfp8_rows_speak_of_block_scales(monkeypatch) -> None:
    # Megatron-Bridge's FP8-CS (and the 26.04.01 H100 "FP8" rows, whose configurations are
    # *_H100_FP8_CS_*) is Transformer Engine's Float8CurrentScaling
    _, rows = pp.load_rows()
    fp8 = [(row, spec) for row, spec, _ in rows if spec.stack.startswith("megatron-te") and spec.precision == "fp8"]
    assert len(fp8) >= 16
    for row, spec in fp8:
        where = row["published"]["where"]
        assert spec.fp8_recipe == ("mxfp8" if "MX" in where else "current"), row["id"]
        block_note = any("block" in note and "scal" in note for note in spec.notes)
        assert block_note == (spec.fp8_recipe == "mxfp8"), row["id"]
    cs = next(spec for row, spec in fp8 if row["id"] == "mbridge-25.11-h100-llama3-70b-64")
    step_s = predict_run(cs).step_s
    monkeypatch.setattr(fp8_model, "CURRENT_AMAX_BYTES", 0)
    no_amax_s = predict_run(cs).step_s
    assert step_s > no_amax_s  # the amax passes
    monkeypatch.setattr(fp8_model, "HOPPER_TRANSPOSE_BYTES", 0)
    assert no_amax_s > predict_run(cs).step_s  # Hopper's transposed copies


def test_context_parallel_ring_counts_the_layers_each_pipeline_rank_holds() -> None:
    # the ring's exposed K/V passes are paid per block the rank runs: under a pipeline layout,
    # the rank's own layers (and the loss rank's multi-token-prediction depths), not the even split
    base = RunSpec(model=LLAMA_8B, gpu="h100-sxm", node="dgx-h100", num_gpus=64, seq_len=65536, global_batch=8,
                   micro_batch=1, pp=4, cp=8, tp=2, schedule="interleaved", virtual_stages=2, dp_mode="zero1",
                   stack="torch-compile", ac="full")  # fmt: skip
    spec = replace(base, pipeline_layout=(3, 4, 4, 4, 4, 4, 4, 5), mtp_layers=1)
    shares = spec.rank_shares()
    per_layer = []
    for share in shares:
        exposed = _predict_rank(spec, share, 1.0).cp_exposed_s
        assert exposed > 0
        per_layer.append(exposed / len(spec.rank_layers(share)))
    assert per_layer == pytest.approx([per_layer[0]] * len(shares))
    assert [len(spec.rank_layers(s)) for s in shares] == [7, 8, 8, 10]  # 9 decoder layers and 1 MTP depth
    even = _predict_rank(base, base.rank_shares()[0], 1.0).cp_exposed_s
    assert even == pytest.approx(per_layer[0] * base.layers_per_rank)


def test_gpt_oss_rows_run_fused_attention_where_their_container_has_cudnn_9_13_1() -> None:
    """GPT-OSS's learnable-softmax attention runs in cuDNN FusedAttention from cuDNN 9.13.1 (else
    unfused); the 25.11 and 26.04 containers ship 9.13.1.26 and 9.20.0.48, so the rows run the
    stack's fused kernel, not the materialized-scores path."""
    _, rows = pp.load_rows()
    gpt_oss = [(row, spec) for row, spec, _ in rows if row["model"] == "gpt-oss-120b"]
    assert gpt_oss
    for row, spec in gpt_oss:
        assert spec is not None and STACKS[spec.stack].score_passes == 0, row["id"]
        cudnn = [n for n in spec.notes if "FusedAttention" in n]
        assert cudnn and ("9.13.1.26" in cudnn[0] or "9.20.0.48" in cudnn[0]), row["id"]
