"""FSDP1's flat gradient: what autograd runs to build it from the modules' parameter gradients.

FSDP1 (torch/distributed/fsdp/_flat_param.py) lets the modules compute with views of the
unsharded flat parameter, `torch.split` into the parameters' numels, then `view` into their
shapes ("We use `Tensor` views in the forward so that they are tracked by autograd"). The
plan's run model prices the backward of that split as one pass over the flat gradient (read and
write its bytes, [Note: weight passes] in overlap/tools/plan/run_step.py); these tests check
against the installed torch that the backward is one concatenation into a new flat tensor.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, list[int]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sizes = [o.numel() for o in (out if isinstance(out, (list, tuple)) else [out]) if isinstance(o, torch.Tensor)]
        self.ops.append((str(func.overloadpacket.__name__), sizes))
        return out


def _flat_views(flat: torch.Tensor, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    numels = [int(torch.Size(s).numel()) for s in shapes]
    return [split.view(shape) for split, shape in zip(torch.split(flat, numels, dim=0), shapes, strict=True)]


def test_split_views_backward_concatenates_the_parameters_gradients_into_the_flat_gradient() -> None:
    shapes = [(6, 4), (4,), (3, 4), (3,)]
    flat = torch.randn(sum(int(torch.Size(s).numel()) for s in shapes), requires_grad=True)
    w1, b1, w2, b2 = _flat_views(flat, shapes)
    x = torch.randn(5, 6)
    loss = torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(x, w1.t(), b1)), w2, b2).sum()
    mode = _Ops()
    with mode:
        loss.backward()
    cats = [sizes for name, sizes in mode.ops if name == "cat"]
    assert cats == [[flat.numel()]]  # one concatenation, as large as the flat parameter
    assert flat.grad is not None and flat.grad.shape == flat.shape


def test_the_flat_gradient_matches_the_parameters_own_gradients() -> None:
    shapes = [(5, 3), (5,)]
    flat = torch.randn(20, requires_grad=True)
    w, b = _flat_views(flat, shapes)
    x = torch.randn(7, 3)
    (torch.nn.functional.linear(x, w, b) ** 2).sum().backward()
    w_ref = flat.detach()[:15].view(5, 3).clone().requires_grad_()
    b_ref = flat.detach()[15:].clone().requires_grad_()
    (torch.nn.functional.linear(x, w_ref, b_ref) ** 2).sum().backward()
    assert torch.allclose(flat.grad, torch.cat([w_ref.grad.reshape(-1), b_ref.grad]))
