"""`unit_policy="auto"` finds the repeated blocks in ModuleList, ModuleDict and Sequential
containers; a unit holding most of the parameters and several repeated blocks is warned about,
naming the unit and its share."""

from __future__ import annotations

import re
import warnings

import torch
import torch.nn as nn

import overlap
from overlap.engine.state import state_of
from overlap.engine.units import find_unit_modules, repeated_blocks


class Block(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Other(Block):
    pass


def _container(kind: str, blocks: list[nn.Module]) -> nn.Module:
    if kind == "dict":
        return nn.ModuleDict({str(i): b for i, b in enumerate(blocks)})
    if kind == "list":
        return nn.ModuleList(blocks)
    return nn.Sequential(*blocks)


class Net(nn.Module):
    """Embedding, blocks in a container of `kind`, head (torchtitan's `layers` is a ModuleDict)."""

    def __init__(self, kind: str = "dict", num_blocks: int = 3, dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, dim)
        self.layers = _container(kind, [Block(dim) for _ in range(num_blocks)])
        self.head = nn.Linear(dim, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers.values() if isinstance(self.layers, nn.ModuleDict) else self.layers:
            h = layer(h)
        return self.head(h)


class MoEBlock(Block):
    """A block holding repeated parts of its own (experts), most of the model's parameters."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__(dim)
        self.experts = nn.ModuleList(nn.Linear(dim, 8 * dim) for _ in range(4))


def test_auto_finds_blocks_in_every_container():
    for kind in ("dict", "list", "sequential"):
        assert find_unit_modules(Net(kind), "auto") == ["layers.0", "layers.1", "layers.2"], kind


def test_auto_takes_only_the_repeated_class_and_looks_inside_blocks():
    mixed = nn.ModuleDict({"a": Block(), "b": Other(), "c": Block(), "norm": nn.LayerNorm(8)})
    assert find_unit_modules(mixed, "auto") == ["a", "c"]  # one Other, one LayerNorm: not repeated
    nested = nn.ModuleDict(
        {"enc": nn.ModuleList([Block(), Block()]), "dec": nn.ModuleDict({"x": Other(), "y": Other()})}
    )
    assert list(repeated_blocks(nested)) == ["enc.0", "enc.1", "dec.x", "dec.y"]
    assert find_unit_modules(nested, "auto") == ["enc.0", "enc.1", "dec.x", "dec.y"]
    frozen_free = nn.ModuleDict({"a": nn.ReLU(), "b": nn.ReLU()})  # no parameters: no unit
    assert find_unit_modules(frozen_free, "auto") == []


def _wrap_and_warnings(model: nn.Module, **overrides) -> tuple[nn.Module, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        overlap.wrap(model, **overrides)
    return model, [str(w.message) for w in caught if "repeated blocks" in str(w.message)]


def _share(message: str) -> int:
    match = re.search(r"holds (\d+)% of the model's parameters", message)
    assert match is not None, message
    return int(match.group(1))


def discovery_on_ranks(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    total = sum(p.numel() for p in Net().parameters())
    blocks = sum(p.numel() for p in Net().layers.parameters())
    out: dict = {"blocks_share": round(100 * blocks / total)}
    model, out["auto"] = _wrap_and_warnings(Net("dict"))
    out["auto_units"] = [u.layout.module_fqns for u in state_of(model).units]
    x = torch.randint(0, 10, (2, 3))
    model(x).sum().backward()  # trains as any wrapped model
    out["auto_grads"] = all(p.grad is not None for p in model.parameters())
    _, out["no_class"] = _wrap_and_warnings(Net("dict"), unit_policy={nn.GRU})
    _, out["merged"] = _wrap_and_warnings(Net("list"), min_unit_numel=10**6)
    _, out["small_blocks"] = _wrap_and_warnings(Net("list", num_blocks=1), unit_policy={nn.GRU})
    moe = Net("dict")
    moe.layers["2"] = MoEBlock()  # a unit of its own, most parameters, repeated experts inside
    out["moe_share"] = round(
        100 * sum(p.numel() for p in moe.layers["2"].parameters()) / sum(p.numel() for p in moe.parameters())
    )
    model, out["moe"] = _wrap_and_warnings(moe, unit_policy={Block})  # MoEBlock too: a block, a unit
    out["moe_units"] = [u.layout.module_fqns for u in state_of(model).units]
    return out


def test_auto_units_and_the_lopsided_unit_warning(world2):
    for rank, out in enumerate(world2.run(discovery_on_ranks)):
        assert out["auto"] == [], (rank, out)  # every block a unit: nothing to warn about
        assert out["auto_units"] == [("",), ("layers.0",), ("layers.1",), ("layers.2",)], (rank, out)
        assert out["auto_grads"], rank
        (no_class,) = out["no_class"]  # the policy names no class the model has: one root unit
        assert "the root" in no_class and "3 repeated blocks" in no_class and "unit_policy={Block}" in no_class
        assert _share(no_class) == 100
        (merged,) = out["merged"]  # min_unit_numel merged every block into one unit
        assert "layers.0 + layers.1 + layers.2" in merged and _share(merged) == out["blocks_share"] > 50
        assert out["small_blocks"] == [], (rank, out)  # one block is nothing repeated
        assert ("layers.2",) in out["moe_units"] and out["moe_share"] > 50, (rank, out)
        assert out["moe"] == [], (rank, out)  # the repeated experts inside a block belong to its unit
