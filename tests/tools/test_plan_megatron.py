"""Megatron-LM's own published runs as benchmarks/published_runs.json holds them: the rows whose
configuration a script publishes run that script's settings, and the strong-scaling rows' pipeline
schedule is checked against what the published figures allow."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from overlap.tools.plan.run_spec import RunSpec
from overlap.tools.plan.run_step import predict_run

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import plan_published as pp


@pytest.fixture(scope="module")
def rows() -> dict[str, tuple[dict, RunSpec]]:
    _, loaded = pp.load_rows()
    return {row["id"]: (row, spec) for row, spec, _ in loaded if spec is not None}


def test_gpt3_example_row_runs_the_readme_script(rows) -> None:
    """examples/pretrain_gpt3_175B.sh at 50a4b5fa: TP 8, PP 16, micro-batch 1, global batch 1536
    on 128 nodes of 8, no virtual pipeline stages (1F1B), --checkpoint-activations, --fp16 and
    --DDP-impl at its default 'local' (fp16 gradients all-reduced after the backward)."""
    _, spec = rows["meg21-gpt3-175b-1024"]
    assert (spec.tp, spec.pp, spec.num_gpus, spec.global_batch, spec.micro_batch) == (8, 16, 1024, 1536, 1)
    assert (spec.schedule, spec.virtual_stages, spec.ac) == ("1f1b", 1, "full")
    assert spec.dp_mode == "ddp" and not spec.dp_overlap and spec.reduce_bytes == 2
    assert not any("not published" in note for note in spec.notes)


def test_strong_scaling_rows_under_1f1b_cannot_keep_the_published_share(rows) -> None:
    """Same layout and micro-batch at 96 and 4,608 GPUs: 1F1B runs M + P - 1 slots of the same
    micro-batch work, so per-GPU throughput at 4,608 keeps at most 12 x 581 / (17 x 576) of the
    96-GPU figure before any data-parallel exchange; the README's MFU (47% -> 42%) keeps more,
    which is what the 4,608-GPU row's note records. The model honours the bound."""
    (row_96, small), (row_4608, large) = rows["mcore-strong-177b-96"], rows["mcore-strong-177b-4608"]
    assert (small.tp, small.pp, small.micro_batch) == (large.tp, large.pp, large.micro_batch)
    assert small.schedule == large.schedule == "1f1b"
    m_small, m_large, fill = small.num_microbatches, large.num_microbatches, small.pp - 1
    bound = m_large * (m_small + fill) / ((m_large + fill) * m_small)
    assert (m_small, m_large) == (576, 12) and bound == pytest.approx(0.712, abs=1e-3)
    published = row_4608["published"]["mfu"] / row_96["published"]["mfu"]
    assert published > bound + 0.15
    predicted = predict_run(large).tokens_per_s_per_gpu / predict_run(small).tokens_per_s_per_gpu
    assert predicted <= bound * 1.01
    assert any("1F1B cannot give the published" in note for note in large.notes)


def test_recompute_num_layers_recomputes_that_many_layers_whole(rows) -> None:
    # Megatron-Core's recompute_method "block": the first N layers of the rank rerun their whole
    # forward, the rest run `ac`; the Megatron-Bridge H100 8B FP8-CS config sets N = 5 of 32
    from dataclasses import replace

    _, spec = rows["mbridge-25.11-h100-llama3-8b-8"]
    assert spec.recompute_num_layers == 5
    none = predict_run(replace(spec, recompute_num_layers=0)).compute_s
    full = predict_run(replace(spec, recompute_num_layers=0, ac="full")).compute_s
    assert predict_run(spec).compute_s == pytest.approx(none + 5 / 32 * (full - none))
    with pytest.raises(ValueError, match="recompute_num_layers"):
        replace(spec, ac="full")
    with pytest.raises(ValueError, match="recompute_num_layers"):
        replace(spec, recompute_num_layers=-1)
