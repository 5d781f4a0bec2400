"""The planner's expert parallelism: MoE shapes, the router, the dispatch/combine all-to-alls, the
grouped expert GEMMs at tokens-per-expert rows and the expert parameters' data-parallel group."""

from __future__ import annotations

import json
import math
import time
from dataclasses import replace
from pathlib import Path

import pytest

from overlap.step_model.cost import Link
from overlap.step_model.hardware import ACCELERATORS, HBM_SHARE
from overlap.step_model.kernels import TILE, gemm_seconds
from overlap.step_model.moe import (
    BLACKWELL_FP8_GROUPED_SHARE,
    FORCE_BALANCE_OPS,
    FORCE_BALANCE_PASSES,
    GROUPED_GEMM_TAIL_S,
    HOST_OPS,
    LAUNCH_S,
    TE_MODULE_S,
    TORCH_OP_S,
    MoeShape,
    all_to_all_s,
    expert_gemm_seconds,
    expert_rows,
    flex_copies,
    host_cpu,
    moe_host_seconds,
    moe_host_split,
    moe_seconds,
    synced_forward_s,
)
from overlap.step_model.moe_flex import flex_call_s
from overlap.step_model.moe_kernels import GRAPH_KERNEL_GAP_S, KERNEL_GAP_S, moe_kernel_gaps
from overlap.step_model.moe_skew import forced_balance_skew
from overlap.tools.plan.models import MODELS
from overlap.tools.plan.run_experts import moe_layer_s, moe_layer_seconds
from overlap.tools.plan.run_spec import ModelShape, RunSpec
from overlap.tools.plan.run_step import _microbatch_compute, _predict_rank, _stage_numel, predict_run

H100 = ACCELERATORS["h100-sxm"]
DATA = Path(__file__).resolve().parents[2] / "benchmarks" / "published_runs.json"
QWEN3_30B = ModelShape(
    **{k: v for k, v in json.loads(DATA.read_text())["models"]["qwen3-30b-a3b"].items() if k != "source"}
)


def qwen_run(**overrides) -> RunSpec:
    base = dict(model=QWEN3_30B, gpu="h100-sxm", node="dgx-h100", num_gpus=16, seq_len=4096, global_batch=256,
                micro_batch=1, ep=8, dp_mode="zero1", stack="megatron-te")  # fmt: skip
    return RunSpec(**{**base, **overrides})


@pytest.mark.parametrize(
    ("name", "total_b", "active_b"),
    [("deepseek-v3", 671, 37), ("mixtral-8x7b", 46.7, 12.9), ("qwen3-30b-a3b", 30.5, 3.3), ("llama4-scout", 109, 17)],
)
def test_moe_presets_match_their_published_sizes(name: str, total_b: float, active_b: float) -> None:
    shape = MODELS[name]
    active = (
        sum(shape.layer_matmul_numel(i) for i in range(shape.num_layers)) + shape.root_numel()
    )  # embeddings counted, as the model cards do
    assert shape.num_params() / 1e9 == pytest.approx(total_b, rel=0.02)
    assert active / 1e9 == pytest.approx(active_b, rel=0.03)


def test_router_gemm_and_top_k_are_priced() -> None:
    moe = QWEN3_30B.moe
    e = moe_seconds(moe, 2048, 4096, H100, ep=8)
    assert e.router_forward_s > gemm_seconds(4096, 2048, moe.num_experts, H100, fp8=False)
    more = moe_seconds(replace(moe, num_experts=256), 2048, 4096, H100, ep=8)
    assert more.router_forward_s > e.router_forward_s


def test_expert_rows_are_tokens_times_top_k_over_experts_per_rank() -> None:
    moe = QWEN3_30B.moe  # 128 experts, top 8
    assert expert_rows(4096, moe, 8, None) == 4096 * 8 * 8 / 128
    assert expert_rows(4096, moe, 8, 1.25) == 1.25 * 4096 * 8 * 8 / 128
    e1, e8 = moe_seconds(moe, 2048, 4096, H100, ep=1), moe_seconds(moe, 2048, 4096, H100, ep=8)
    # the same t·k rows per rank, in 8x fewer, 8x taller GEMMs: no slower
    assert e8.expert_forward_s <= e1.expert_forward_s


