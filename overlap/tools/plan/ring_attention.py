"""Context parallelism's ring attention for one block and one micro-batch of a `RunSpec`: what it
adds to the compute stream and what of its communication the attention kernels do not hide.

[Note: ring attention]
C ranks each hold t = s/C tokens of every sequence (causal load balance: two chunks of s/2C, one
from each end, so every rank does the same causal work: the attention kernel's FLOPs are those of
the rank's causal share, kernels.py). Each block's attention runs C steps; at step i a rank
attends over the K/V chunk of rank (r - i). Two implementations:

PyTorch's (torch.distributed.tensor.experimental context_parallel, what torchtitan runs; defaults
`_ContextParallelOptions(convert_to_f32=True, enable_load_balance=True, rotate_method=ALL_GATHER)`):
    K/V width   torchtitan's Llama repeats the K/V heads to the query heads before SDPA
                (`repeat_kv`), so the ring carries h/T per token, not the K/V width
    forward     one all-gather of every rank's K and V, waited for after the first step (the
                rank's own chunk: 1/C of the attention); each step concatenates K and V again
                (`torch.cat`: one read, one write) and merges its partial output into an fp32
                accumulator: the bf16 output cast up (2 + 4 bytes), `out - block_out` (4 + 4 + 4),
                the sigmoid-weighted product (4 + 4) and the difference (4 + 4 + 4): 38 bytes per
                output element
    backward    the K/V all-gather again, and the K/V gradients travel the ring in fp32 (an
                all-to-all permute per step, 2·t·w·4 bytes), each waited for after a step's
                backward kernel; per step K and V are concatenated again (8 bytes per element
                pair), the K/V gradients accumulated in fp32 (read 4 + 2, write 4, each) and
                concatenated for the send (read and write 4, each), the query gradient
                accumulated in fp32 (10 bytes)
A recomputed forward (full checkpointing) runs the ring forward again. The backward permutes the
K/V gradients C times (after every step, `_templated_ring_attention_backward`); the last is waited
for after the loop with no step left to hide it.

Where the blocks are compiled (torchtitan's `apply_compile` wraps each TransformerBlock in
`torch.compile(fullgraph=True)`, the attention and so the ring inside it), the ring's functional
collectives are traced: a traced collective is waited for where it is issued ("wait_tensor() op is
immediately called", torch/distributed/_functional_collectives.py's module docstring: "Compiled
tracing currently relies on the compiler to perform this optimization"; the ring's own
`_maybe_wait`: "When tracing the code, the result tensor is not an AsyncCollectiveTensor"), and
Inductor's pass that would move the waits is off by default (`reorder_for_compute_comm_overlap =
False`, torch/_inductor/config.py; its generated code then runs a collective and its wait_tensor
back to back: https://github.com/KellerJordan/modded-nanogpt/pull/97). Under a compiled stack
every K/V gather and gradient pass is therefore exposed. Sources, at the torch commit of torchtitan's December 2024 H100 page:
https://github.com/pytorch/pytorch/blob/1963fc83a1c32e162162e2414f78b043f0674bae/torch/distributed/_functional_collectives.py,
https://github.com/pytorch/pytorch/blob/1963fc83a1c32e162162e2414f78b043f0674bae/torch/_inductor/config.py,
https://github.com/pytorch/pytorch/blob/1963fc83a1c32e162162e2414f78b043f0674bae/torch/distributed/tensor/experimental/_attention.py,
https://github.com/pytorch/torchtitan/blob/9dec370ad26b5f8e9a7333a0e36165018262644b/torchtitan/parallelisms/parallelize_llama.py.

Transformer Engine's (Megatron-Core, `--context-parallel-size`): point-to-point K/V passes of the
K/V width (GQA heads are not repeated), each hidden behind a step's attention kernel; the merge
is fused into its attention kernels. Its residual cost is what `exposed_s` returns beyond them.
"""

from __future__ import annotations

from overlap.step_model.hardware import HBM_SHARE, accelerator, node_spec, ring_link
from overlap.step_model.stacks import ATTENTION_BACKWARD, stack
from overlap.tools.plan.run_spec import RankShare, RunSpec

