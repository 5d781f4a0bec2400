"""`gradient_divide_factor` against FSDP2's `set_gradient_divide_factor`: the sum of the ranks'
gradients divided by the factor (1.0: the plain sum, torchtitan's default), every step bitwise on
two gloo ranks (a two-rank sum, then one division on both sides; FSDP2 forced to sum, since gloo
has neither PREMUL_SUM nor AVG for a factor); HSDP (2 x 2) likewise; the wrapped model's method;
the factor in a checkpoint."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
from test_chunked_loss import compare_and_step
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import overlap
from overlap.engine.state import state_of

DIM, STEPS = 16, 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 3 * DIM)
        self.down = nn.Linear(3 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(DIM, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_config_validates_and_saves_the_factor(tmp_path):
    assert overlap.OverlapConfig().gradient_divide_factor is None
    for bad in (0, -2.0, float("inf"), float("nan"), True, "1"):
        with pytest.raises(ValueError, match="gradient_divide_factor"):
            overlap.OverlapConfig(gradient_divide_factor=bad)
    config = overlap.OverlapConfig(gradient_divide_factor=1.0)
    config.save(tmp_path / "c.json")
    assert overlap.OverlapConfig.load(tmp_path / "c.json").gradient_divide_factor == 1.0


def _fsdp2(model: Net, mesh, factor: float | None) -> Net:
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _set_fsdp2_factor(model, factor, mesh.size())
    return model


def _set_fsdp2_factor(model: nn.Module, factor: float | None, dp_size: int) -> None:
    """FSDP2 summing, then dividing by `factor` (None: by the dp size, i.e. the mean)."""
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(float(dp_size) if factor is None else factor)
            module.set_force_sum_reduction_for_comms(True)


def _step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).pow(2).sum()  # a sum: gradients the factor visibly scales
    loss.backward()
    return loss.detach()


def factor_vs_fsdp2(rank: int, world: int, factors: list[float | None], hsdp: bool = False) -> list[str]:
    """Train with `factors[s]` at step s (the first at wrap, the others through the method),
    overlap and FSDP2 on the same batches; the differences (empty: bitwise)."""
    mesh = (
        init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("rep", "shard"))
        if hsdp
        else init_device_mesh("cpu", (world,))
    )
    torch.manual_seed(0)
    base = Net()
    kwargs = {} if factors[0] is None else {"gradient_divide_factor": factors[0]}
    ours = overlap.wrap(copy.deepcopy(base), group=mesh, **kwargs)
    ref = _fsdp2(copy.deepcopy(base), mesh, factors[0])
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    bad: list[str] = []
    for step, factor in enumerate(factors):
        if step:
            ours.set_gradient_divide_factor(factor)
            _set_fsdp2_factor(ref, factor, world)
        assert state_of(ours).config.gradient_divide_factor == factor
        x = torch.randn(8, DIM, generator=torch.Generator().manual_seed(10 * step + rank))
        if not torch.equal(_step(ours, x), _step(ref, x)):
            bad.append(f"step {step}: loss")
        bad += [f"{what} (factor {factor})" for what in compare_and_step(ours, ref, (opt, ref_opt), step)]
    return bad


@pytest.mark.parametrize(
    "factors",
    [[1.0, 1.0, 1.0], [3.0, 3.0, 3.0], [0.5, 0.5, 0.5], [1.0, None, 4.0]],
    ids=["sum", "three", "half", "changed between steps"],
)
def test_factor_matches_fsdp2(world2, factors):
    for rank, bad in enumerate(world2.run(factor_vs_fsdp2, factors=factors)):
        assert not bad, f"rank {rank}: {bad}"


def test_factor_matches_fsdp2_under_hsdp(world4):
    for rank, bad in enumerate(world4.run(factor_vs_fsdp2, factors=[1.0, 1.0, 6.0], hsdp=True, timeout_s=600)):
        assert not bad, f"rank {rank}: {bad}"


def summed_gradients(rank: int, world: int) -> dict:
    """The sum over ranks, exactly: each rank's gradient a small integer, summed with factor 1."""
    model = overlap.wrap(nn.Linear(4, 1, bias=False), gradient_divide_factor=1.0)
    model(torch.full((1, 4), float(rank + 1))).sum().backward()
    return {"grad": model.weight.grad.full_tensor().tolist()}


def test_factor_one_sums(world2):
    for out in world2.run(summed_gradients):
        assert out["grad"] == [[3.0] * 4]  # 1 + 2 on every element, not their mean 1.5


def checkpoint_keeps_the_factor(rank: int, world: int, root: str) -> dict:
    torch.manual_seed(0)
    model = overlap.wrap(Net(), gradient_divide_factor=2.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, torch.randn(4, DIM))
    opt.step()
    opt.zero_grad()
    model.set_gradient_divide_factor(1.0)  # the run's own: what the checkpoint keeps
    path = overlap.checkpoint.save(root, model, opt, step=1)
    torch.manual_seed(0)
    fresh = overlap.wrap(Net())
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        overlap.checkpoint.load(path, fresh, fresh_opt)
    x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(rank))
    _step(model, x)
    _step(fresh, x)
    same = all(
        torch.equal(a.grad.to_local(), b.grad.to_local()) for a, b in zip(model.parameters(), fresh.parameters())
    )
    return {
        "restored": state_of(fresh).config.gradient_divide_factor,
        "warned": [str(w.message) for w in caught if "gradient_divide_factor" in str(w.message)],
        "same_grads": same,
    }


def test_checkpoint_restores_the_factor(world2, tmp_path):
    for rank, out in enumerate(world2.run(checkpoint_keeps_the_factor, root=str(tmp_path))):
        assert out["restored"] == 1.0 and out["same_grads"], (rank, out)
        assert len(out["warned"]) == 1 and "replaces this model's None" in out["warned"][0], (rank, out)