def test_grouped_gemm_pads_rows_to_tiles_and_streams_weights() -> None:
    rate = H100.bf16_tflops * 1e12 * H100.gemm_share
    assert expert_gemm_seconds(1, 2048, 768, H100, False) >= 2 * TILE * 2048 * 768 / rate
    weights = 2048 * 768 * 2 / (H100.hbm_tbps * 1e12 * HBM_SHARE)
    assert expert_gemm_seconds(16, 2048, 768, H100, False) >= weights
    big = 64 * TILE
    assert expert_gemm_seconds(big, 4096, 4096, H100, False) == pytest.approx(
        2 * big * 4096 * 4096 / rate + GROUPED_GEMM_TAIL_S
    )


@pytest.mark.parametrize(("groups", "rows", "tflops"), [(8, 4096, 627.903), (16, 2048, 553.945)])
def test_grouped_gemm_matches_transformer_engines_benchmark(groups: int, rows: int, tflops: float) -> None:
    """[Note: grouped GEMMs at small M]: TE 2.7's multi-stream grouped GEMM at Qwen3-30B-A3B's
    shapes on an H100 (https://github.com/NVIDIA/TransformerEngine/pull/2045), bf16: the FLOPs at
    the large-GEMM rate plus a tail per GEMM of the group reproduce both points."""
    seconds = groups * expert_gemm_seconds(rows, 2048, 768, H100, False)
    assert groups * 2 * rows * 2048 * 768 / seconds / 1e12 == pytest.approx(tflops, rel=0.03)


def test_blackwell_fp8_experts_run_at_the_measured_mxfp8_grouped_rate() -> None:
    """Megatron-Core's GB200 guide: MXFP8 grouped GEMM at 2,672 TFLOPS on K=7,168, N=2,048."""
    gb200 = ACCELERATORS["gb200"]
    rows = 64 * TILE
    seconds = (
        expert_gemm_seconds(rows, 7168, 2048, gb200, True)
        - GROUPED_GEMM_TAIL_S
        - rows * 7168 * 3 / (gb200.hbm_tbps * 1e12 * HBM_SHARE)
    )
    assert 2 * rows * 7168 * 2048 / seconds / 1e12 == pytest.approx(2672, rel=1e-6)
    assert gb200.fp8_gemm_share > BLACKWELL_FP8_GROUPED_SHARE
    # Hopper's fp8 experts keep the dense fp8 share
    hopper = expert_gemm_seconds(rows, 7168, 2048, H100, True) - GROUPED_GEMM_TAIL_S
    assert hopper == pytest.approx(
        2 * rows * 7168 * 2048 / (H100.fp8_tflops * 1e12 * H100.fp8_gemm_share)
        + rows * 7168 * 3 / (H100.hbm_tbps * 1e12 * HBM_SHARE)
    )


def test_alltoall_dispatcher_sorts_chunks_by_local_expert() -> None:
    moe = QWEN3_30B.moe
    alltoall = moe_seconds(moe, 2048, 4096, H100, ep=8)
    flex = moe_seconds(moe, 2048, 4096, H100, ep=8, dispatcher="flex")
    copy_pass = 4096 * 8 * 2048 * 2 * 2 / (H100.hbm_tbps * 1e12 * HBM_SHARE)  # read and write t·k·h
    assert alltoall.router_forward_s - flex.router_forward_s == pytest.approx(2 * copy_pass)
    unsplit = moe_seconds(moe, 2048, 4096, H100, ep=1)  # no expert parallelism: nothing to sort
    assert unsplit.router_forward_s == pytest.approx(
        moe_seconds(moe, 2048, 4096, H100, ep=1, dispatcher="flex").router_forward_s
    )
    one_expert = replace(moe, num_experts=8)  # one local expert per rank: nothing to sort
    assert moe_seconds(one_expert, 2048, 4096, H100, ep=8).router_forward_s == pytest.approx(
        moe_seconds(one_expert, 2048, 4096, H100, ep=8, dispatcher="flex").router_forward_s
    )


def test_all_to_all_splits_nvlink_and_rails() -> None:
    nvlink, rail = Link("nv", 1e-6, 400.0), Link("rail", 2e-6, 40.0)
    size = 1e9
    assert all_to_all_s(size, 1, 8, nvlink, rail) == 0.0
    assert all_to_all_s(size, 8, 8, nvlink, rail) == pytest.approx(1e-6 + 7 / 8 * size / 400e9)
    # 16 ranks over two nodes: 7/16 over NVLink, 8/16 over the rail at the same time
    assert all_to_all_s(size, 16, 8, nvlink, rail) == pytest.approx(
        2e-6 + max(7 / 16 * size / 400e9, 8 / 16 * size / 40e9)
    )


