"""Units whose parameters have several dtypes ([Note: one dtype per unit] in overlap/engine/units.py):
a block holding bf16 Linear weights, fp32 LayerNorm parameters and an fp16 gain becomes one unit
per dtype, each parameter keeps its dtype, and training equals DDP's.

World size 2: bitwise every step (losses, gradient and parameter shards), with SGD and AdamW. DDP
buckets by dtype and all-reduces bf16 and fp16 gradients in their own dtype as g/2 + g/2; here
a unit's gradients are summed in its dtype (or, in a bucket with an fp32 unit, in fp32 and
rounded once: at two ranks the same value, see runtime._widest) and then halved, which is
exact. World size 4 (HSDP) sums in another order than DDP's ring: the gradient and parameter
shards agree to a few units in the last place of their own dtype.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers.models import TinyLM, backward_both, batch, loss_of, step_both
from helpers.probes import identity_codecs
from helpers.tolerance import max_rel_diff, shard_rows
from test_parity import bf16_compute_vs_reference
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.nn.parallel import DistributedDataParallel as DDP

import overlap
from overlap import checkpoint


class MixedBlock(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(1 + 0.1 * torch.randn(dim))  # fp16 (registered first: own parameters come first)
        self.norm = nn.LayerNorm(dim)  # fp32
        self.up = nn.Linear(dim, hidden)  # bf16
        self.down = nn.Linear(hidden, dim)  # bf16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(F.gelu(self.up(self.norm(x))))
        return x + h * self.gain.to(h.dtype)


class MixedLM(TinyLM):
    """TinyLM (models.py) with blocks of three dtypes and a root of two (see `to_mixed`)."""

    def __init__(self, vocab: int = 37, dim: int = 24, hidden: int = 30, layers: int = 3) -> None:
        super().__init__(vocab, dim, hidden, layers, block=MixedBlock)


def to_mixed(model: MixedLM, fp32_root_norm: bool = True) -> MixedLM:
    """The usual recipe: the whole model to bf16, then the LayerNorms back to fp32 (and the
    gains to fp16)."""
    model.to(torch.bfloat16)
    for module in model.modules():
        if isinstance(module, nn.LayerNorm) and (fp32_root_norm or module is not model.norm):
            module.float()
        if isinstance(module, MixedBlock):
            module.gain.data = module.gain.data.half()
    return model


def mixed_lm(seed: int = 0, fp32_root_norm: bool = True) -> MixedLM:
    torch.manual_seed(seed)
    return to_mixed(MixedLM(), fp32_root_norm)


def _optim(name: str, params) -> torch.optim.Optimizer:
    if name == "adamw":  # eps representable in fp16 (1e-8 is 0 there: 0/0 in Adam's first step)
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-3)
    # lr a power of two: torch's CPU `add_(x, alpha=a)` on bf16/fp16 rounds `a * x` in its scalar
    # tail loop but not in its vectorized body, so the same element of a parameter updates
    # differently in DDP's whole tensor and in a shard (1 ulp, found here at step 3); with a
    # power-of-two alpha the product is exact and both paths agree.
    return torch.optim.SGD(params, lr=2**-4, momentum=0.9)


def _ulps(ref: torch.Tensor, ours: torch.Tensor) -> float:
    """Largest difference in units of the dtype's epsilon relative to the tensor's largest value."""
    return max_rel_diff(ref, ours) / torch.finfo(ref.dtype).eps


def _compare(
    rank: int, world: int, ref: nn.Module, ours: nn.Module, grads: bool, out: dict, shard_rank: int, num_shards: int
) -> None:
    named = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        theirs = named[name].grad if grads else named[name].detach()
        mine = p.grad if grads else p.detach()
        assert p.dtype == named[name].dtype, (rank, name, p.dtype, named[name].dtype)
        if mine is None or theirs is None:
            assert mine is None and theirs is None, (rank, name)
            continue
        assert mine.dtype == theirs.dtype, (rank, name, mine.dtype)
        local = mine.to_local()
        rows = shard_rows(theirs, local, shard_rank, num_shards)
        out["bitwise"] &= bool(torch.equal(rows, local))
        key = "grad_ulps" if grads else "param_ulps"
        out[key] = max(out[key], _ulps(rows, local))


def mixed_vs_ddp(rank: int, world: int, config: dict, optim: str = "adamw", steps: int = 3, fp32_root_norm: bool = True,
                 freeze_norms: bool = False, identity_path: bool = False, hsdp: bool = False) -> dict:  # fmt: skip
    base = mixed_lm(fp32_root_norm=fp32_root_norm)
    if freeze_norms:  # the fp32 units then have no gradient at all
        for module in base.modules():
            if isinstance(module, nn.LayerNorm):
                module.requires_grad_(False)
    originals = {name: p.dtype for name, p in base.named_parameters()}
    ref = DDP(copy.deepcopy(base))
    shard_rank, num_shards = rank, world
    if hsdp:
        mesh = init_device_mesh("cpu", (2, world // 2))
        config = {**config, "group": mesh}
        shard_rank, num_shards = mesh.get_local_rank(1), world // 2
    ours = overlap.wrap(base, **config)
    if identity_path:  # the compressed code path with a codec that changes nothing
        identity_codecs(ours)
    units = ours._overlap_state.units
    out = {
        "labels": [u.layout.label for u in units],
        "unit_dtypes": [{str(p.dtype) for p in u.sharded_params} | {str(u.shard.dtype)} for u in units],
        "dtypes_kept": all(p.dtype == originals[n] for n, p in ours.named_parameters()),
        "placements": {tuple(map(str, p.placements)) for p in ours.parameters()},
        "bitwise": True,
        "loss": 0.0,
        "grad_ulps": 0.0,
        "param_ulps": 0.0,
        "losses": [],
    }
    ref_opt, opt = _optim(optim, ref.parameters()), _optim(optim, ours.parameters())
    for step in range(steps):
        x = batch(base, rank, step)
        ref_loss, loss = backward_both(ref, ours, x)
        out["bitwise"] &= bool(torch.equal(loss, ref_loss))
        out["loss"] = max(out["loss"], max_rel_diff(ref_loss.detach(), loss.detach()))
        out["losses"].append(loss.item())
        _compare(rank, world, ref.module, ours, True, out, shard_rank, num_shards)
        step_both(ref_opt, opt)
        _compare(rank, world, ref.module, ours, False, out, shard_rank, num_shards)
    out["optim_dtypes_kept"] = all(
        v.dtype == p.dtype for p in ours.parameters() for k, v in opt.state[p].items() if k != "step"
    )
    return out


def test_a_block_of_three_dtypes_becomes_three_units(world2):
    for rank, r in enumerate(world2.run(mixed_vs_ddp, config={}, steps=1)):
        assert r["labels"][:2] == ["root (bfloat16)", "unit1 (root, float32)"], r["labels"]
        assert r["labels"][2:5] == [
            "unit2 (blocks.0, float16)",
            "unit3 (blocks.0, float32)",
            "unit4 (blocks.0, bfloat16)",
        ], r["labels"]
        assert len(r["labels"]) == 2 + 3 * 3, r["labels"]
        assert all(len(dtypes) == 1 for dtypes in r["unit_dtypes"]), r["unit_dtypes"]
        assert r["dtypes_kept"] and r["bitwise"], (rank, r)


CONFIGS = [
    pytest.param({}, {}, id="default"),
    pytest.param({"prefetch_depth": 0}, {}, id="no-prefetch"),
    pytest.param({"prefetch_depth": 3, "max_inflight_allgather_bytes": 3000}, {}, id="byte-cap"),
    # a bf16 unit's gradients first in a bucket with an fp32 unit's: reduced in fp32
    pytest.param({"reduce_scatter_bucket_bytes": 3200}, {"fp32_root_norm": False}, id="bf16-fp32-bucket"),
    pytest.param({"reduce_scatter_bucket_bytes": 100_000}, {}, id="one-bucket"),
    pytest.param({"reshard_after_forward": False, "min_unit_numel": 3000}, {}, id="zero2-merged"),
    pytest.param({"reduce_scatter_impl": "native"}, {}, id="native-reduce-scatter"),
    pytest.param({}, {"freeze_norms": True}, id="fp32-units-frozen"),
    pytest.param({}, {"identity_path": True}, id="compressed-path-identity"),
]


@pytest.mark.parametrize("optim", ["adamw", "sgd"])
@pytest.mark.parametrize("config,options", CONFIGS)
def test_mixed_dtypes_bitwise_like_ddp(world2, config, options, optim):
    for rank, r in enumerate(world2.run(mixed_vs_ddp, config=config, optim=optim, **options)):
        assert r["bitwise"], (rank, {k: v for k, v in r.items() if k != "labels"})
        assert r["dtypes_kept"] and r["optim_dtypes_kept"], (rank, r)


@pytest.mark.parametrize(
    "config,loss_tol",
    [
        ({"grad_compression": "int8", "error_feedback": True}, 0.05),
        ({"param_compression": "int8"}, 0.05),
        ({"param_compression": "bf16", "grad_compression": "bf16"}, 0.05),
    ],
)
def test_mixed_dtypes_with_codecs_stay_close_to_ddp(world2, config, loss_tol):
    for rank, r in enumerate(world2.run(mixed_vs_ddp, config=config, steps=4)):
        assert r["loss"] < loss_tol and r["dtypes_kept"], (rank, config, r["loss"], r["losses"])


def test_hsdp_mixed_dtypes_agree_with_ddp_to_rounding(world4):
    for rank, r in enumerate(world4.run(mixed_vs_ddp, config={}, optim="sgd", hsdp=True, steps=1)):
        assert r["placements"] == {(str(Replicate()), str(Shard(0)))}, r["placements"]
        assert r["dtypes_kept"], (rank, r)
        # a few ulps of each tensor's own dtype: a fp32 gradient reduced in bf16 would be ~2^16
        assert r["grad_ulps"] <= 8 and r["param_ulps"] <= 8, (rank, r["grad_ulps"], r["param_ulps"])


def mixed_precision_vs_reference(rank: int, world: int, steps: int = 3) -> dict:
    """param_dtype=bf16, reduce_dtype=fp32 on a mixed model: every parameter is gathered and
    computed in bf16, gradients are reduced in fp32, and each master shard keeps its own dtype
    (bf16 weights, fp32 norms, fp16 gains). The reference does exactly that by hand."""
    return bf16_compute_vs_reference(rank, world, mixed_lm(), lambda ps: _optim("sgd", ps), steps)


def test_param_dtype_applies_to_every_unit_of_a_mixed_model(world2):
    assert all(r["bitwise"] for r in world2.run(mixed_precision_vs_reference))


def checkpoint_roundtrip(rank: int, world: int, root: str) -> dict:
    """Save after 2 AdamW steps; a fresh model (other values) loading it continues with the
    uninterrupted run's losses, bitwise; the full state dict on rank 0 is DDP's, dtypes kept."""

    def step(model: nn.Module, opt: torch.optim.Optimizer, i: int) -> float:
        loss = loss_of(model(batch(getattr(model, "module", model), rank, i)))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    base = mixed_lm()
    ref = DDP(copy.deepcopy(base))
    ours = overlap.wrap(base)
    opt, ref_opt = _optim("adamw", ours.parameters()), _optim("adamw", ref.parameters())
    for i in range(2):
        step(ours, opt, i)
        step(ref, ref_opt, i)
    checkpoint.save(root, ours, opt, step=2)
    full = overlap.full_state_dict(ours)
    plain = ref.module.state_dict()
    full_ok = rank != 0 or (
        set(full) == set(plain) and all(full[k].dtype == v.dtype and torch.equal(full[k], v) for k, v in plain.items())
    )
    uninterrupted = [step(ours, opt, i) for i in (2, 3)]

    fresh = overlap.wrap(mixed_lm(seed=7))
    fresh_opt = _optim("adamw", fresh.parameters())
    checkpoint.load(checkpoint.latest(root), fresh, fresh_opt)
    kept = all(p.dtype == q.dtype for p, q in zip(fresh.parameters(), ours.parameters()))
    kept &= all(v.dtype == p.dtype for p in fresh.parameters() for k, v in fresh_opt.state[p].items() if k != "step")
    resumed = [step(fresh, fresh_opt, i) for i in (2, 3)]

    # the full state dict loads from rank 0 into a fresh model, dtypes and values kept
    other = overlap.wrap(mixed_lm(seed=9))
    overlap.load_full_state_dict(other, full if rank == 0 else None)
    again = overlap.full_state_dict(other)
    reload_ok = rank != 0 or all(again[k].dtype == v.dtype and torch.equal(again[k], v) for k, v in full.items())
    return {"full": full_ok, "resumed": resumed == uninterrupted, "kept": kept, "reload": reload_ok}


def test_checkpoint_and_full_state_dict_roundtrip(world2, tmp_path):
    for rank, r in enumerate(world2.run(checkpoint_roundtrip, root=str(tmp_path))):
        assert all(r.values()), (rank, r)


def _fill(module: nn.Module) -> None:
    """A param_init_fn with values that depend on the parameter's name and dtype only."""
    for name, p in module.named_parameters(recurse=False):
        with torch.no_grad():
            values = torch.arange(p.numel(), dtype=torch.float32).view(p.shape) * 1e-3 + len(name) * 0.1
            p.copy_(values.sin().to(p.dtype))


