"""Full state-dict exports hold what they must: with `rank0_only=True` the rank that writes keeps
the host copy, and every other rank, which still joins each parameter's gather, holds no more
than one tensor's worth at any moment and keeps nothing.

Four gloo ranks: a (dp, tp) = (2, 2) grid (MLP blocks, `up` colwise and `down` rowwise over tp),
then plain sharding over all four. The bytes are those of `LiveBytes` from
benchmarks/export_memory.py (which measures the same on a large model): every host tensor an op
allocates during the export, followed until it is freed. A rank that kept a copy of each full
tensor, even only until the end of the call, would peak at the whole model, far above one unit.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import overlap

DIM, LAYERS = 32, 6
_MESH: list[DeviceMesh] = []  # per rank, built once (it makes groups)


def _live_bytes():
    """benchmarks/export_memory.py's tracker (the benchmarks are scripts, not a package)."""
    name = "benchmarks_export_memory"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[2] / "benchmarks" / "export_memory.py"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[name].LiveBytes()


def _model(tp_mesh: DeviceMesh | None) -> nn.Module:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.ReLU(), nn.Linear(4 * DIM, DIM)) for _ in range(LAYERS)]
    for block in blocks if tp_mesh is not None else ():
        parallelize_module(block, tp_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return nn.Sequential(*blocks)


def _measure(model: nn.Module) -> dict[str, int]:
    """Export once: the bytes this rank kept and its peak of live bytes during the call."""
    model(torch.randn(4, DIM)).sum().backward()  # a step's last checks are read first: realistic
    with _live_bytes() as tracked:
        exported = overlap.full_state_dict(model, rank0_only=True)
    return {"kept": sum(t.numel() * t.element_size() for t in exported.values()), "peak": tracked.peak_bytes}


def check_export_memory(rank: int, world_size: int) -> dict[str, dict[str, int]]:
    if not _MESH:
        _MESH.append(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")))
    mesh = _MESH[0]
    return {
        "dp2 x tp2": _measure(overlap.wrap(_model(mesh["tp"]), group=mesh["dp"])),
        "dp4": _measure(overlap.wrap(_model(None))),
    }


def test_only_the_writing_rank_keeps_a_host_copy(world4):
    unit_bytes = sum(p.numel() * p.element_size() for p in _model(None)[0].parameters())
    model_bytes = LAYERS * unit_bytes
    results = world4.run(check_export_memory, timeout_s=180)
    for world in ("dp2 x tp2", "dp4"):
        writer, *others = [r[world] for r in results]
        assert writer["kept"] == model_bytes, (world, writer, model_bytes)
        for rank, got in enumerate(others, start=1):
            assert got["kept"] == 0, (world, rank, got)
            assert got["peak"] < unit_bytes, (world, rank, got, f"one unit: {unit_bytes} B, model {model_bytes} B")


def check_exports_own_memory(rank: int, world_size: int) -> list[str]:
    """The exported tensors share no memory with the model: changing one changes not the other."""
    mesh = _MESH[0] if _MESH else init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    _MESH[:] = [mesh]
    model = nn.Sequential(_model(mesh["tp"]), nn.BatchNorm1d(DIM))  # a buffer beside the DTensors
    model = overlap.wrap(model, group=mesh["dp"])
    exported = overlap.full_state_dict(model, rank0_only=False)
    before = {name: value.clone() for name, value in exported.items()}
    with torch.no_grad():
        for value in model.state_dict().values():
            (value.to_local() if isinstance(value, DTensor) else value).add_(1)
    return [name for name, value in exported.items() if not torch.equal(value, before[name])]


def test_exports_share_no_memory_with_the_model(world4):
    assert world4.run(check_exports_own_memory, timeout_s=120) == [[]] * 4
