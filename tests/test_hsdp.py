"""Hybrid sharding (HSDP): a 2-D mesh (replicate x shard) trains as DDP over every rank.

World size 4 as 2 replicas x 2 shards on gloo: all-gathers and reduce-scatters run inside each
shard pair, reduced shards are all-reduced across the replica pair. The sums run in another order
than DDP's four-way all-reduce, so results agree to rounding (SGD, as in test_parity's world-4
tests: Adam would amplify rounding of near-zero gradients).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.nn.parallel import DistributedDataParallel as DDP

import overlap
from models import batch, loss_of, tiny_lm

TOL = 1e-6


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return (a.float() - b.float()).abs().max().item() / max(a.abs().max().item(), 1e-12)


def _rows(full: torch.Tensor, local: torch.Tensor, shard_rank: int, num_shards: int) -> torch.Tensor:
    rows = -(-full.shape[0] // num_shards)
    return full[shard_rank * rows : shard_rank * rows + local.shape[0]]


def hsdp_vs_ddp(rank: int, world: int, config: dict, steps: int = 3) -> dict:
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    shard_rank = mesh.get_local_rank(1)
    base = tiny_lm()
    ref = DDP(copy.deepcopy(base))
    ours = overlap.wrap(base, group=mesh, **config)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    opt = torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9)
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    for step in range(steps):
        x = batch(base, rank, step)
        ref_loss = loss_of(ref(x))
        ref_loss.backward()
        loss = loss_of(ours(x))
        loss.backward()
        worst["loss"] = max(worst["loss"], _rel(ref_loss.detach(), loss.detach()))
        named_ref = dict(ref.module.named_parameters())
        for name, p in ours.named_parameters():
            assert isinstance(p, DTensor) and p.placements == (Replicate(), Shard(0)), (name, p.placements)
            assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements, name
            g = p.grad.to_local()
            worst["grad"] = max(worst["grad"], _rel(_rows(named_ref[name].grad, g, shard_rank, 2), g))
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)
        for name, p in ours.named_parameters():
            local = p.detach().to_local()
            worst["param"] = max(worst["param"], _rel(_rows(named_ref[name].detach(), local, shard_rank, 2), local))
    full = overlap.full_state_dict(ours, rank0_only=False)
    plain = ref.module.state_dict()
    worst["full_state"] = max(_rel(plain[k], v) for k, v in full.items())
    stats = overlap.step_stats(ours)
    return {**worst, "counts": (stats.num_reduce_scatters, stats.num_allreduces)}


@pytest.mark.parametrize(
    "config",
    [
        pytest.param({}, id="default"),
        pytest.param({"prefetch_depth": 2, "reduce_scatter_bucket_bytes": 6000}, id="bucketed"),
        pytest.param({"reshard_after_forward": False}, id="zero2"),
        pytest.param({"reduce_scatter_impl": "native"}, id="native-reduce-scatter"),
    ],
)
def test_hsdp_2x2_matches_ddp(world4, config):
    results = world4.run(hsdp_vs_ddp, config=config)
    for rank, r in enumerate(results):
        assert all(r[k] <= TOL for k in ("loss", "grad", "param", "full_state")), (rank, r)
        num_reduce_scatters, num_allreduces = r["counts"]
        assert num_allreduces == num_reduce_scatters > 0, (rank, r)  # one all-reduce per bucket


def hsdp_int8_grads(rank: int, world: int) -> float:
    """int8 gradients inside the shard group, exact all-reduce across replicas: close to DDP."""
    mesh = init_device_mesh("cpu", (2, world // 2))
    base = tiny_lm()
    ref = DDP(copy.deepcopy(base))
    ours = overlap.wrap(base, group=mesh, grad_compression="int8", error_feedback=True)
    x = batch(base, rank, 0)
    loss_of(ref(x)).backward()
    loss_of(ours(x)).backward()
    shard_rank = mesh.get_local_rank(1)
    named_ref = dict(ref.module.named_parameters())
    worst = 0.0
    for name, p in ours.named_parameters():
        g = p.grad.to_local()
        worst = max(worst, _rel(_rows(named_ref[name].grad, g, shard_rank, 2), g))
    return worst


def test_hsdp_with_compressed_gradients(world4):
    results = world4.run(hsdp_int8_grads)
    assert all(0 < r < 0.05 for r in results), results


def replicas_agree(rank: int, world: int) -> bool:
    """After training, both replicas of each shard hold the same bytes (the all-reduce ran)."""
    mesh = init_device_mesh("cpu", (2, world // 2))
    base = tiny_lm()
    ours = overlap.wrap(base, group=mesh, prefetch_depth=2)
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    for step in range(2):
        loss_of(ours(batch(base, rank, step))).backward()  # different data on every rank
        opt.step()
        opt.zero_grad()
    flat = torch.cat([p.detach().to_local().reshape(-1) for p in ours.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(gathered, flat, group=mesh.get_group(0))
    return bool(torch.equal(gathered[0], gathered[1]))


def test_replicas_stay_identical(world4):
    assert all(world4.run(replicas_agree))


def bad_mesh(rank: int, world: int) -> str:
    mesh = init_device_mesh("cpu", (1, 2, 2))
    try:
        overlap.wrap(tiny_lm(), group=mesh)
    except ValueError as e:
        return str(e)
    return ""


def test_three_dim_mesh_is_refused(world4):
    for message in world4.run(bad_mesh):
        assert "2-D mesh (replicate, shard)" in message
