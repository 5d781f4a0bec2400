"""What llm-foundry's MPT benchmark runs did beyond the kernels they share with other stacks: the
large-scale H100 sweep's FlashAttention-2 path unpads q, k and v and pads the output in every
layer (flash-attn 2.4.2's bert_padding), element-wise work the Triton path does not do."""

from __future__ import annotations

from dataclasses import replace

import pytest

from overlap.step_model.hardware import ACCELERATORS, HBM_SHARE
from overlap.step_model.kernels import ACT_BYTES, STACKS, BlockShape, block_seconds
from overlap.tools.plan.run_spec import ModelShape, RunSpec
from overlap.tools.plan.run_step import predict_run

MPT_1B = ModelShape(num_layers=24, hidden=2048, ffn_hidden=8192, num_heads=16, num_kv_heads=16, vocab_size=50368,
                    mlp="gelu", tied_embeddings=True)  # fmt: skip
UNPAD_FORWARD_BYTES = 3 * (2 + 2) + (2 + 2 + 2)
"""Per element of h: a torch.gather of q, k and v (read, write), then the output's torch.zeros and
indexed copy (IndexFirstAxis and IndexPutFirstAxis, flash_attn/bert_padding.py at v2.4.2)."""
UNPAD_BACKWARD_BYTES = 3 * (2 + 2 + 2) + (2 + 2)
"""torch.zeros and scatter_ for each of q, k and v's gradients, the indexed read of the output's."""


def test_flash2_path_pays_the_unpadding_of_q_k_v_and_the_padding_of_the_output() -> None:
    shape = BlockShape(hidden=2048, ffn_hidden=8192, num_heads=16, num_kv_heads=16, mlp="gelu")
    gpu, tokens = ACCELERATORS["h100-sxm"], 12 * 2048
    flash2 = STACKS["llm-foundry-flash2"]
    same_kernels = replace(STACKS["llm-foundry"], attention_share=flash2.attention_share,
                           narrow_head_share=flash2.narrow_head_share)  # fmt: skip
    unpadded = block_seconds(shape, tokens, 2048, gpu, flash2)
    padded = block_seconds(shape, tokens, 2048, gpu, same_kernels)
    hbm = gpu.hbm_tbps * 1e12 * HBM_SHARE
    per_token_bytes = (UNPAD_FORWARD_BYTES + UNPAD_BACKWARD_BYTES) * shape.hidden
    # forward and backward together (the block model's backward is twice the forward's element-wise)
    extra = unpadded.forward_s + unpadded.backward_s - padded.forward_s - padded.backward_s
    assert extra == pytest.approx(tokens * per_token_bytes / hbm)
    assert unpadded.attention_forward_s == pytest.approx(padded.attention_forward_s)
    assert (UNPAD_FORWARD_BYTES + UNPAD_BACKWARD_BYTES) / ACT_BYTES == 20


def test_large_scale_flash2_rows_run_slower_than_without_the_unpadding(monkeypatch: pytest.MonkeyPatch) -> None:
    # the sweep's 1b: SHARD_GRAD_OP, micro-batch 12, no checkpointing, 128 H100s
    spec = RunSpec(model=MPT_1B, gpu="h100-sxm", node="dgx-h100", num_gpus=128, seq_len=2048, global_batch=1536,
                   micro_batch=12, dp_mode="zero2", stack="llm-foundry-flash2", param_bytes=2,
                   reduce_bytes=4)  # fmt: skip
    with_unpad = predict_run(spec)
    padded = replace(STACKS["llm-foundry-flash2"], residual_passes=STACKS["llm-foundry"].residual_passes)
    monkeypatch.setitem(STACKS, "llm-foundry-flash2", padded)
    without = predict_run(spec)
    assert with_unpad.compute_s > without.compute_s
    assert with_unpad.tokens_per_s_per_gpu < without.tokens_per_s_per_gpu
