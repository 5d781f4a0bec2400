"""What DDP and FSDP2 scripts do with their model works on the wrapped one, checked against DDP:
`model.no_sync()` / `model.set_requires_gradient_sync()`, `torch.nn.utils.clip_grad_norm_(
model.parameters(), c)`, `model.state_dict()` on rank 0 alone, `model.unshard()` /
`model.reshard()`, and 0-dim parameters (kept whole on every rank, averaged like DDP's).
See overlap/engine/module.py and overlap/engine/replicated.py."""

from __future__ import annotations

import copy
import io
import threading
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from helpers.models import Block, TinyLM, backward_both, batch, encoder_stack, loss_of, step_both, tiny_lm
from helpers.tolerance import reordered_rtol
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

import overlap
from overlap.engine.module import OverlapModule
from overlap.transport import collectives as comm


class GatedBlock(Block):
    """A block with a 0-dim parameter of its own: it lives inside a unit."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__(dim, hidden)
        self.gate = nn.Parameter(torch.tensor(0.8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gate * self.down(F.gelu(self.up(self.norm(x))))


class ScaledLM(TinyLM):
    """TinyLM with 0-dim parameters: a temperature at the root (CLIP's `logit_scale`), a gate in
    every block, one never used, and one that only rank 0's forward uses."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([GatedBlock(24, 30) for _ in range(4)])
        self.temperature = nn.Parameter(torch.tensor(0.3))
        self.unused = nn.Parameter(torch.tensor(2.0))
        self.rank0_gate = nn.Parameter(torch.tensor(1.5))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        logits = super().forward(idx) * self.temperature.exp()
        if dist.get_rank() == 0:
            logits = logits * self.rank0_gate
        return logits


SCALARS = ["temperature", "unused", "rank0_gate"] + [f"blocks.{i}.gate" for i in range(4)]


def scaled_lm() -> ScaledLM:
    torch.manual_seed(0)
    return ScaledLM()


def _rows(full: torch.Tensor, local: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    rows = -(-full.shape[0] // world)
    return full[rank * rows : rank * rows + local.shape[0]]


def _mismatches(what: str, ref: nn.Module, ours: nn.Module, rank: int, world: int, grads: bool) -> list[str]:
    """Every parameter (or gradient) of `ours` that is not bitwise the same rows of DDP's."""
    out = []
    named = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        mine, theirs = (p.grad, named[name].grad) if grads else (p.detach(), named[name].detach())
        if mine is None or theirs is None:
            if (mine is None) != (theirs is None):
                out.append(f"{what} {name}: None on one side only")
            continue
        if isinstance(mine, DTensor):
            mine = mine.to_local()
            theirs = _rows(theirs, mine, rank, world)
        if not torch.equal(mine, theirs):
            out.append(f"{what} {name}: max |diff| {(mine - theirs).abs().max().item():.3g}")
    return out


def _counting(name: str) -> tuple[list[int], object]:
    """Count calls of comm's collective `name` (returns the counter and the original)."""
    calls: list[int] = []
    original = getattr(comm, name)
    setattr(comm, name, lambda *a, **k: (calls.append(1), original(*a, **k))[1])
    return calls, original


# ---------------------------------------------------------------- the wrapped model's class


class OwnReshard(TinyLM):
    def reshard(self) -> str:
        return "own"


def wrapped_class(rank: int, world: int) -> dict:
    model = overlap.wrap(tiny_lm())
    stack = overlap.wrap(encoder_stack())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        own = overlap.wrap(OwnReshard())
    shadowed = [str(w.message) for w in caught if "defines reshard" in str(w.message)]
    try:
        copy.deepcopy(model)
        deepcopy_error = None
    except TypeError as e:
        deepcopy_error = str(e)
    part = stack[0:2]  # nn.Sequential slicing builds type(stack)(...): a plain Sequential
    return {
        "isinstance": isinstance(model, TinyLM) and isinstance(model, OverlapModule),
        "name": type(model).__name__,
        "repr": repr(model).splitlines()[0],
        "slice": (type(part) is nn.Sequential, len(part)),
        "deepcopy": deepcopy_error,
        "shadowed": (shadowed, OwnReshard.reshard(own)),
    }


def test_wrapped_model_keeps_its_class(world2):
    for r in world2.run(wrapped_class):
        assert r["isinstance"] and r["name"] == "TinyLM" and r["repr"] == "TinyLM(", r
        assert r["slice"] == (True, 2), r
        assert r["deepcopy"] and "full_state_dict" in r["deepcopy"], r
        assert len(r["shadowed"][0]) == 1 and r["shadowed"][1] == "own", r  # warned, still callable


# ---------------------------------------------------------------- no_sync, gradient sync switch


def accumulate_like_ddp(rank: int, world: int, idiom: str) -> list[str]:
    """Two micro-batches without gradient sync, a third with it, an AdamW step; twice. Every
    gradient and parameter bitwise DDP's (ScaledLM: sharded and replicated parameters). With
    idiom "no_sync, then model.zero_grad()", both models' zero_grad after the first micro-batch
    drops what it accumulated ([Note: zero_grad after no_sync] in overlap/engine/module.py)."""
    base = scaled_lm()
    ref = DDP(copy.deepcopy(base), find_unused_parameters=True)
    ours = overlap.wrap(base)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2, weight_decay=0.1)
    reduce_scatters, original = _counting("reduce_scatter_flat")
    mismatches = []
    try:
        for step in range(2):
            for micro in range(3):
                x = batch(base, rank, 3 * step + micro)
                if micro < 2:
                    with ref.no_sync():
                        loss_of(ref(x)).backward()
                    if idiom.startswith("no_sync"):
                        with ours.no_sync():
                            loss_of(ours(x)).backward()
                        if idiom.endswith("zero_grad()") and micro == 0:
                            ref.zero_grad(set_to_none=step == 0)  # dropped; then zeroed in place
                            ours.zero_grad(set_to_none=step == 0)
                    else:
                        ours.set_requires_gradient_sync(False)
                        loss_of(ours(x)).backward()
                        ours.set_requires_gradient_sync(True)
                    assert not reduce_scatters, (rank, "a reduce-scatter inside no_sync")
                else:
                    loss_of(ref(x)).backward()
                    loss_of(ours(x)).backward()
                    assert reduce_scatters, (rank, "nothing reduced after no_sync")
                    reduce_scatters.clear()
            mismatches += _mismatches(f"step {step} grad", ref.module, ours, rank, world, grads=True)
            step_both(ref_opt, opt)
            mismatches += _mismatches(f"step {step} param", ref.module, ours, rank, world, grads=False)
    finally:
        comm.reduce_scatter_flat = original
    return mismatches


@pytest.mark.parametrize("idiom", ["no_sync", "set_requires_gradient_sync", "no_sync, then model.zero_grad()"])
def test_gradient_accumulation_equals_ddp_bitwise(world2, idiom):
    for rank, mismatches in enumerate(world2.run(accumulate_like_ddp, idiom=idiom)):
        assert not mismatches, f"rank {rank}:\n" + "\n".join(mismatches)


class HeadOnRank0(nn.Module):
    """A norm, blocks, then a head that only rank 0's forward uses: on the other rank the model's
    output is the last block's own output, so the root's gradient hook and the last unit's sit
    on one tensor ([Note: a finished unit is not prefetched again] in overlap/engine/schedule.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(24)  # the root's too: its unit ends last on every rank
        self.blocks = nn.Sequential(*[Block(24, 30) for _ in range(3)])
        self.head = nn.Linear(24, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.norm(x))
        return x + self.head(x) if dist.get_rank() == 0 else x


def head_on_rank0_like_ddp(rank: int, world: int, keep_bytes: int) -> list[str]:
    """A no_sync micro-batch, then a synced one, an SGD step; three times. Every gradient and
    parameter bitwise DDP's (find_unused_parameters=True)."""
    torch.manual_seed(0)
    base = HeadOnRank0()
    ref = DDP(copy.deepcopy(base), find_unused_parameters=True)
    ours = overlap.wrap(base, **({} if keep_bytes is None else {"keep_for_backward_bytes": keep_bytes}))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    mismatches = []
    for step in range(3):
        first, second = torch.randn(2, 4, 5, 24, generator=gen)
        for model in (ref, ours):
            with model.no_sync():
                model(first).square().mean().backward()
            model(second).square().mean().backward()
        mismatches += _mismatches(f"step {step} grad", ref.module, ours, rank, world, grads=True)
        step_both(ref_opt, opt)
        mismatches += _mismatches(f"step {step} param", ref.module, ours, rank, world, grads=False)
    return mismatches


@pytest.mark.parametrize("keep_bytes", [0, None], ids=["strict", "default-keep"])
def test_no_sync_with_a_head_one_rank_skips_equals_ddp(world2, keep_bytes):
    for rank, mismatches in enumerate(world2.run(head_on_rank0_like_ddp, keep_bytes=keep_bytes)):
        assert not mismatches, f"rank {rank}:\n" + "\n".join(mismatches)


# ---------------------------------------------------------------- gradient clipping


def clip_like_ddp(rank: int, world: int, clip: str) -> dict:
    """`clip` the gradients of both models by a small max norm (so it clips), then compare the
    total norm and the clipped gradients with DDP's."""
    base = scaled_lm()
    ref = DDP(copy.deepcopy(base), find_unused_parameters=True)
    ours = overlap.wrap(base)
    x = batch(base, rank, 0)
    loss_of(ref(x)).backward()
    loss_of(ours(x)).backward()
    ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    if clip == "torch":
        total = torch.nn.utils.clip_grad_norm_(ours.parameters(), 0.05)
    else:
        total = overlap.clip_grad_norm_(ours, 0.05)
    total = total.full_tensor() if isinstance(total, DTensor) else total
    worst = 0.0
    named = dict(ref.module.named_parameters())
    for name, p in ours.named_parameters():
        if p.grad is None:
            continue
        mine = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        theirs = _rows(named[name].grad, mine, rank, world) if isinstance(p.grad, DTensor) else named[name].grad
        worst = max(worst, ((mine - theirs).abs().max() / theirs.abs().max()).item())
    return {"ref": ref_total.item(), "ours": total.item(), "worst_grad_rel": worst}


@pytest.mark.parametrize("clip", ["torch", "overlap"])
def test_clip_grad_norm_is_the_global_norm(world2, clip):
    """`torch.nn.utils.clip_grad_norm_(model.parameters(), c)` on the wrapped model (DTensor
    shards beside plain 0-dim parameters) and `overlap.clip_grad_norm_(model, c)` give DDP's
    norm and clip like it (the same norm up to the order of the sum: [Note: what is bitwise])."""
    rtol = reordered_rtol(sum(p.numel() for p in scaled_lm().parameters()))
    for rank, r in enumerate(world2.run(clip_like_ddp, clip=clip)):
        assert abs(r["ours"] - r["ref"]) <= rtol * r["ref"], (rank, r)
        assert r["worst_grad_rel"] <= rtol, (rank, r)


# ---------------------------------------------------------------- state_dict on rank 0 alone


def state_dict_on_rank0(rank: int, world: int) -> dict:
    """The DDP habit `if rank == 0: torch.save(model.state_dict(), f)`: it returns at once (no
    collective; a thread with a deadline), holds this rank's shards as DTensors, and the file
    refuses to load into the unwrapped model. `overlap.full_state_dict` is the full model."""
    base = scaled_lm()
    plain = copy.deepcopy(base)
    ours = overlap.wrap(base)
    result: dict = {}
    if rank == 0:
        out: dict = {}
        worker = threading.Thread(target=lambda: out.update(sd=ours.state_dict()), daemon=True)
        worker.start()
        worker.join(timeout=60)
        assert not worker.is_alive(), "model.state_dict() on rank 0 alone did not return in 60 s"
        sd = out["sd"]
        result["kinds"] = {k: type(v).__name__ for k, v in sd.items()}
        weight = sd["head.weight"]
        result["shard"] = torch.equal(weight.to_local(), _rows(plain.head.weight, weight.to_local(), 0, world))
        buffer = io.BytesIO()
        try:
            torch.save(sd, buffer)
        except RuntimeError as e:  # torch 2.13: DTensors over views at an offset do not pickle
            result["load"] = f"raised at save: {str(e)[:200]}"
        else:
            buffer.seek(0)
            try:
                copy.deepcopy(plain).load_state_dict(torch.load(buffer, weights_only=False))
                result["load"] = "loaded"
            except RuntimeError as e:
                result["load"] = f"raised at load: {str(e)[:200]}"
    dist.barrier()
    full = overlap.full_state_dict(ours)  # collective: every rank
    if rank == 0:
        fresh = ScaledLM()
        fresh.load_state_dict(full)
        result["full"] = all(torch.equal(v, plain.state_dict()[k]) for k, v in fresh.state_dict().items())
    return result


def test_state_dict_on_rank0_alone_returns_shards_that_refuse_to_load_as_the_full_model(world2):
    r = world2.run(state_dict_on_rank0)[0]
    kinds = r["kinds"]
    assert all(kinds[name] == "Tensor" for name in SCALARS), kinds  # replicated: whole
    assert {kinds[k] for k in kinds if k not in SCALARS} == {"DTensor"}, kinds
    assert r["shard"], "rank 0's DTensor does not hold rank 0's rows"
    assert r["load"].startswith("raised"), r["load"]  # never a silent one-shard load
    assert r["full"], "overlap.full_state_dict did not load into the plain model as it was"


# ---------------------------------------------------------------- unshard / reshard


def unshard_and_reshard(rank: int, world: int) -> dict:
    base = tiny_lm()
    ref = DDP(copy.deepcopy(base))
    ours = overlap.wrap(base)
    state = ours._overlap_state
    non_root = [i for i in range(len(state.units)) if i != state.root_unit]
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    mismatches: list[str] = []

    def train(step: int) -> None:
        x = batch(base, rank, step)
        loss_of(ref(x)).backward()
        loss_of(ours(x)).backward()
        step_both(ref_opt, opt)
        mismatches.extend(_mismatches(f"step {step} param", ref.module, ours, rank, world, grads=False))

    train(0)
    probe = batch(base, 0, 99)
    with torch.no_grad():
        expected = ours(probe)
    ours.unshard()
    held = state.schedule.held_units()
    unsharded_bytes = overlap.memory_stats(ours).bytes["unsharded"]
    gathers, original = _counting("all_gather_flat")
    pair_gathers, original_pair = _counting("all_gather_pair")  # [Note: gather of a pair]
    try:
        with torch.no_grad():
            outputs = [ours(probe) for _ in range(3)]
    finally:
        comm.all_gather_flat, comm.all_gather_pair = original, original_pair
    gathers += pair_gathers
    same = all(torch.equal(out, expected) for out in outputs)
    held_after_forwards = state.schedule.held_units()
    ours.reshard()
    freed = (state.schedule.held_units(), overlap.memory_stats(ours).bytes["unsharded"])

    ours.unshard()
    train(1)  # a training step on the unsharded model: its backward reshards
    after_backward = state.schedule.held_units()
    train(2)  # and the next step gathers as usual
    x = batch(base, rank, 3)
    loss = loss_of(ours(x))
    try:
        ours.unshard()
        mid_step = None
    except ValueError as e:
        mid_step = str(e)
    loss.backward()
    opt.zero_grad()
    return {
        "non_root": non_root,
        "held": held,
        "unsharded_bytes": unsharded_bytes,
        "unit_bytes": sum(u.unsharded_nbytes for u in state.units),
        "gathers": len(gathers),
        "same": same,
        "held_after_forwards": held_after_forwards,
        "freed": freed,
        "after_backward": after_backward,
        "mid_step": mid_step,
        "mismatches": mismatches,
    }


def test_unshard_keeps_every_unit_until_reshard(world2):
    for rank, r in enumerate(world2.run(unshard_and_reshard)):
        assert r["held"] == r["non_root"] == r["held_after_forwards"], (rank, r)
        assert r["unsharded_bytes"] == r["unit_bytes"], (rank, r)
        assert r["gathers"] == 0, (rank, "forwards after unshard() gathered", r)
        assert r["same"], (rank, "forward after unshard() differs from a normal forward")
        assert r["freed"] == ([], 0), (rank, r)
        assert r["after_backward"] == [], (rank, r)
        assert r["mid_step"] and "between steps" in r["mid_step"], (rank, r)
        assert not r["mismatches"], f"rank {rank}:\n" + "\n".join(r["mismatches"])


# ---------------------------------------------------------------- 0-dim parameters


def scalars_like_ddp(rank: int, world: int) -> dict:
    """ScaledLM, whose 0-dim parameters start different on rank 1, trained 3 AdamW steps: they
    start from rank 0's values, stay whole on every rank, and every loss, gradient and
    parameter is bitwise DDP's (find_unused_parameters=True); then a checkpoint round trip."""
    base = scaled_lm()
    with torch.no_grad():
        for name in SCALARS:
            base.get_parameter(name).add_(rank)  # a per-rank seed: wrap must take rank 0's
    ref = DDP(copy.deepcopy(base), find_unused_parameters=True)
    ours = overlap.wrap(base)
    initial = {name: ours.get_parameter(name).item() for name in SCALARS}
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2, weight_decay=0.1)
    mismatches = []
    for step in range(3):
        x = batch(base, rank, step)
        ref_loss, loss = backward_both(ref, ours, x)
        if not torch.equal(loss, ref_loss):
            mismatches.append(f"step {step} loss {loss.item()} vs {ref_loss.item()}")
        mismatches += _mismatches(f"step {step} grad", ref.module, ours, rank, world, grads=True)
        step_both(ref_opt, opt)
        mismatches += _mismatches(f"step {step} param", ref.module, ours, rank, world, grads=False)
    full = overlap.full_state_dict(ours, rank0_only=False)
    want = {k: v.detach() for k, v in ref.module.state_dict().items()}
    full_ok = all(torch.equal(full[k], want[k]) for k in want)
    return {
        "initial": initial,
        "kinds": {n: type(p).__name__ for n, p in ours.named_parameters() if n in SCALARS},
        "num_params": (len(list(ours.parameters())), len(list(ref.parameters()))),
        "unused_grad": ours.unused.grad,
        "mismatches": mismatches,
        "full": full_ok,
    }


def test_scalar_parameters_train_like_ddp_bitwise(world2):
    want = {name: scaled_lm().get_parameter(name).item() for name in SCALARS}
    for rank, r in enumerate(world2.run(scalars_like_ddp)):
        assert r["initial"] == want, (rank, "0-dim parameters did not start from rank 0's", r)
        assert set(r["kinds"].values()) == {"Parameter"}, (rank, r["kinds"])
        assert r["num_params"][0] == r["num_params"][1], (rank, r)
        assert r["unused_grad"] is None, (rank, r)
        assert not r["mismatches"], f"rank {rank}:\n" + "\n".join(r["mismatches"])
        assert r["full"], rank


def scalars_hsdp(rank: int, world: int) -> dict:
    """On a (2, 2) mesh the 0-dim parameters' gradients are averaged over all 4 ranks."""
    mesh = init_device_mesh("cpu", (2, 2))
    base = scaled_lm()
    ref = DDP(copy.deepcopy(base), find_unused_parameters=True)
    ours = overlap.wrap(base, group=mesh)
    x = batch(base, rank, 0)
    loss_of(ref(x)).backward()
    loss_of(ours(x)).backward()
    worst = 0.0
    for name in SCALARS:
        mine, theirs = ours.get_parameter(name).grad, ref.module.get_parameter(name).grad
        if mine is None or theirs is None:
            assert mine is None and theirs is None, (rank, name)
            continue
        worst = max(worst, ((mine - theirs).abs() / theirs.abs()).item())
    return {"worst": worst}


def test_scalar_gradients_are_averaged_over_the_whole_hsdp_mesh(world4):
    for rank, r in enumerate(world4.run(scalars_hsdp)):
        assert r["worst"] <= 1e-6, (rank, r)  # 4 ranks: the sum's order may differ from DDP's


def moves_after_wrap(rank: int, world: int) -> dict:
    model = overlap.wrap(encoder_stack())

    def where(m: nn.Module) -> list[tuple[int, int]]:  # each parameter's object and memory
        return [(id(p), (p.to_local() if isinstance(p, DTensor) else p).data_ptr()) for p in m.parameters()]

    before = where(model)
    for move in (lambda m: m.to("cpu"), lambda m: m.to("cpu:0"), lambda m: m.float(), lambda m: m.cpu()):
        assert move(model) is model
    same = where(model) == before
    errors = []
    for move in (lambda m: m.double(), lambda m: m.half(), lambda m: m.to(torch.bfloat16)):
        try:
            move(model)
        except ValueError as e:
            errors.append(str(e))
    dtypes = {p.dtype for p in model.parameters()}
    loss_of(model(batch(model, rank, 0))).backward()  # still trains
    return {"same": same, "errors": errors, "dtypes": dtypes}


def test_moves_after_wrap_are_no_ops_or_raise(world2):
    """[Note: no moves after wrap]: `.to()` of the device the model is on keeps the very same
    shards (a DTensor's `.to("cpu:0")` would copy them and train the copies); casts raise."""
    for r in world2.run(moves_after_wrap, timeout_s=180):
        assert r["same"], r
        assert len(r["errors"]) == 3 and all("cannot be moved or cast" in e for e in r["errors"]), r
        assert r["dtypes"] == {torch.float32}, r