def seeded_per_rank_and_deferred(rank: int, world: int) -> dict:
    """sync_module_states scatters rank 0's mixed values at wrap; a meta-device mixed model is
    materialized unit by unit in each parameter's own dtype."""
    ours = overlap.wrap(mixed_lm(seed=rank))  # each rank its own values: rank 0's win
    full = overlap.full_state_dict(ours, rank0_only=False)
    want = mixed_lm(seed=0).state_dict()
    synced = all(full[k].dtype == v.dtype and torch.equal(full[k], v) for k, v in want.items())

    with torch.device("meta"):
        meta = to_mixed(MixedLM())
    deferred = overlap.wrap(meta, param_init_fn=_fill, device="cpu")
    plain = to_mixed(MixedLM())
    plain.apply(_fill)
    full = overlap.full_state_dict(deferred, rank0_only=False)
    materialized = all(full[k].dtype == v.dtype and torch.equal(full[k], v) for k, v in plain.state_dict().items())
    loss = loss_of(deferred(batch(deferred, rank, 0)))
    loss.backward()
    ref = DDP(plain)
    ref_loss = loss_of(ref(batch(plain, rank, 0)))
    ref_loss.backward()
    grads = all(
        torch.equal(shard_rows(q.grad, p.grad.to_local(), rank, world), p.grad.to_local())
        for p, q in zip(deferred.parameters(), ref.module.parameters())
    )
    return {"synced": synced, "materialized": materialized, "loss": torch.equal(loss, ref_loss), "grads": grads}