def test_dispatch_volume_is_tokens_top_k_hidden_bytes() -> None:
    e = moe_seconds(QWEN3_30B.moe, 2048, 4096, H100, ep=8)
    assert e.dispatch_bytes == 4096 * 8 * 2048 * 2


def test_run_prices_all_to_alls_per_moe_layer() -> None:
    one_node, two_nodes = predict_run(qwen_run(ep=8)), predict_run(qwen_run(ep=16))
    assert predict_run(qwen_run(ep=1)).ep_exposed_s == 0.0
    assert 0.0 < one_node.ep_exposed_s < two_nodes.ep_exposed_s  # the second node's tokens go over rails
    assert predict_run(qwen_run(ep=16, ep_overlap=True)).ep_exposed_s < two_nodes.ep_exposed_s


def test_expert_parameters_shard_over_the_expert_data_parallel_group() -> None:
    spec = qwen_run(ep=8)
    assert (spec.dp, spec.edp) == (16, 2)
    # the optimizer owns 1/dp of the dense parameters and 1/edp of its E/ep experts
    moe = QWEN3_30B.moe
    expert = QWEN3_30B.num_layers * moe.num_experts * moe.expert_numel(QWEN3_30B.hidden) / 8
    dense = QWEN3_30B.num_params() - QWEN3_30B.num_layers * moe.num_experts * moe.expert_numel(QWEN3_30B.hidden)
    owned = dense / 16 + expert / 2
    assert predict_run(spec).optimizer_s == pytest.approx(28 * owned / (H100.hbm_tbps * 1e12 * HBM_SHARE))
    exposed = predict_run(qwen_run(ep=8, dp_overlap=False)).dp_exposed_s
    assert exposed > predict_run(qwen_run(ep=16, dp_overlap=False)).dp_exposed_s  # ep 16: experts not sharded


def test_run_spec_refuses_what_the_layout_cannot_hold() -> None:
    with pytest.raises(ValueError, match="experts do not split"):
        qwen_run(ep=3, num_gpus=24, global_batch=240)
    with pytest.raises(ValueError, match="needs a model with MoE"):
        replace(qwen_run(ep=1), model=MODELS["llama-8b"], ep=2)
    with pytest.raises(ValueError, match="etp"):
        qwen_run(tp=2, etp=4, num_gpus=16, ep=8)
    with pytest.raises(ValueError, match="top_k"):
        MoeShape(num_experts=4, top_k=8, expert_ffn_hidden=64)


def test_run_spec_round_trips_its_moe_shape() -> None:
    spec = qwen_run()
    assert RunSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


def test_published_moe_rows_cite_their_configuration() -> None:
    data = json.loads(DATA.read_text())
    rows = [r for r in data["rows"] if "moe" in data["models"][r["model"]]]
    assert len(rows) >= 20 and any(r["held_out"] for r in rows) and not all(r["held_out"] for r in rows)
    for row in rows:
        assert row["run"]["ep"] > 1 and row["source"] in data["sources"]
        assert "EP" in row["published"]["where"]


def test_plan_on_a_moe_preset_is_fast() -> None:
    from overlap.tools.plan.models import load_model

    start = time.perf_counter()
    profile = load_model("deepseek-v3")
    assert math.isclose(profile.num_params / 1e9, 671, rel_tol=0.01)
    assert time.perf_counter() - start < 10


