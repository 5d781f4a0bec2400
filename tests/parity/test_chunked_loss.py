"""Several autograd runs per step, and modules run several times per step, against FSDP2 and DDP.

torchtitan's chunked loss runs the model without its head, then for each chunk of the sequence
`head(h_chunk)` and `chunk_loss.backward()` (an autograd run of its own, before the model's
backward), and then one backward through the model with the chunks' summed gradient. The head
accumulates a gradient once per chunk; each unit still reduces once per step ([Note: auxiliary
backward runs] in overlap/engine/state.py). Compared with FSDP2 (`fully_shard` per block and on
the root, the head in the root) on two gloo ranks at every step: the loss, every full gradient and
every parameter, bitwise ([Note: what is bitwise] in tolerance.py: the same ops on the same
unsharded values, a two-rank sum, AdamW elementwise). Modules called twice per forward, and a
model run twice per step, are compared with DDP the same way.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import overlap

VOCAB, DIM, SEQ, BATCH, STEPS = 64, 16, 16, 2, 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Decoder(nn.Module):
    """torchtitan's layout: embeddings, blocks in a ModuleDict, a final norm, a head the chunked
    loss calls itself (`skip_head`)."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(3)})
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor, skip_head: bool = False) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h)
        return h if skip_head else self.output(h)


class _BackpropAccumulated(torch.autograd.Function):
    """The loss value whose backward hands the model's output the chunks' summed gradient."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, grad: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(grad)
        return loss.detach()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (grad,) = ctx.saved_tensors
        return grad, None, None


def chunked_loss(
    head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, num_chunks: int, tokens: int
) -> torch.Tensor:
    """torchtitan's ChunkedLossWrapper: per chunk, head + cross-entropy (summed, divided by the
    global token count) + its own backward; then one loss whose backward runs the model's. A
    head that is an FSDP2 module of its own keeps its parameters gathered over the chunks and
    syncs its gradient at the last chunk only, as the wrapper arranges."""
    fsdp = isinstance(head, FSDPModule)
    if fsdp:
        head.set_reshard_after_forward(False)
        head.set_reshard_after_backward(False)
        head.set_requires_gradient_sync(False, recurse=False)
        head.unshard()
    chunks = [c.detach().requires_grad_() for c in hidden.chunk(num_chunks, dim=1)]
    total = hidden.new_zeros((), dtype=torch.float32)
    grads = []
    for i, (h, y) in enumerate(zip(chunks, labels.chunk(num_chunks, dim=1))):
        if fsdp and i == num_chunks - 1:
            head.set_requires_gradient_sync(True, recurse=False)
        loss = F.cross_entropy(head(h).flatten(0, 1).float(), y.flatten(), reduction="sum") / tokens
        loss.backward()
        grads.append(h.grad.float())
        total = total + loss.detach()
    if fsdp:
        head.set_reshard_after_forward(True)
        head.set_reshard_after_backward(True)
        head.set_requires_gradient_sync(True, recurse=False)
        head.reshard()
    return _BackpropAccumulated.apply(hidden, torch.cat(grads, dim=1).to(hidden.dtype), total)


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _full(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.full_tensor()


def compare_and_step(ours: nn.Module, ref: nn.Module, optims: tuple, step: int) -> list[str]:
    """The full gradients of two sharded models (overlap's, FSDP2's), then an optimizer step on
    both, then their full parameters: what differs (empty: bitwise equal)."""
    bad = []
    theirs = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        mine, other = _full(p.grad), _full(theirs[name].grad)
        if (mine is None) != (other is None) or (mine is not None and not torch.equal(mine, other)):
            bad.append(f"step {step}: grad of {name}")
    for optim in optims:
        optim.step()
        optim.zero_grad()
    for name, p in ours.named_parameters():
        if not torch.equal(p.full_tensor(), theirs[name].full_tensor()):
            bad.append(f"step {step}: {name}")
    return bad


def _fsdp2(model: Decoder, divide_factor: float | None, mixed: bool = False) -> Decoder:
    """Per block and the root; `mixed`: torchtitan's layout and policy, the final norm and the
    head one module group of their own, bf16 parameters, fp32 reduction."""
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed
        else MixedPrecisionPolicy()
    )
    for block in model.layers.values():
        fully_shard(block, mp_policy=policy)
    if mixed:
        fully_shard([model.norm, model.output], mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    if divide_factor is not None:  # gloo has neither PREMUL_SUM nor AVG for this: sum, then divide
        for module in model.modules():
            if hasattr(module, "set_gradient_divide_factor"):
                module.set_gradient_divide_factor(divide_factor)
                module.set_force_sum_reduction_for_comms(True)
    return model


def chunked_vs_fsdp2(
    rank: int,
    world: int,
    tied: bool,
    num_chunks: int,
    head_unit: bool,
    divide_factor: float | None = None,
    micro_batches: int = 1,
    mixed: bool = False,
) -> list[str]:
    """Train the same model with overlap and FSDP2 under the chunked loss; the differences. With
    `micro_batches`, every micro-batch but the last of a step runs without gradient sync."""
    torch.manual_seed(0)
    base = Decoder(tied)
    ours = copy.deepcopy(base)
    policy = (lambda m, head=ours.output: isinstance(m, Block) or m is head) if head_unit else {Block}
    kwargs = {} if divide_factor is None else {"gradient_divide_factor": divide_factor}
    if mixed:
        kwargs.update(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    overlap.wrap(ours, unit_policy=policy, **kwargs)
    ref = _fsdp2(copy.deepcopy(base), divide_factor, mixed)
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    tokens = BATCH * SEQ * world
    bad: list[str] = []
    for step in range(STEPS):
        for micro in range(micro_batches):
            x, y = _batch(rank, 10 * step + micro)
            sync = micro == micro_batches - 1
            ref.set_requires_gradient_sync(sync)
            losses = []
            for model in (ours, ref):
                with contextlib.nullcontext() if sync or model is ref else ours.no_sync():
                    loss = chunked_loss(model.output, model(x, skip_head=True), y, num_chunks, tokens)
                    loss.backward()
                losses.append(loss)
        if not torch.equal(*losses):
            bad.append(f"step {step}: loss {losses[0].item()} vs {losses[1].item()}")
        bad += compare_and_step(ours, ref, (opt, ref_opt), step)
    return bad


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("num_chunks", [1, 2, 8])
def test_chunked_loss_matches_fsdp2(world2, tied, num_chunks):
    for rank, bad in enumerate(world2.run(chunked_vs_fsdp2, tied=tied, num_chunks=num_chunks, head_unit=False)):
        assert not bad, f"rank {rank}: {bad}"


def test_chunked_loss_with_the_head_its_own_unit(world2):
    """The head a unit of its own: gathered for the first chunk, kept for the others."""
    for rank, bad in enumerate(world2.run(chunked_vs_fsdp2, tied=False, num_chunks=4, head_unit=True)):
        assert not bad, f"rank {rank}: {bad}"


class Repeated(nn.Module):
    """One block applied twice per forward (shared across depth), between two of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks[0](x)
        x = self.blocks[1](self.blocks[1](x))
        return self.head(self.blocks[2](x))