TORCH_MERGE_BYTES = 2 + 4 + 12 + 8 + 12
"""Bytes per output element of one step's fp32 merge of a partial result ([Note: ring attention])."""
TORCH_KV_CAT_BYTES = 2 * 2 * 2
"""Bytes per element pair (K and V) of a step's `torch.cat` of bf16 K and V: read and write each."""
TORCH_GRAD_KV_BYTES = 2 * 10 + 2 * 8
"""Bytes per K/V element pair of a backward step: fp32 accumulation of both, then their `cat`."""
TORCH_GRAD_Q_BYTES = 10
"""Bytes per query element of a backward step's fp32 accumulation of the query gradient."""
RECOMPUTED_RING_FORWARDS = {"none": 0, "selective": 0, "attention": 1, "full": 1, "layer2": 0.5}
"""Ring forwards a recomputation repeats per block (the attention is inside what it re-runs)."""
COMPILED_STACKS = frozenset({"torch-compile"})
"""Stacks whose blocks run under torch.compile, the ring traced with them: its collectives are
waited for where they are issued ([Note: ring attention])."""


def _torch_ring(spec: RunSpec) -> bool:
    return spec.cp > 1 and stack(spec.stack).torch_ring


def _tokens_and_width(spec: RunSpec) -> tuple[float, float, float]:
    """(rank tokens t, query/output width, K/V width on the ring) per micro-batch and block."""
    block = spec.model.block()
    tokens = spec.micro_batch * spec.seq_len / spec.cp
    width = block.hidden / spec.tp
    kv_width = width if _torch_ring(spec) else block.kv_dim / spec.tp
    return tokens, width, kv_width


def compute_s(spec: RunSpec) -> tuple[float, float]:
    """(forward, backward) seconds one block adds to the compute stream per micro-batch: the
    element-wise work of PyTorch's ring steps ([Note: ring attention]); 0 for other rings."""
    if not _torch_ring(spec):
        return 0.0, 0.0
    gpu = accelerator(spec.gpu)
    rate = gpu.hbm_tbps * 1e12 * HBM_SHARE
    t, width, kv_width = _tokens_and_width(spec)
    steps = spec.cp
    forward = steps * t * (TORCH_KV_CAT_BYTES * kv_width + TORCH_MERGE_BYTES * width) / rate
    backward = steps * t * ((TORCH_KV_CAT_BYTES + TORCH_GRAD_KV_BYTES) * kv_width + TORCH_GRAD_Q_BYTES * width) / rate
    return forward * (1 + RECOMPUTED_RING_FORWARDS[spec.ac]), backward


def exposed_s(spec: RunSpec, share: RankShare, attention_s: float) -> float:
    """Seconds per micro-batch the ring's communication adds beyond the attention kernels that
    hide it, over the blocks of the pipeline rank holding `share` (`RunSpec.rank_layers`: its
    layers under a `pipeline_layout`, multi-token-prediction depths included); `attention_s` is
    one block's attention forward on this rank."""
    if spec.cp == 1:
        return 0.0
    layers = len(spec.rank_layers(share))
    t, _, kv_width = _tokens_and_width(spec)
    per_node = max(1, node_spec(spec.node).gpus_per_node // spec.tp)
    link = ring_link(accelerator(spec.gpu), node_spec(spec.node), spec.cp, max(1, min(spec.cp, per_node)))
    kv_pass = link.alpha_s + link.seconds(2 * t * kv_width * 2)
    c = spec.cp
    if not _torch_ring(spec):  # a pass per step behind each step's kernel
        forward = max(0.0, (c - 1) * kv_pass - attention_s)
        backward = max(0.0, 2 * (c - 1) * kv_pass - ATTENTION_BACKWARD * attention_s)
        return layers * (forward + backward)
    step_s = attention_s / c
    gather = (c - 1) * kv_pass  # a ring all-gather moves (C-1) chunks through each rank
    grad_pass = link.alpha_s + link.seconds(2 * t * kv_width * 4)
    if spec.stack in COMPILED_STACKS:  # traced: each collective waited for where it is issued
        forward, backward = gather, gather + c * grad_pass
    else:  # the gathers behind the first step; C-1 gradient passes behind the next steps, the last after them
        forward = max(0.0, gather - step_s)
        backward = max(0.0, gather - ATTENTION_BACKWARD * step_s)
        backward += (c - 1) * max(0.0, grad_pass - ATTENTION_BACKWARD * step_s) + grad_pass
    return layers * (forward * (1 + RECOMPUTED_RING_FORWARDS[spec.ac]) + backward)


__all__ = ["compute_s", "exposed_s"]