def test_moe_layers_wait_on_their_host_work() -> None:
    """[Note: MoE host work]: a MoE layer at a short micro-batch runs no faster than its host
    issues it; CUDA graphs of a part make it one launch; the host work grows with local experts."""
    moe = QWEN3_30B.moe
    forward, backward = moe_host_seconds(moe, 8, fp8=False)
    modules = sum(m for m, _ in HOST_OPS.values())
    ops = sum(o for _, o in HOST_OPS.values())
    assert backward == 2 * forward
    assert forward > modules * TE_MODULE_S["x86"] + ops * TORCH_OP_S["x86"]
    assert moe_host_seconds(moe, 1, fp8=False)[0] > forward > moe_host_seconds(moe, 8, fp8=False, graphed=("attn",))[0]
    assert moe_host_seconds(moe, 8, fp8=True)[0] > forward  # TE modules and each expert input's cast
    # a Grace host issues the same work ~2.7x slower than an x86 one
    # (https://github.com/NVIDIA/TransformerEngine/issues/2053)
    assert host_cpu("gb200") == "grace" and host_cpu("b200") == "x86"
    assert moe_host_seconds(moe, 8, fp8=False, host="grace")[0] == pytest.approx(forward * 37.08 / 13.48, rel=0.01)
    # the flex dispatcher's fused preprocessing: router and preprocess in 17 kernels, not 31 + 10
    flex = moe_host_seconds(moe, 8, fp8=False, dispatcher="flex")[0]
    assert forward - flex == pytest.approx((31 + 10 - 17) * TORCH_OP_S["x86"])
    graphed = ("moe_router", "moe_preprocess")
    assert moe_host_seconds(moe, 8, False, graphed)[0] == pytest.approx(
        moe_host_seconds(moe, 8, False, graphed, dispatcher="flex")[0]
    )
    # shared experts are two more TE Linears, inside the router's graph when it has one
    shared = replace(moe, shared_ffn_hidden=768)
    assert moe_host_seconds(shared, 8, False, graphed)[0] == moe_host_seconds(moe, 8, False, graphed)[0]
    assert moe_host_seconds(replace(moe, shared_ffn_hidden=768), 8, fp8=False)[0] > forward
    short = qwen_run(seq_len=128, ep_overlap=True)  # all-to-alls hidden: the host alone sets the pace
    moe_layers = QWEN3_30B.num_layers
    assert predict_run(short).compute_s == pytest.approx(
        short.num_microbatches * (moe_layers * (forward + backward)) + _head_s(short), rel=0.02
    )
    graphed = predict_run(replace(short, cuda_graph_scope=("attn", "moe_router", "moe_preprocess")))
    assert graphed.compute_s < predict_run(short).compute_s
    # a long micro-batch's GPU work exceeds its host's: no change
    long = qwen_run(seq_len=8192)
    assert predict_run(long).compute_s == predict_run(replace(long, cuda_graph_scope=("attn",))).compute_s


def _head_s(spec: RunSpec) -> float:
    from overlap.step_model.kernels import head_seconds

    f, b = head_seconds(spec.micro_batch * spec.seq_len, QWEN3_30B.hidden, QWEN3_30B.vocab_size, H100, 1)
    return spec.num_microbatches * (f + b)


def test_flex_dispatch_sends_a_token_once_per_rank_and_node() -> None:
    """[Note: flex dispatch]: DeepSeek-V3 at EP 32 over four 8-GPU nodes, group-limited to 4 of
    its 8 expert groups (two per node): a token crosses the rails to 3 x (1 - C(6,4)/C(8,4))
    nodes, where the alltoall dispatcher sends 8 x 24/32 = 6 copies."""
    ds = MODELS["deepseek-v3"].moe
    intra, inter = flex_copies(ds, 32, 8)
    assert inter == pytest.approx(3 * (1 - math.comb(6, 4) / math.comb(8, 4)))
    ungrouped = flex_copies(replace(ds, groups=1, group_topk=1), 32, 8)[1]
    assert inter < ungrouped < 6
    # one NVLink domain: once per other rank hit, fewer than k copies
    intra, inter = flex_copies(QWEN3_30B.moe, 8, 8)
    assert inter == 0.0 and intra == pytest.approx(7 / 8 * 8 * (1 - math.comb(112, 8) / math.comb(128, 8)))
    assert intra < 8 * 7 / 8
    spec = RunSpec(model=ModelShape(**{k: v for k, v in json.loads(DATA.read_text())["models"]["deepseek-v3"].items()
                                       if k != "source"}), gpu="b200", node="dgx-b200", num_gpus=256, seq_len=4096,
                   global_batch=4096, micro_batch=1, pp=8, virtual_stages=2, schedule="interleaved", ep=32,
                   dp_mode="zero1", precision="fp8", stack="megatron-te")  # fmt: skip
    assert predict_run(replace(spec, dispatcher="flex")).ep_exposed_s < predict_run(spec).ep_exposed_s / 2
    with pytest.raises(ValueError, match="dispatcher"):
        replace(spec, dispatcher="deepep")


