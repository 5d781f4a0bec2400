"""Composition with tensor parallelism: FSDP x TP on a 2x2 (dp, tp) mesh against FSDP2.

Four gloo ranks, `init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))`; three residual
MLP blocks made tensor-parallel by `parallelize_module` (ColwiseParallel up, RowwiseParallel down),
plus a plain head at the root. overlap wraps with `group=mesh["dp"]`; FSDP2 is `fully_shard(block,
mesh=mesh["dp"])` per block and on the root, on the same mesh, model and batches.

Bitwise ([Note: what is bitwise] in tolerance.py): the forward and backward run the same ops on the
same unsharded values; the dp reduction is a sum of two followed by a division by two on both sides
(a + b == b + a), and the rowwise bias's Partial gradient is all-reduced over tp by the same
redistribute; AdamW is elementwise. So losses, parameters and optimizer state are compared with
`torch.equal` at every step. The clipped run is within `reordered_rtol`: the global norm is a sum
of per-shard partial sums, FSDP2's reference here a norm of per-tensor norms.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import overlap
from tolerance import reordered_mismatches, reordered_rtol

DIM = 16
STEPS = 3
_MESH: list[DeviceMesh] = []  # per rank: one mesh for every check (each builds process groups)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(DIM, DIM)  # plain: sharded over dp only

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _mesh() -> DeviceMesh:
    if not _MESH:
        _MESH.append(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")))
    return _MESH[0]


def _tp_model(mesh: DeviceMesh, plan: dict | None = None) -> Net:
    torch.manual_seed(0)
    model = Net()
    for block in model.layers:
        parallelize_module(block, mesh["tp"], plan or {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model


def _fsdp2(mesh: DeviceMesh) -> Net:
    model = _tp_model(mesh)
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def _batch(mesh: DeviceMesh, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same on both tp ranks of a dp rank (tensor parallelism's contract), other across dp."""
    gen = torch.Generator().manual_seed(100 * step + mesh["dp"].get_local_rank())
    return torch.randn(8, DIM, generator=gen), torch.randn(8, DIM, generator=gen)


def _loss(model: nn.Module, mesh: DeviceMesh, step: int) -> torch.Tensor:
    x, y = _batch(mesh, step)
    return (model(x) - y).pow(2).mean()


def _differences(ours: nn.Module, ref: nn.Module) -> list[str]:
    """Names whose DTensor layout (mesh dims, placements, local shape) or local values differ."""
    bad = []
    theirs = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        q = theirs[name]
        if (p.device_mesh.mesh_dim_names, p.placements, p.shape) != (q.device_mesh.mesh_dim_names, q.placements, q.shape):
            bad.append(f"{name}: {p.device_mesh.mesh_dim_names} {p.placements} vs {q.device_mesh.mesh_dim_names} {q.placements}")
        elif not torch.equal(p.to_local(), q.to_local()):
            bad.append(f"{name}: values")
    return bad


def _state_differences(opt: torch.optim.Optimizer, ref_opt: torch.optim.Optimizer, ours: nn.Module, ref: nn.Module) -> list[str]:
    theirs = dict(ref.named_parameters())
    bad = []
    for name, p in ours.named_parameters():
        mine, other = opt.state[p], ref_opt.state[theirs[name]]
        for key in ("exp_avg", "exp_avg_sq"):
            if not torch.equal(mine[key].to_local(), other[key].to_local()):
                bad.append(f"{name}.{key}")
    return bad


def check_parity(rank: int, world_size: int, **overrides) -> dict:
    mesh = _mesh()
    ours = overlap.wrap(_tp_model(mesh), group=mesh["dp"], **overrides)
    ref = _fsdp2(mesh)
    out: dict = {"layout": _differences(ours, ref), "losses": [], "params": [], "state": []}
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(STEPS):
        loss = _loss(ours, mesh, step)
        loss.backward()
        ref_loss = _loss(ref, mesh, step)
        ref_loss.backward()
        out["losses"].append((loss.item(), ref_loss.item()))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        out["params"] += [f"step {step}: {d}" for d in _differences(ours, ref)]
    out["state"] = _state_differences(opt, ref_opt, ours, ref)
    theirs = dict(ref.named_parameters())
    out["full"] = [
        name for name, p in ours.named_parameters() if not torch.equal(p.full_tensor(), theirs[name].full_tensor())
    ]
    return out


def test_fsdp_x_tp_matches_fsdp2(world4):
    for result in world4.run(check_parity, timeout_s=240):
        assert not result["layout"], result["layout"]
        assert all(a == b for a, b in result["losses"]), result["losses"]
        assert not result["params"], result["params"]
        assert not result["state"], result["state"]
        assert not result["full"], result["full"]
