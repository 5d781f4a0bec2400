"""PyTorch's ring attention in `overlap plan`: which of its collectives the attention kernels hide
([Note: ring attention] in overlap/tools/plan/ring_attention.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from overlap.step_model.hardware import accelerator, node_spec, ring_link
from overlap.tools.plan import ring_attention
from overlap.tools.plan.run_spec import ModelShape, RunSpec

LLAMA_8B = ModelShape(num_layers=32, hidden=4096, ffn_hidden=14336, num_heads=32, num_kv_heads=8, vocab_size=128256)


def _run(cp: int, stack: str, ac: str = "full") -> RunSpec:
    return RunSpec(model=LLAMA_8B, gpu="h100-96gb-500w", node="grand-teton", num_gpus=8, cp=cp,
                   seq_len=32768 * cp, global_batch=8 // cp, micro_batch=1, ac=ac, stack=stack)  # fmt: skip


def _passes(spec: RunSpec) -> tuple[float, float]:
    """(one K/V chunk in bf16, one K/V gradient chunk in fp32) through the ring, in seconds: the
    K/V heads repeated to the query heads, 32k tokens per rank."""
    link = ring_link(accelerator(spec.gpu), node_spec(spec.node), spec.cp, spec.cp)
    chunk = 2 * 32768 * LLAMA_8B.hidden
    return link.alpha_s + link.seconds(chunk * 2), link.alpha_s + link.seconds(chunk * 4)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_compiled_ring_waits_for_every_collective_where_it_is_issued(cp: int) -> None:
    spec = _run(cp, "torch-compile")
    (share,) = spec.rank_shares()
    kv, grad = _passes(spec)
    gather = (cp - 1) * kv
    # forward and its recomputation each gather, the backward gathers again and permutes C times
    expected = 32 * (2 * gather + gather + cp * grad)
    for attention_s in (0.0, 1.0):  # no kernel hides a traced collective
        assert ring_attention.exposed_s(spec, share, attention_s) == pytest.approx(expected)
    no_recompute = replace(spec, ac="none")
    assert ring_attention.exposed_s(no_recompute, share, 1.0) == pytest.approx(expected - 32 * gather)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_eager_ring_leaves_only_the_last_gradient_pass_behind_long_steps(cp: int) -> None:
    spec = _run(cp, "torch-eager")
    (share,) = spec.rank_shares()
    _, grad = _passes(spec)
    # steps far longer than any pass: the gathers and C-1 gradient passes hide, the last one
    # is waited for after the loop
    assert ring_attention.exposed_s(spec, share, 10.0) == pytest.approx(32 * grad)
    assert ring_attention.exposed_s(_run(cp, "torch-compile"), share, 10.0) > 3 * 32 * grad


def test_transformer_engine_ring_and_no_ring_are_unchanged() -> None:
    spec = _run(4, "megatron-te")
    (share,) = spec.rank_shares()
    assert ring_attention.exposed_s(spec, share, 10.0) == 0.0  # its passes hide behind each step
    one = _run(1, "torch-compile")
    assert ring_attention.exposed_s(one, one.rank_shares()[0], 0.0) == 0.0