def test_recompute_modules_add_their_forwards_to_the_backward() -> None:
    """[Note: recomputed modules]: Megatron-Core's per-module recomputation, each priced."""
    base = predict_run(qwen_run()).compute_s
    for modules in (("moe_act",), ("layernorm",), ("core_attn",), ("moe",)):
        assert predict_run(qwen_run(recompute_modules=modules)).compute_s > base, modules
    assert predict_run(qwen_run(recompute_modules=("mla_up_proj",))).compute_s == base  # no MLA in Qwen3
    assert predict_run(qwen_run(recompute_modules=("moe",))).ep_exposed_s > predict_run(qwen_run()).ep_exposed_s
    with pytest.raises(ValueError, match="recompute_modules"):
        qwen_run(recompute_modules=("attention",))


def test_run_spec_round_trips_its_dispatcher_graphs_and_recompute() -> None:
    spec = qwen_run(dispatcher="flex", cuda_graph_scope=["moe_router"], recompute_modules=["moe_act"])
    assert spec.cuda_graph_scope == ("moe_router",)
    assert RunSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


def test_published_moe_rows_carry_their_recipe_at_the_container_release() -> None:
    rows = [r for r in json.loads(DATA.read_text())["rows"] if r["run"].get("ep", 1) > 1]
    for row in rows:
        assert row["run"]["dispatcher"] in ("alltoall", "flex")
        assert any("Megatron-Bridge v0." in note for note in row["run"]["notes"]), row["id"]


def test_flex_calls_run_at_the_bandwidths_their_kernels_publish() -> None:
    """[Note: flex kernels' achieved bandwidth]: HybridEP on one GB200 NVLink domain receives a
    copy per destination rank (its own included) at its published 523.48 / 521.55 GB/s for 16
    ranks at the 32 SMs Megatron-Bridge's performance runs give it; across DGX nodes the per-node
    copies the published InfiniBand rate counts (its own node's included) go at that rate."""
    nvlink = Link("nvlink", 0.0, 720.0, "")
    rail = Link("rail", 0.0, 45.0, "")
    token_bytes = 4096 * 2048 * 2.0
    moe = QWEN3_30B.moe
    dispatch, combine = flex_call_s(token_bytes, moe, 16, 72, backend="hybridep", gpu="gb200", nvlink_max_gbps=900.0,
                                    rail_gbit=400.0, nvlink=nvlink, rail=rail)  # fmt: skip
    received = 16 * (1 - math.comb(120, 8) / math.comb(128, 8)) * token_bytes
    assert dispatch == pytest.approx(received / 523.48e9) and combine == pytest.approx(received / 521.55e9)
    # a group larger than the table's largest takes the largest's figure
    assert flex_call_s(token_bytes, moe, 64, 72, backend="hybridep", gpu="gb200", nvlink_max_gbps=900.0,
                       rail_gbit=400.0, nvlink=nvlink, rail=rail)[0] > 0  # fmt: skip
    inter = flex_copies(moe, 16, 8)[1]
    dispatch, combine = flex_call_s(token_bytes, moe, 16, 8, backend="deepep", gpu="h100-sxm", nvlink_max_gbps=450.0,
                                    rail_gbit=400.0, nvlink=nvlink, rail=rail)  # fmt: skip
    # its RDMA figure counts the copy to the sender's own node too: on 2 nodes twice the remote ones
    assert dispatch == pytest.approx(2 * inter * token_bytes / 43e9)
    # no published figure for H100's NVLink under HybridEP: the link model
    intra = flex_copies(moe, 8, 8)[0]
    dispatch, _ = flex_call_s(token_bytes, moe, 8, 8, backend="hybridep", gpu="h100-sxm", nvlink_max_gbps=450.0,
                              rail_gbit=400.0, nvlink=nvlink, rail=rail)  # fmt: skip
    assert dispatch == pytest.approx(intra * token_bytes / 720e9)
    with pytest.raises(ValueError, match="flex_backend"):
        qwen_run(dispatcher="flex", flex_backend="nccl")


