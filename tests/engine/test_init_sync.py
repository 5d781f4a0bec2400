"""DDP's promise at wrap: every rank starts from rank 0's parameters and buffers.

Ranks seed differently before building the model, as many DDP scripts do. With the default
`sync_module_states=True`, `overlap.wrap` scatters each unit's shards from rank 0 and broadcasts
the buffers, so training matches DDP (which broadcasts rank 0's module at construction) bitwise
at world size 2, and every replica of a 2x2 HSDP mesh holds global rank 0's values. With
`sync_module_states=False` each rank keeps its own rows. Also: full state dicts loaded from
rank 0 only, and optimizers built before wrap refusing to step.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from helpers.probes import error_of
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

import overlap

DIM = 13  # odd: dim 0 of most parameters pads at 2 and 4 shards


class NormBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim + 1)
        self.norm = nn.BatchNorm1d(2 * dim + 1)
        self.down = nn.Linear(2 * dim + 1, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.norm(self.up(x))))


class NormNet(nn.Module):
    """Root parameters, repeated blocks with BatchNorm buffers, and a random buffer of its own."""

    def __init__(self, dim: int = DIM, layers: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList([NormBlock(dim) for _ in range(layers)])
        self.head = nn.Linear(dim, 3)
        self.register_buffer("scale", torch.rand(dim) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x) * self.scale
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def seeded_per_rank(rank: int) -> NormNet:
    """The model as a DDP script that seeds each rank differently builds it; one forward with
    rank-dependent data moves the BatchNorm running stats apart too."""
    torch.manual_seed(100 + rank)
    model = NormNet()
    with torch.no_grad():
        model(torch.randn(8, DIM))
    return model


def _x(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, DIM, generator=torch.Generator().manual_seed(1000 * step + rank))


def ddp_syncing_buffers_at_init_only(module: nn.Module) -> DDP:
    """DDP that broadcasts rank 0's parameters and buffers at construction only, as wrap does;
    each rank's running stats then move with its own batches in both. torch 2.13 names this
    `forward_sync_buffers=False` (its `broadcast_buffers=False` skips the sync at init too);
    torch 2.11 `broadcast_buffers=False`."""
    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:
        return DDP(module, forward_sync_buffers=False)
    return DDP(module, broadcast_buffers=False)


def _rows(full: torch.Tensor, local: torch.Tensor, shard_rank: int, num_shards: int) -> torch.Tensor:
    rows = -(-full.shape[0] // num_shards)
    return full[shard_rank * rows : shard_rank * rows + local.shape[0]]


def _same_state(ours: nn.Module, expected: dict[str, torch.Tensor]) -> list[str]:
    full = overlap.full_state_dict(ours, rank0_only=False)
    assert set(full) == set(expected)
    return [k for k, v in expected.items() if not torch.equal(full[k], v)]


def ddp_parity(rank: int, world: int, steps: int = 4) -> dict:
    base = seeded_per_rank(rank)
    own = {k: v.clone() for k, v in base.state_dict().items()}
    ref = ddp_syncing_buffers_at_init_only(copy.deepcopy(base))
    ours = overlap.wrap(base)
    rank0 = {k: v.clone() for k, v in ref.module.state_dict().items()}
    differs_from_own = sorted(k for k in own if not torch.equal(own[k], rank0[k]))
    mismatched = _same_state(ours, rank0)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2, weight_decay=0.1)
    named_ref = dict(ref.module.named_parameters())
    bitwise = []
    for step in range(steps):
        x = _x(rank, step)
        ref_loss = ref(x).pow(2).mean()
        ref_loss.backward()
        loss = ours(x).pow(2).mean()
        loss.backward()
        same = torch.equal(loss, ref_loss)
        for name, p in ours.named_parameters():
            g = p.grad.to_local()
            same &= torch.equal(_rows(named_ref[name].grad, g, rank, world), g)
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
        for name, p in ours.named_parameters():
            local = p.detach().to_local()
            same &= torch.equal(_rows(named_ref[name].detach(), local, rank, world), local)
        for name, b in ours.named_buffers():
            same &= torch.equal(b, dict(ref.module.named_buffers())[name])
        bitwise.append(bool(same))
    return {"differs_from_own": differs_from_own, "mismatched": mismatched, "bitwise": bitwise}


def test_ranks_seeded_differently_train_like_ddp(world2):
    results = world2.run(ddp_parity, timeout_s=240)
    assert results[0]["differs_from_own"] == []
    # the test means something: rank 1 built other values (parameters and buffers)
    assert {"inp.weight", "scale", "blocks.0.norm.running_mean"} <= set(results[1]["differs_from_own"])
    for rank, r in enumerate(results):
        assert r["mismatched"] == [], (rank, r["mismatched"])
        assert all(r["bitwise"]), (rank, r["bitwise"])


def opt_out_keeps_own_values(rank: int, world: int) -> dict:
    base = seeded_per_rank(rank)
    own = {k: v.clone() for k, v in base.state_dict().items()}
    ours = overlap.wrap(base, sync_module_states=False)
    wrong = []
    for name, p in ours.named_parameters():
        local = p.detach().to_local()
        if not torch.equal(local, _rows(own[name], local, rank, world)):
            wrong.append(name)
    wrong += [name for name, b in ours.named_buffers() if not torch.equal(b, own[name])]
    return {"wrong": wrong}


def test_opt_out_keeps_each_ranks_own_values(world2):
    for rank, r in enumerate(world2.run(opt_out_keeps_own_values)):
        assert r["wrong"] == [], (rank, r)


def deferred_from_rank0(rank: int, world: int) -> dict:
    """A meta-device model under rank-dependent seeds: rank 0 initializes, the others receive."""
    calls = []

    def init(module: nn.Module) -> None:
        calls.append(type(module).__name__)
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()

    torch.manual_seed(100)
    expected = NormNet().state_dict()  # what rank 0 draws
    with torch.device("meta"):
        meta = NormNet()
    torch.manual_seed(100 + rank)
    ours = overlap.wrap(meta, param_init_fn=init)
    full = overlap.full_state_dict(ours, rank0_only=False)
    # buffers that no init sets (`scale`) are uninitialized on the source: compare the rest
    mismatched = [k for k, v in expected.items() if k != "scale" and not torch.equal(full[k], v)]
    scale_on_rank0 = ours.scale.clone()
    dist.broadcast(scale_on_rank0, src=0)
    return {
        "mismatched": mismatched,
        "num_init_calls": len(calls),
        "scale_same": torch.equal(scale_on_rank0, ours.scale),
    }


def test_deferred_init_runs_on_rank0_only(world2):
    results = world2.run(deferred_from_rank0)
    for rank, r in enumerate(results):
        assert r["mismatched"] == [] and r["scale_same"], (rank, r)
    assert results[0]["num_init_calls"] > 0 and results[1]["num_init_calls"] == 0, results


def hsdp_from_rank0(rank: int, world: int, sync: bool, deferred: bool, steps: int = 3) -> dict:
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    shard_rank = mesh.get_local_rank(1)
    if deferred:
        torch.manual_seed(100)
        rank0 = NormNet().state_dict()
        with torch.device("meta"):
            base = NormNet()
        torch.manual_seed(100 + rank)
        ours = overlap.wrap(base, group=mesh, sync_module_states=sync)
        full = overlap.full_state_dict(ours, rank0_only=False)
        return {"mismatched": [k for k, v in rank0.items() if k != "scale" and not torch.equal(full[k], v)]}
    base = seeded_per_rank(rank)
    own = {k: v.clone() for k, v in base.state_dict().items()}
    ref = ddp_syncing_buffers_at_init_only(copy.deepcopy(base))  # rank 0's values everywhere
    ours = overlap.wrap(base, group=mesh, sync_module_states=sync)
    if not sync:
        wrong = [
            name
            for name, p in ours.named_parameters()
            if not torch.equal(p.to_local(), _rows(own[name], p.to_local(), shard_rank, 2))
        ]
        return {"wrong": wrong + [n for n, b in ours.named_buffers() if not torch.equal(b, own[n])]}
    mismatched = _same_state(ours, ref.module.state_dict())
    # training: the HSDP sums run in another order than DDP's 4-way all-reduce (see test_hsdp)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    opt = torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9)
    worst = 0.0
    for step in range(steps):
        x = _x(rank, step)
        ref(x).pow(2).mean().backward()
        ours(x).pow(2).mean().backward()
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
        named = dict(ref.module.named_parameters())
        for name, p in ours.named_parameters():
            local = p.detach().to_local()
            expected = _rows(named[name].detach(), local, shard_rank, 2)
            worst = max(worst, ((local - expected).abs().max() / expected.abs().max()).item())
    return {"mismatched": mismatched, "worst": worst}


@pytest.mark.parametrize("deferred", [False, True], ids=["eager", "meta"])
def test_hsdp_replicas_start_from_global_rank0(world4, deferred):
    for rank, r in enumerate(world4.run(hsdp_from_rank0, timeout_s=240, sync=True, deferred=deferred)):
        assert r["mismatched"] == [], (rank, r)
        assert r.get("worst", 0.0) <= 1e-6, (rank, r)


def test_hsdp_opt_out_keeps_each_ranks_own_values(world4):
    for rank, r in enumerate(world4.run(hsdp_from_rank0, sync=False, deferred=False)):
        assert r["wrong"] == [], (rank, r)


def load_from_rank0(rank: int, world: int, hsdp: bool) -> dict:
    group = init_device_mesh("cpu", (2, world // 2)) if hsdp else None
    ours = overlap.wrap(seeded_per_rank(rank), group=group)
    torch.manual_seed(7)
    checkpoint = NormNet().state_dict()  # every rank knows it here, to check; only rank 0 passes it
    overlap.load_full_state_dict(ours, checkpoint if rank == 0 else None)
    out: dict = {"full": _same_state(ours, checkpoint)}
    # strict=False with one parameter of a unit missing: that slot keeps its values, the rest load
    before = overlap.full_state_dict(ours, rank0_only=False)
    torch.manual_seed(8)
    partial = {k: v for k, v in NormNet().state_dict().items() if k != "blocks.1.up.weight"}
    overlap.load_full_state_dict(ours, partial if rank == 0 else None, strict=False)
    expected = {**partial, "blocks.1.up.weight": before["blocks.1.up.weight"]}
    out["partial"] = _same_state(ours, expected)
    # a checkpoint that is wrong on rank 0 raises on every rank (no rank waits in a scatter)
    messages = []
    bad = {**checkpoint, "head.weight": torch.zeros(4, DIM)}
    for wrong in ({k: v for k, v in checkpoint.items() if k != "inp.bias"}, bad, None):
        try:
            overlap.load_full_state_dict(ours, wrong if rank == 0 else checkpoint)
        except ValueError as e:
            messages.append(str(e))
    out["messages"] = messages
    return out


@pytest.mark.parametrize("world_name", ["world2", "world4"])
def test_load_full_state_dict_from_rank0_only(request, world_name):
    world = request.getfixturevalue(world_name)
    for rank, r in enumerate(world.run(load_from_rank0, timeout_s=240, hsdp=world_name == "world4")):
        assert r["full"] == [] and r["partial"] == [], (rank, r)
        assert len(r["messages"]) == 3, (rank, r["messages"])
        assert "missing keys ['inp.bias']" in r["messages"][0], r["messages"][0]
        assert "'head.weight' has shape (4, 13)" in r["messages"][1], r["messages"][1]
        assert "state_dict=None" in r["messages"][2], r["messages"][2]


def full_state_dict_rank0(rank: int, world: int, hsdp: bool) -> dict:
    group = init_device_mesh("cpu", (2, world // 2)) if hsdp else None
    ours = overlap.wrap(seeded_per_rank(rank), group=group)
    everywhere = overlap.full_state_dict(ours, rank0_only=False)
    only0 = overlap.full_state_dict(ours)
    if rank != 0:
        return {"empty": only0 == {}}
    same = list(only0) == list(everywhere) and all(torch.equal(only0[k], everywhere[k]) for k in only0)
    fresh = NormNet()
    fresh.load_state_dict(only0)  # strict: the plain model takes it
    return {"same": same}


@pytest.mark.parametrize("world_name", ["world2", "world4"])
def test_full_state_dict_gathers_to_rank0(request, world_name):
    world = request.getfixturevalue(world_name)
    first, *others = world.run(full_state_dict_rank0, hsdp=world_name == "world4")
    assert first["same"] and all(r["empty"] for r in others), (first, others)


def buffer_mismatch(rank: int, world: int) -> str:
    model = NormNet()
    model.register_buffer("extra", torch.zeros(2 + rank))
    return error_of(overlap.wrap, model)


def test_buffer_mismatch_raises_on_every_rank(world2):
    for message in world2.run(buffer_mismatch, timeout_s=60):
        assert "differs across ranks" in message and "buffer" in message, message


def optimizer_built_before_wrap(rank: int, world: int) -> dict:
    model = seeded_per_rank(rank)
    early = torch.optim.AdamW(model.parameters(), lr=1e-2)
    early.step()  # fine before wrap (and checked: the check must run again after wrap)
    model = overlap.wrap(model)
    model(_x(rank, 0)).pow(2).mean().backward()
    out = {}
    try:
        early.step()
        out["early"] = "no error"
    except RuntimeError as e:
        out["early"] = str(e)
    late = torch.optim.AdamW(model.parameters(), lr=1e-2)
    late.step()  # built after wrap: fine, and still fine on later steps
    late.step()
    late.add_param_group({"params": [nn.Linear(2, 2).weight]})
    late.step()
    stale = torch.optim.SGD(model.parameters(), lr=0.1)
    stale.step()
    stale.add_param_group({"params": list(early.param_groups[0]["params"][:1])})
    try:
        stale.step()
        out["added"] = "no error"
    except RuntimeError as e:
        out["added"] = str(e)
    return out


def test_optimizer_built_before_wrap_raises_on_every_rank(world2):
    for r in world2.run(optimizer_built_before_wrap, timeout_s=60):
        assert "Build the optimizer after overlap.wrap" in r["early"], r
        assert "'inp.weight'" in r["early"] and "holds 22 parameter(s)" in r["early"], r
        assert "holds 1 parameter(s)" in r["added"], r