def repeated_vs_ddp(rank: int, world: int, twice_per_step: bool) -> list[str]:
    """A module called twice per forward (and, with `twice_per_step`, the model run on two
    batches and one backward of the sum), against DDP every step."""
    torch.manual_seed(0)
    base = Repeated()
    ours = overlap.wrap(copy.deepcopy(base))
    ref = DDP(copy.deepcopy(base))
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    bad: list[str] = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(10 * step + rank)
        xs = [torch.randn(4, DIM, generator=gen) for _ in range(2 if twice_per_step else 1)]
        losses = []
        for model in (ours, ref):
            loss = sum(model(x).pow(2).mean() for x in xs)
            loss.backward()
            losses.append(loss)
        if not torch.equal(*losses):
            bad.append(f"step {step}: loss")
        theirs = dict(ref.module.named_parameters())
        for name, p in ours.named_parameters():
            if not torch.equal(p.grad.full_tensor(), theirs[name].grad):
                bad.append(f"step {step}: grad of {name}")
        for optim in (opt, ref_opt):
            optim.step()
            optim.zero_grad()
    return bad


@pytest.mark.parametrize("twice_per_step", [False, True], ids=["twice per forward", "and two forwards per step"])
def test_module_called_twice_matches_ddp(world2, twice_per_step):
    for rank, bad in enumerate(world2.run(repeated_vs_ddp, twice_per_step=twice_per_step)):
        assert not bad, f"rank {rank}: {bad}"


@pytest.mark.parametrize("micro_batches", [1, 2], ids=["one batch", "accumulated"])
def test_chunked_loss_summed_over_ranks_matches_fsdp2(world2, micro_batches):
    """torchtitan's default: the loss divided by the global token count, the gradients summed
    over ranks (divide factor 1); also accumulated over two micro-batches, the first without
    gradient sync."""
    kwargs = {"tied": False, "num_chunks": 4, "head_unit": False, "divide_factor": 1.0, "micro_batches": micro_batches}
    for rank, bad in enumerate(world2.run(chunked_vs_fsdp2, **kwargs)):
        assert not bad, f"rank {rank}: {bad}"


def early_reductions(rank: int, world: int, num_chunks: int) -> dict:
    """Which units finish their backward as soon as their gradients are in (before the end of the
    step's backward) under the chunked loss: every block; the root, which the head's per-chunk
    runs reach, at the end."""
    from overlap.engine.state import state_of

    torch.manual_seed(0)
    model = overlap.wrap(Decoder(tied=False))  # "auto": the blocks of the ModuleDict
    state = state_of(model)
    early: list[int] = []
    finish = state._post_backward

    def recorded(index: int) -> None:
        early.append(index)
        finish(index)

    state._post_backward = recorded
    x, y = _batch(rank, 0)
    chunked_loss(model.output, model(x, skip_head=True), y, num_chunks, BATCH * SEQ * world).backward()
    return {"early": early, "labels": [u.layout.label for u in state.units], "root": state.root_unit}


def test_blocks_still_reduce_as_early_as_their_gradients_allow(world2):
    for rank, out in enumerate(world2.run(early_reductions, num_chunks=4)):
        blocks = [i for i in range(len(out["labels"])) if i != out["root"]]
        finished = list(dict.fromkeys(out["early"]))  # (a) and (b) may both report a unit
        assert len(blocks) == 3 and finished == blocks[::-1], (rank, out)  # in backward order


def test_chunked_loss_bf16_matches_fsdp2_with_a_head_group(world2):
    """bf16 parameters, fp32 reduction, and FSDP2 as torchtitan lays it out (the norm and the head
    one group, gathered over the chunks, synced at the last): the head's chunk gradients add up
    in fp32 on both sides ([Note: auxiliary backward runs] in overlap/engine/state.py)."""
    kwargs = {"tied": False, "num_chunks": 4, "head_unit": False, "divide_factor": 1.0, "mixed": True}
    for rank, bad in enumerate(world2.run(chunked_vs_fsdp2, **kwargs)):
        assert not bad, f"rank {rank}: {bad}"