def test_rows_the_source_documents_as_regressions_say_so_first() -> None:
    """The three MoE rows Megatron-Bridge documents as regressions stay counted; their first note
    (what plan_published.py prints) quotes the source."""
    rows = {r["id"]: r for r in json.loads(DATA.read_text())["rows"]}
    for row_id, url in (("mbridge-25.11-b200-qwen3-30b-a3b-8", "issues/1998"),
                        ("mbridge-25.11-h100-qwen3-30b-a3b-16", "issues/1998"),
                        ("mbridge-25.11-b200-qwen3-235b-a22b-64", "pull/1760")):  # fmt: skip
        first = rows[row_id]["run"]["notes"][0]
        assert first.startswith("regression documented by the source") and url in first, row_id


def test_the_dispatchers_sync_splits_the_layer_at_the_token_counts() -> None:
    """[Note: the dispatcher's sync]: after the sync the GPU runs no faster than the host issues,
    so a host-bound post-sync part is not covered by a GPU-bound pre-sync part."""
    launch = LAUNCH_S["x86"]
    # GPU-bound on both sides: the GPU's work plus the launch after the drained queue
    assert synced_forward_s(1e-3, 1e-3, 1e-4, 1e-4, 0.0, "x86") == pytest.approx(2e-3 + launch)
    # host-bound after the sync: the plain max would give 1.5 ms
    assert synced_forward_s(1e-3, 0.2e-3, 0.1e-3, 0.5e-3, 0.0, "x86") == pytest.approx(1.5e-3 + launch)
    # the host issues while exposed all-to-alls run
    assert synced_forward_s(1e-3, 0.2e-3, 0.1e-3, 0.5e-3, 0.4e-3, "x86") == pytest.approx(1.2e-3 + launch)
    pre, post = moe_host_split(QWEN3_30B.moe, 8, fp8=False)
    assert pre + post == pytest.approx(moe_host_seconds(QWEN3_30B.moe, 8, fp8=False)[0])
    assert moe_host_split(QWEN3_30B.moe, 1, fp8=False)[1] > post  # more local experts, more launches after
    assert moe_host_split(QWEN3_30B.moe, 1, fp8=False)[0] == pre
    # dropless pays the launch after the sync; padded to a capacity factor it does not sync
    dropless, padded = predict_run(qwen_run()), predict_run(qwen_run(capacity_factor=1.0))
    assert dropless.compute_s > padded.compute_s


def test_deepep_on_blackwell_runs_at_its_measured_bandwidth_at_megatrons_sm_count() -> None:
    """DeepEP on one B200 node at Megatron-Core's 20 SMs: halfway between HybridEP's page's 16-
    and 24-SM measurements of it (348 / 302 and 494 / 420 GB/s)."""
    nvlink = Link("nvlink", 0.0, 720.0, "")
    token_bytes = 4096 * 2048 * 2.0
    received = 8 * (1 - math.comb(112, 8) / math.comb(128, 8)) * token_bytes
    dispatch, combine = flex_call_s(token_bytes, QWEN3_30B.moe, 8, 8, backend="deepep", gpu="b200",
                                    nvlink_max_gbps=900.0, rail_gbit=400.0, nvlink=nvlink, rail=nvlink)  # fmt: skip
    assert dispatch == pytest.approx(received / 421e9) and combine == pytest.approx(received / 361e9)


def test_a_flex_run_names_its_backend() -> None:
    lacks = " ".join(predict_run(qwen_run(dispatcher="flex", flex_backend="hybridep")).lacks)
    assert "flex dispatch and combine (hybridep at its published bandwidths)" in lacks
    assert "alltoall dispatch and combine" in " ".join(predict_run(qwen_run()).lacks)


def test_clamped_expert_activation_pays_megatron_cores_eager_clamp_and_cat() -> None:
    # weighted_bias_quick_geglu_impl clamps each half of the GLU input and concatenates them
    # outside the fused kernel: 8 passes over rows x f forward, 10 backward
    gpu = ACCELERATORS["h100-sxm"]
    plain = MoeShape(num_experts=128, top_k=4, expert_ffn_hidden=2880)
    clamped = replace(plain, activation_clamp=True)
    a, b = (moe_seconds(m, 2880, 8192, gpu, ep=8) for m in (plain, clamped))
    rows_f = 16 * expert_rows(8192, plain, 8, None) * 2880  # local experts x rows x f
    hbm = gpu.hbm_tbps * 1e12 * HBM_SHARE
    assert b.act_forward_s - a.act_forward_s == pytest.approx(rows_f * 8 * 2 / hbm, rel=1e-9)
    assert b.backward_s - a.backward_s == pytest.approx(rows_f * 10 * 2 / hbm, rel=1e-9)


