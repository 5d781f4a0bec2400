"""What one rank finds, every rank of the job acts on: the fp16 loss scaler's overflow, the final
checks before an export and the unit-order checks, on a (dp, tp) = (2, 2) grid and on the
expert-parallel (dp_mod_ep, ep) = (2, 2) grid ([Note: job-wide verdicts] in engine/verdict.py).

Four gloo ranks; rank r is (dp, tp) = (r // 2, r % 2), so rank 1's data-parallel group is {1, 3}
and ranks 0 and 2 share no shard group with it: only the tensor-parallel (or ep) group carries
what rank 1 found to them. Each check injects a problem on rank 1 only, and every rank must act on
it: skip the step, or raise. A rank that does not would go on into its next collective alone; the
harness's deadline then names it as hung.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from test_expert_parallel import _backward as _ep_backward
from test_expert_parallel import _batch as _ep_batch
from test_expert_parallel import _model as _ep_model
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import overlap
from overlap.engine.actions import order_hash
from overlap.transport.fingerprint import CollectiveMismatchError

DIM = 16
INJECTED_ON = 1  # (dp, tp) = (0, 1)
DEADLINE_S = 100  # below the collective timeout: a rank left in a collective is named as hung
_MESHES: dict[tuple[str, str], DeviceMesh] = {}  # per rank, built once (each makes groups)


def _mesh(names: tuple[str, str]) -> DeviceMesh:
    if names not in _MESHES:
        _MESHES[names] = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    return _MESHES[names]


def _tp_model(mesh: DeviceMesh) -> nn.Module:
    """Two MLP blocks, `up` colwise and `down` rowwise over tp, and a plain head."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.ReLU(), nn.Linear(4 * DIM, DIM)) for _ in range(2)]
    for block in blocks:
        parallelize_module(block, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return nn.Sequential(*blocks, nn.Linear(DIM, DIM))


def _tp_step(model: nn.Module, rank: int, opt: torch.optim.Optimizer | None = None) -> torch.Tensor:
    """One backward on a batch of this rank's dp row (the same on both tp ranks); the loss."""
    gen = torch.Generator().manual_seed(rank // 2)
    loss = model(torch.randn(8, DIM, generator=gen)).pow(2).mean()
    loss.backward()
    if opt is not None:
        opt.step()
        opt.zero_grad()
    return loss


def _wrapped(kind: str, rank: int) -> nn.Module:
    """A model wrapped on the (dp, tp) or the (dp_mod_ep, ep) grid, after one training step."""
    if kind == "tp":
        mesh = _mesh(("dp", "tp"))
        model = overlap.wrap(_tp_model(mesh), group=mesh["dp"])
        _tp_step(model, rank, torch.optim.SGD(model.parameters(), lr=0.1))
        return model
    mesh = _mesh(("dp_mod_ep", "ep"))
    model = overlap.wrap(_ep_model(mesh), group=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _ep_backward(model, _ep_batch(rank, 0))
    opt.step()
    opt.zero_grad()
    return model


def _outcome(fn) -> str:
    try:
        fn()
    except (ValueError, CollectiveMismatchError) as e:
        return f"{type(e).__name__}: {e}"
    return "returned"


def check_scaler_overflow(rank: int, world_size: int) -> dict:
    """An inf in rank 1's shard of a tensor-parallel gradient: every rank skips the step and
    halves the scale."""
    mesh = _mesh(("dp", "tp"))
    model = overlap.wrap(_tp_model(mesh), group=mesh["dp"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = overlap.ShardedGradScaler(model=model, init_scale=4.0)
    gen = torch.Generator().manual_seed(rank // 2)
    scaler.scale(model(torch.randn(8, DIM, generator=gen)).pow(2).mean()).backward()
    up = model[0][0].weight  # colwise: Shard over tp, so rank 1's gradient elements are its own
    assert isinstance(up.grad, DTensor) and up.grad.placements[-1].is_shard(), up.grad
    if rank == INJECTED_ON:
        with torch.no_grad():
            up.grad.to_local().view(-1)[0] = float("inf")
    before = [
        p.detach().to_local().clone() if isinstance(p, DTensor) else p.detach().clone() for p in model.parameters()
    ]
    scaler.step(opt)
    scaler.update()
    after = [p.detach().to_local() if isinstance(p, DTensor) else p.detach() for p in model.parameters()]
    return {"stepped": any(not torch.equal(a, b) for a, b in zip(after, before)), "scale": scaler.get_scale()}


def test_scaler_overflow_on_one_tp_rank_skips_the_step_everywhere(world4):
    results = world4.run(check_scaler_overflow, timeout_s=DEADLINE_S)
    assert results == [{"stepped": False, "scale": 2.0}] * 4, results


def check_final_checks(rank: int, world_size: int, kind: str) -> str:
    """A reduction trail that differs on rank 1 (of the model's state, or of the experts'), then
    an export: every rank raises before any of them enters the export's collectives."""
    model = _wrapped(kind, rank)
    state = model._overlap_state
    if rank == INJECTED_ON:
        target = state if kind == "tp" else state.experts[0]
        target.runtime.reduce_trail ^= 0x5A5A
    return _outcome(lambda: overlap.full_state_dict(model))


def test_final_check_mismatch_on_one_tp_rank_raises_everywhere(world4):
    results = world4.run(check_final_checks, timeout_s=DEADLINE_S, kind="tp")
    assert all(r.startswith("CollectiveMismatchError") for r in results), results
    assert "reduction trails" in results[INJECTED_ON], results[INJECTED_ON]
    assert f"global rank {INJECTED_ON}" in results[0], results[0]  # named where no group is shared


def test_final_check_mismatch_in_the_experts_state_raises_everywhere(world4):
    results = world4.run(check_final_checks, timeout_s=DEADLINE_S, kind="ep")
    assert all(r.startswith("CollectiveMismatchError") for r in results), results


def check_order_mismatch(rank: int, world_size: int, kind: str) -> str:
    """Rank 1 reports another forward order (of the model's state, or of the experts'): every
    rank raises."""
    model = _wrapped(kind, rank)
    state = model._overlap_state
    target = state if kind == "tp" else state.experts[0]
    order = (0, 1) if rank == INJECTED_ON else (1, 0)
    return _outcome(lambda: target.runtime.check_order("forward", order_hash(order), order))


def test_order_mismatch_on_one_tp_rank_raises_everywhere(world4):
    results = world4.run(check_order_mismatch, timeout_s=DEADLINE_S, kind="tp")
    assert all(r.startswith("ValueError") and "order of units differs" in r for r in results), results


def test_order_mismatch_in_the_experts_state_raises_everywhere(world4):
    results = world4.run(check_order_mismatch, timeout_s=DEADLINE_S, kind="ep")
    assert all(r.startswith("ValueError") and "order of units differs" in r for r in results), results
