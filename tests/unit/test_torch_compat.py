"""The private torch APIs behind overlap/engine/torch_compat.py ([Note: private torch APIs]), on
the torch installed here and on torch 2.11's call shapes.

`_Torch211` stands in for the modules of torch 2.11.0 that the engine reaches into, with their
call shapes as that release's sources define them (torch/distributed/device_mesh.py,
tensor/_dtensor_spec.py, tensor/placement_types.py with `_StridedShard`'s C++ constructor
`(dim, *, split_factor)` from torch/_C/_distributed.pyi, tensor/_utils.py, tensor/_api.py):
`probe` must find every one of them, and each function must call it as that release takes it. The
same stand-in with one API removed or respelled is a torch overlap does not support: the function
that needs it raises `UnsupportedTorchError` naming the torch version, the API and the feature.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import sys
import types
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn as nn

import overlap
from overlap.engine import torch_compat

_DISTRIBUTED_APIS = [
    "DeviceMesh._concatenate",
    "DeviceMesh._flatten",
    "DeviceMesh._get_root_mesh",
    "_StridedShard(split_factor=)",
    "DTensorSpec",
    "TensorMeta",
    "compute_local_shape_and_global_offset",
    "DTensor(local, spec, requires_grad=)",
]


@pytest.fixture(autouse=True)
def fresh_lookups():
    """Each test resolves torch's modules anew (the stand-in replaces them in sys.modules)."""
    torch_compat._attr.cache_clear()
    torch_compat._problem.cache_clear()
    yield
    torch_compat._attr.cache_clear()
    torch_compat._problem.cache_clear()


# ------------------------------------------------------------------- torch 2.11's shapes