def test_all_to_all_overlap_hides_nothing_behind_a_grace_host() -> None:
    # Megatron-Core's GB200 guide: the 1F1B all-to-all overlap's stage syncs aggravate the host
    # overhead, "so the overall benefit is negative on the GB200"
    x86 = [predict_run(qwen_run(ep=8, gpu="b200", node="dgx-b200", ep_overlap=o)) for o in (False, True)]
    grace = [predict_run(qwen_run(ep=8, gpu="gb200", node="gb200-nvl72", ep_overlap=o)) for o in (False, True)]
    assert x86[1].ep_exposed_s < x86[0].ep_exposed_s
    assert grace[1].step_s == grace[0].step_s


DEEPSEEK_V3 = ModelShape(
    **{k: v for k, v in json.loads(DATA.read_text())["models"]["deepseek-v3"].items() if k != "source"}
)


def test_multi_token_prediction_runs_a_last_layer_and_an_output_layer_more_on_the_loss_rank() -> None:
    spec = RunSpec(model=DEEPSEEK_V3, gpu="b200", node="dgx-b200", num_gpus=256, seq_len=4096, global_batch=2048,
                   micro_batch=1, pp=16, ep=8, dp_mode="zero1", stack="megatron-te", precision="fp8",
                   pipeline_layout=(4,) * 15 + (1,), mtp_layers=1)  # fmt: skip
    without = replace(spec, mtp_layers=0)
    first, last = spec.rank_shares()[1], spec.rank_shares()[-1]
    assert last.head and spec.rank_layers(last) == (60, 60) and without.rank_layers(last) == (60,)
    blocks, head = _microbatch_compute(spec, last)
    blocks0, head0 = _microbatch_compute(without, last)
    assert blocks == blocks0 + blocks0[-1:]  # the depth's transformer layer is the decoder's last (MoE) layer
    gpu, h, vocab, tokens = ACCELERATORS["b200"], DEEPSEEK_V3.hidden, DEEPSEEK_V3.vocab_size, 4096
    # a second pass through the shared output layer (bf16) and eh_proj (2h -> h, fp8), forward
    floor = 2 * tokens * h * vocab / (gpu.bf16_tflops * 1e12) + 2 * tokens * 2 * h * h / (gpu.fp8_tflops * 1e12)
    assert head[0] - head0[0] > floor and head[1] - head0[1] > 2 * floor
    assert head[0] - head0[0] < 1.5 * head0[0] + 2 * floor
    # eh_proj, three norms and the copy of the embedding the loss rank builds
    assert _stage_numel(spec, last)[2] - _stage_numel(without, last)[2] == 2 * h * h + 3 * h + vocab * h
    # the other ranks do not see it
    assert _predict_rank(spec, first, 1.0).step_s == _predict_rank(without, first, 1.0).step_s
    assert _predict_rank(spec, last, 1.0).step_s > _predict_rank(without, last, 1.0).step_s
    assert predict_run(spec).step_s == max(_predict_rank(spec, s, 1.0).step_s for s in spec.rank_shares())


def test_deepseek_rows_price_multi_token_prediction_as_their_table_names_it() -> None:
    rows = [r for r in json.loads(DATA.read_text())["rows"] if r["model"] == "deepseek-v3" and "mbridge" in r["id"]]
    assert rows
    for row in rows:
        where, run = row["published"]["where"], row["run"]
        if "w/o MTP" in where:
            assert run.get("mtp_layers", 0) == 0, row["id"]
        else:  # "w/ MTP", or the recipe's mtp_num_layers = 1 where the table does not say
            assert run["mtp_layers"] == 1, row["id"]
        assert not any("not priced" in n and "multi-token" in n for n in run["notes"]), row["id"]