def test_sync_at_wrap_and_deferred_init(world2):
    for rank, r in enumerate(world2.run(seeded_per_rank_and_deferred)):
        assert all(r.values()), (rank, r)


def requires_grad_and_no_sync(rank: int, world: int) -> dict:
    """Freezing the fp32 norms after wrap (through the sharded parameters), and accumulating two
    micro-batches under no_sync, still equal DDP doing the same."""
    base = mixed_lm()
    ref = DDP(copy.deepcopy(base), find_unused_parameters=True)
    ours = overlap.wrap(base)
    opt, ref_opt = _optim("sgd", ours.parameters()), _optim("sgd", ref.parameters())
    bitwise = True
    for step in range(3):
        if step == 1:
            for model in (ours, ref.module):
                for name, p in model.named_parameters():
                    if "norm" in name:
                        p.requires_grad_(False)
        with overlap.no_sync(ours), ref.no_sync():
            loss_of(ours(batch(base, rank, 10 + step))).backward()
            loss_of(ref(batch(base, rank, 10 + step))).backward()
        loss, ref_loss = loss_of(ours(batch(base, rank, step))), loss_of(ref(batch(base, rank, step)))
        loss.backward()
        ref_loss.backward()
        bitwise &= bool(torch.equal(loss, ref_loss))
        step_both(opt, ref_opt)
        for p, q in zip(ours.parameters(), ref.module.parameters()):
            bitwise &= bool(torch.equal(shard_rows(q.detach(), p.to_local(), rank, world), p.to_local()))
    return {"bitwise": bitwise}


def test_requires_grad_changes_and_no_sync(world2):
    assert all(r["bitwise"] for r in world2.run(requires_grad_and_no_sync))
