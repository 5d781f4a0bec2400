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


class _One(nn.Module):
    """A module holding one given parameter (and a plain layer, so wrap has units)."""

    def __init__(self, param: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(param)
        self.plain = nn.Linear(4, 4)


def _refusals(mesh: DeviceMesh) -> dict[str, tuple]:
    """Case -> (model builder, wrap kwargs, substrings the message must hold)."""
    tp = mesh["tp"]
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor.placement_types import _StridedShard

    def dtensor(local: torch.Tensor, on: DeviceMesh, placement) -> DTensor:
        return DTensor.from_local(local, on, [placement], run_check=False)

    # the same ranks as mesh, laid out the other way: its tp rows are mesh's dp columns
    other = DeviceMesh("cpu", mesh.mesh.t().contiguous(), mesh_dim_names=("dp", "tp"))
    cube = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("rep", "ep", "tp"))
    unnamed = DeviceMesh.from_group(tp.get_group(), "cpu")
    dp = {"group": mesh["dp"]}
    name = "'layers.0.up.weight'"
    return {
        "group None": (lambda: _tp_model(mesh), {"group": None}, [name, "`group` is None", "mesh['dp']"]),
        "group ProcessGroup": (lambda: _tp_model(mesh), {"group": dist.group.WORLD}, [name, "a ProcessGroup"]),
        "already on dp": (
            lambda: _One(distribute_tensor(torch.randn(4, 4), mesh["dp"], [Shard(0)])),
            dp,
            ["'weight'", "already distributed over the data-parallel dimension ['dp']"],
        ),
        "2-D tp": (
            lambda: _One(DTensor.from_local(torch.randn(2, 2), cube["ep", "tp"], [Shard(0), Shard(1)], run_check=False)),
            {"group": cube["rep"]},
            ["'weight'", "only 1-D tensor parallelism"],
        ),
        "Partial": (lambda: _One(dtensor(torch.randn(4, 4), tp, Partial())), dp, ["'weight'", "Partial", "not supported"]),
        "StridedShard": (
            lambda: _One(dtensor(torch.randn(2, 4), tp, _StridedShard(0, split_factor=2))),
            dp,
            ["'weight'", "_StridedShard", "not supported"],
        ),
        "0-dim": (lambda: _One(distribute_tensor(torch.tensor(1.0), tp, [Replicate()])), dp, ["'weight'", "0-dim"]),
        "uneven": (
            lambda: _One(distribute_tensor(torch.randn(5, 4), tp, [Shard(0)])),
            dp,
            ["'weight'", "dim 0 of size 5 is sharded unevenly over 2 tp ranks"],
        ),
        "another mesh": (
            lambda: _One(distribute_tensor(torch.randn(4, 4), other["tp"], [Shard(0)])),
            dp,
            ["'weight'", "do not form one mesh"],
        ),
        "unnamed": (
            lambda: _One(distribute_tensor(torch.randn(4, 4), unnamed, [Shard(0)])),
            dp,
            ["'weight'", "named mesh dimensions"],
        ),
        "HSDP x TP": (
            lambda: _One(distribute_tensor(torch.randn(4, 4), cube["tp"], [Shard(0)])),
            {"group": cube},
            ["'weight'", "HSDP x TP"],
        ),
        "meta": (
            lambda: _One(DTensor.from_local(torch.empty(2, 4, device="meta"), tp, [Shard(0)], run_check=False)).to_empty(
                device="meta"
            ),
            dp,
            ["'weight'", "meta device"],
        ),
        "param codec": (lambda: _tp_model(mesh), {**dp, "param_compression": "int8"}, [name, "param_compression='int8'"]),
        "grad codec": (lambda: _tp_model(mesh), {**dp, "grad_compression": "int8"}, [name, "grad_compression='int8'"]),
        "hpZ": (lambda: _tp_model(mesh), {**dp, "hybrid_mode": "secondary"}, [name, "hybrid_mode='secondary'"]),
    }


def check_refusals(rank: int, world_size: int) -> dict[str, tuple[str | None, list[str]]]:
    """Per case: the message wrap raised (None: it did not) and the expected words it lacks."""
    mesh = _mesh()
    out: dict[str, tuple[str | None, list[str]]] = {}
    for case, (build, kwargs, needles) in _refusals(mesh).items():
        try:
            overlap.wrap(build(), **kwargs)
            out[case] = (None, needles)
        except ValueError as error:
            out[case] = (str(error), [n for n in needles if n not in str(error)])
    # ranks that disagree: the second dp group (tp coordinate 1) alone asks for a codec
    codec = "int8" if mesh["tp"].get_local_rank() == 1 else None
    try:
        overlap.wrap(_tp_model(mesh), group=mesh["dp"], param_compression=codec)
        out["disagree"] = (None, [])
    except ValueError as error:
        out["disagree"] = (str(error), [] if "ranks disagree" in str(error) else ["ranks disagree"])
    return out


def test_unsupported_compositions_raise_at_wrap_on_every_rank(world4):
    results = world4.run(check_refusals, timeout_s=240)
    for case in results[0]:
        messages = [r[case][0] for r in results]
        assert all(m is not None for m in messages), (case, messages)
        assert all(not r[case][1] for r in results), (case, [r[case] for r in results])
        if case != "disagree":
            assert len(set(messages)) == 1, (case, messages)  # the same error on every rank