class _Torch211:
    """torch 2.11.0's shapes of the private APIs, recording every call."""

    def __init__(self) -> None:
        calls: list[tuple[str, tuple[Any, ...]]] = []
        self.calls = calls

        class DeviceMesh:
            def __init__(self, names: tuple[str, ...], root: DeviceMesh | None = None) -> None:
                self.mesh_dim_names, self._root_mesh = names, root

            def _get_root_mesh(self) -> DeviceMesh:
                calls.append(("_get_root_mesh", (self,)))
                return self._root_mesh if self._root_mesh else self

            def _flatten(self, mesh_dim_name: str | None = None, backend_override: object = None) -> DeviceMesh:
                calls.append(("_flatten", (self, mesh_dim_name, backend_override)))
                return DeviceMesh((mesh_dim_name or "_".join(self.mesh_dim_names),), self._get_root_mesh())

            @staticmethod
            def _concatenate(device_mesh_list: list[DeviceMesh]) -> DeviceMesh:
                calls.append(("_concatenate", (device_mesh_list,)))
                roots = {id(m._get_root_mesh()) for m in device_mesh_list}
                if len(roots) != 1:
                    raise RuntimeError("Cannot concatenate DeviceMeshes derived from different device meshs")
                names = tuple(n for m in device_mesh_list for n in m.mesh_dim_names)
                return DeviceMesh(names, device_mesh_list[0]._get_root_mesh())

        class _StridedShard:  # torch._C._distributed.StridedShard's constructor in 2.11
            def __init__(self, dim: int, *, split_factor: int) -> None:
                self.dim, self.split_factor = dim, split_factor

        class TensorMeta(NamedTuple):
            shape: torch.Size
            stride: tuple[int, ...]
            dtype: torch.dtype

        @dataclasses.dataclass
        class DTensorSpec:
            mesh: DeviceMesh
            placements: tuple[Any, ...]
            tensor_meta: TensorMeta | None = None
            shard_order: Any = None
            use_strided_shard_as_shard_order: bool | None = None

            @property
            def num_shards_map(self) -> list[int]:
                return [1]

        def compute_local_shape_and_global_offset(
            global_shape: Any, mesh: DeviceMesh, placements: Any, skip_offset: bool = False
        ) -> tuple[tuple[int, ...], tuple[int, ...]]:
            calls.append(("compute_local_shape_and_global_offset", (global_shape, mesh, placements, skip_offset)))
            return (tuple(global_shape[:-1]) + (global_shape[-1] // 2,), (0,) * len(global_shape))

        class DTensor:
            _local_tensor: torch.Tensor
            _spec: DTensorSpec

            def __new__(cls, local_tensor: torch.Tensor, spec: DTensorSpec, *, requires_grad: bool) -> DTensor:
                calls.append(("DTensor", (local_tensor, spec, requires_grad)))
                r = object.__new__(cls)
                r._local_tensor, r._spec = local_tensor, spec
                return r

        self.DeviceMesh, self._StridedShard, self.TensorMeta, self.DTensorSpec = (
            DeviceMesh,
            _StridedShard,
            TensorMeta,
            DTensorSpec,
        )
        self.compute_local_shape_and_global_offset, self.DTensor = compute_local_shape_and_global_offset, DTensor

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Put these in place of the installed torch's modules, for one test."""
        contents = {
            "torch.distributed.device_mesh": {"DeviceMesh": self.DeviceMesh},
            "torch.distributed.tensor.placement_types": {"_StridedShard": self._StridedShard},
            "torch.distributed.tensor._dtensor_spec": {"DTensorSpec": self.DTensorSpec, "TensorMeta": self.TensorMeta},
            "torch.distributed.tensor._utils": {
                "compute_local_shape_and_global_offset": self.compute_local_shape_and_global_offset
            },
            "torch.distributed.tensor": {"DTensor": self.DTensor},
        }
        for name, attrs in contents.items():
            module = types.ModuleType(name)
            module.__dict__.update(attrs)
            monkeypatch.setitem(sys.modules, name, module)
        monkeypatch.setattr(torch, "__version__", "2.11.0")


def test_probe_finds_every_private_api_on_this_torch():
    record = torch_compat.probe()
    assert list(record)[: len(_DISTRIBUTED_APIS)] == _DISTRIBUTED_APIS
    assert {api: state for api, state in record.items() if state != "ok"} == {}


def test_every_function_calls_torch_211_as_it_takes_them(monkeypatch):
    torch211 = _Torch211()
    torch211.install(monkeypatch)
    assert {api: torch_compat.probe()[api] for api in _DISTRIBUTED_APIS} == dict.fromkeys(_DISTRIBUTED_APIS, "ok")

    root = torch211.DeviceMesh(("rep", "dp", "tp"))
    dp, tp = torch211.DeviceMesh(("rep", "dp"), root), torch211.DeviceMesh(("tp",), root)
    spmd = torch_compat.concatenate([dp, tp], "TP")
    assert spmd.mesh_dim_names == ("rep", "dp", "tp") and spmd._root_mesh is root
    with pytest.raises(RuntimeError, match="different device meshs"):  # compose.py's refusal reads this
        torch_compat.concatenate([dp, torch211.DeviceMesh(("tp",))], "TP")
    assert torch_compat.root_mesh(dp, "HSDP") is root
    assert torch_compat.flatten(dp, "HSDP").mesh_dim_names == ("rep_dp",)
    placement = torch_compat.strided_shard(0, 2, "TP")
    assert (type(placement), placement.dim, placement.split_factor) == (torch211._StridedShard, 0, 2)
    meta = torch_compat.tensor_meta(torch.Size([4, 6]), (6, 1), torch.bfloat16)
    spec = torch_compat.dtensor_spec(spmd, [placement], meta)
    assert (spec.mesh, spec.placements, spec.tensor_meta) == (spmd, (placement,), meta)
    assert torch_compat.local_shape(torch.Size([4, 6]), tp, spec.placements) == torch.Size([4, 3])
    local = torch.zeros(2, 3)
    made = torch_compat.dtensor(local, spec)
    assert type(made) is torch211.DTensor and made._local_tensor is local and made._spec is spec
    assert [name for name, _ in torch211.calls if name not in ("_get_root_mesh",)] == [
        "_concatenate",
        "_concatenate",
        "_flatten",
        "compute_local_shape_and_global_offset",
        "DTensor",
    ]
    assert torch211.calls[-1][1][2] is False  # no autograd history: requires_grad=False


def _without(torch211: _Torch211, api: str) -> None:
    """torch211 with `api` gone or spelled another way, as a later torch might have it."""
    if api == "DeviceMesh._concatenate":
        del torch211.DeviceMesh._concatenate
    elif api == "DeviceMesh._flatten":
        torch211.DeviceMesh._flatten = lambda self, name, backend: None  # name now required
    elif api == "_StridedShard(split_factor=)":
        torch211._StridedShard = type("_StridedShard", (), {"__init__": lambda self, dim, *, sf: None})
    elif api == "TensorMeta":
        torch211.TensorMeta = NamedTuple("TensorMeta", [("shape", torch.Size), ("dtype", torch.dtype)])


@pytest.mark.parametrize(
    "api, feature, call",
    [
        ("DeviceMesh._concatenate", "TP", lambda m: torch_compat.concatenate([m, m], "TP")),
        ("DeviceMesh._flatten", "EP", lambda m: torch_compat.flatten(m, "EP")),
        ("_StridedShard(split_factor=)", "TP / EP", lambda m: torch_compat.strided_shard(0, 2, "TP / EP")),
        ("TensorMeta", "TP / EP", lambda m: torch_compat.tensor_meta(torch.Size([2]), (1,), torch.float32)),
    ],
)
def test_a_torch_without_the_api_names_version_api_and_feature(monkeypatch, api, feature, call):
    torch211 = _Torch211()
    _without(torch211, api)
    torch211.install(monkeypatch)
    with pytest.raises(torch_compat.UnsupportedTorchError) as raised:
        call(torch211.DeviceMesh(("dp", "ep")))
    message = str(raised.value)
    for needle in ("torch 2.11.0", api, f"({feature})", torch_compat.SUPPORTED_TORCH):
        assert needle in message, (needle, message)
    assert not isinstance(raised.value, RuntimeError)  # not a mesh refusal: compose.py catches those
    assert torch_compat.probe()[api].startswith("missing: ")
    assert torch211.calls == []  # refused before calling a torch that takes other arguments


def test_supported_range_is_the_dependency():
    text = (pathlib.Path(__file__).parents[2] / "pyproject.toml").read_text()
    assert f'"torch{torch_compat.SUPPORTED_TORCH}"' in text
    readme = (pathlib.Path(__file__).parents[2] / "README.md").read_text()
    assert f"torch{torch_compat.SUPPORTED_TORCH}" in readme.replace("`", "").replace(" ", "")


_PRIVATE_MESH = {"_concatenate", "_flatten", "_get_root_mesh", "_StridedShard", "compute_local_shape_and_global_offset"}


def test_the_package_reaches_private_mesh_apis_only_through_torch_compat():
    """Code, not docstrings: every use of the names above, and every import from a private torch
    distributed module, outside torch_compat.py (type-checking imports aside)."""
    package = pathlib.Path(overlap.__file__).parent
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.name == "torch_compat.py":
            continue
        tree = ast.parse(path.read_text())
        typing_only = {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)
        }
        for node in ast.walk(tree):
            names = (
                {node.attr} if isinstance(node, ast.Attribute) else {node.id} if isinstance(node, ast.Name) else set()
            )
            if names & _PRIVATE_MESH:
                found.append(f"{path.relative_to(package)}:{node.lineno} {names & _PRIVATE_MESH}")
            if (
                isinstance(node, ast.ImportFrom)
                and id(node) not in typing_only
                and (node.module or "").startswith("torch.distributed")
            ):
                private = [a.name for a in node.names if a.name.startswith("_")]
                if "._" in node.module or private:  # type: ignore[operator]
                    found.append(f"{path.relative_to(package)}:{node.lineno} from {node.module} import {private}")
    assert found == [], "\n".join(found)


# ------------------------------------------------------------------- a wrap on the torch here


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def check_tp_wrap_without_concatenate(rank: int, world_size: int) -> dict[str, str]:
    """Wrap a tensor-parallel model on a (dp=1, tp=world) mesh once with DeviceMesh._concatenate
    taken away (a torch that lacks it), then with it back, and train a step."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "tp"))

    def model() -> nn.Module:
        torch.manual_seed(0)
        block = nn.Sequential(_Block())
        parallelize_module(block[0], mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        return block

    out = {}
    saved = DeviceMesh.__dict__["_concatenate"]
    del DeviceMesh._concatenate
    torch_compat._problem.cache_clear()
    try:
        overlap.wrap(model(), group=mesh["dp"])
        out["missing"] = "wrapped"
    except Exception as error:  # the test reads which error it was
        out["missing"] = f"{type(error).__name__}: {error}"
    finally:
        DeviceMesh._concatenate = saved
        torch_compat._problem.cache_clear()
    wrapped = overlap.wrap(model(), group=mesh["dp"])
    wrapped(torch.ones(4, 8)).sum().backward()
    out["restored"] = type(wrapped[0].up.weight).__name__
    return out


def test_tp_wrap_on_a_torch_without_the_api_raises_its_name_on_every_rank(world2):
    for rank, result in enumerate(world2.run(check_tp_wrap_without_concatenate, timeout_s=120)):
        assert result["missing"].startswith("UnsupportedTorchError: "), (rank, result)
        for needle in ("tensor parallelism (TP)", "DeviceMesh._concatenate", f"torch {torch.__version__}"):
            assert needle in result["missing"], (rank, needle, result)
        assert result["restored"] == "DTensor", (rank, result)