def test_forced_load_balancing_prices_the_random_logits_in_the_routers_part() -> None:
    """[Note: forced load balancing]: RandomSTE's clone and normal_ over the t x E logits on the
    GPU, its eager operators and the RNG tracker's fork on the host before the sync, one launch
    inside a graphed router; the published Megatron-Bridge MoE rows all set it."""
    moe, hbm = QWEN3_30B.moe, H100.hbm_tbps * 1e12 * HBM_SHARE
    plain, forced = (moe_seconds(moe, 2048, 4096, H100, ep=8, force_balance=f) for f in (False, True))
    assert forced.router_forward_s - plain.router_forward_s == pytest.approx(
        4096 * moe.num_experts * 4 * FORCE_BALANCE_PASSES / hbm
    )
    # backward: twice the router's, and the busiest rank's experts ([Note: forced-balance skew])
    experts_backward = plain.backward_s - 2 * plain.router_forward_s
    skew = forced_balance_skew(moe, 8, 4096)
    assert forced.backward_s - plain.backward_s == pytest.approx(
        2 * (forced.router_forward_s - plain.router_forward_s) + (skew - 1) * experts_backward
    )
    pre, post = moe_host_split(moe, 8, fp8=False)
    forced_pre, forced_post = moe_host_split(moe, 8, fp8=False, force_balance=True)
    assert (forced_pre - pre, forced_post) == (pytest.approx(FORCE_BALANCE_OPS * TORCH_OP_S["x86"]), post)
    graphed = ("moe_router", "moe_preprocess")
    assert moe_host_split(moe, 8, False, graphed, force_balance=True) == moe_host_split(moe, 8, False, graphed)
    assert predict_run(qwen_run(force_load_balancing=True)).step_s > predict_run(qwen_run()).step_s
    rows = [r for r in json.loads(DATA.read_text())["rows"] if r["source"].startswith("megatron-bridge")]
    moe_rows = [r for r in rows if r["run"].get("ep", 1) > 1]
    assert moe_rows and all(r["run"]["force_load_balancing"] for r in moe_rows)


def test_small_kernels_pay_the_measured_gap_between_kernels_on_the_gpu_side() -> None:
    """[Note: small kernels' GPU floor]: the H100's measured gaps (2.1 us on a stream, 1.3 us in a
    graph) x Megatron-Core's kernels: router 31 (+2 forced), preprocess 10, permute 4 before the
    sync; after it chunk sorts 2 each way, unpermute 1, activation 1 (+3 clamped), fp8 casts 2 per
    local expert. The run model adds them to the GPU's side, backward twice."""
    gap, graph_gap, moe = KERNEL_GAP_S, GRAPH_KERNEL_GAP_S, QWEN3_30B.moe
    assert (gap, graph_gap) == (2.1e-6, 1.3e-6)
    g = moe_kernel_gaps(moe, 8, fp8=False)
    assert (g.pre_sync_s, g.dispatch_s, g.experts_s, g.act_s) == pytest.approx((45 * gap, 5 * gap, 0.0, gap))
    graphed = moe_kernel_gaps(moe, 8, False, ("moe_router", "moe_preprocess"), force_balance=True)
    assert graphed.pre_sync_s == pytest.approx(43 * graph_gap + 4 * gap)  # a graph keeps the GPU's gaps
    assert moe_kernel_gaps(moe, 8, fp8=True).experts_s == pytest.approx(2 * 16 * gap)
    assert moe_kernel_gaps(replace(moe, activation_clamp=True), 8, False).act_s == pytest.approx(4 * gap)
    assert moe_kernel_gaps(moe, 128, False).dispatch_s == pytest.approx(gap)  # one expert a rank: no sort
    flex = moe_kernel_gaps(moe, 8, False, dispatcher="flex")
    assert (flex.pre_sync_s, flex.dispatch_s) == (pytest.approx(17 * gap), 0.0)
    spec, tokens = qwen_run(seq_len=8192), 8192.0
    e, bare = moe_layer_seconds(spec, tokens), moe_seconds(moe, QWEN3_30B.hidden, tokens, H100, ep=8)
    assert (e.forward_s - bare.forward_s, e.backward_s - bare.backward_s) == pytest.approx(
        (g.forward_s, 2 * g.forward_s)
    )
    assert (e.router_forward_s - bare.router_forward_s, e.dispatch_forward_s) == pytest.approx(
        (g.pre_sync_s, g.dispatch_s)
    )
    forward, backward = moe_layer_s(spec, tokens, 1e-3, 2e-3, 0.0)  # GPU-bound: the gaps show
    post = e.expert_forward_s + e.act_forward_s + e.dispatch_forward_s
    pre_h, post_h = moe_host_split(moe, 8, fp8=False)
    assert forward == pytest.approx(synced_forward_s(1e-3 + e.forward_s - post, post, pre_h, post_h, 0.0, "x86"))
    assert backward == pytest.approx(2e-3 + e.backward_s)
