"""Deferred init and loading without the full model anywhere.

A meta-device model of ~1.6 GB (fp32) is wrapped on 2 ranks, each in a fresh process: the peak
resident memory that `wrap` adds must stay below 0.6x the full model on every rank (the shards
alone are 0.5x; rank 0 also holds one unit and its packed copy at a time). Then rank 0 alone
holds a full checkpoint and `load_full_state_dict` scatters it: rank 1's peak grows by far less
than the model, and every shard equals the checkpoint.

Peak memory is the kernel's VmHWM, reset right before the measured call (clear_refs 5).
"""

from __future__ import annotations

import functools
import gc

import torch
import torch.nn as nn
from helpers.harness import World

import overlap

DIM = 2048
LAYERS = 96  # one Linear(2048, 2048) per unit: ~1% of the model


class Stack(nn.Module):
    def __init__(self, dim: int = DIM, layers: int = LAYERS) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(dim, dim) for _ in range(layers)])
        self.head = nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + torch.relu(block(x))
        return self.head(x)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := current RSS


def _peak_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/self/status")


def _measured(fn) -> int:
    """Peak resident bytes `fn()` adds to the process."""
    gc.collect()
    before = _rss_bytes()
    _reset_peak()
    fn()
    return _peak_bytes() - before


def _checkpoint_value(index: int, shape: torch.Size) -> torch.Tensor:
    """Small enough that 96 residual layers stay finite."""
    return torch.rand(shape, generator=torch.Generator().manual_seed(index)).mul_(1e-4)


def wrap_and_load(rank: int, world: int) -> dict:
    with torch.device("meta"):
        model = Stack()
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    torch.manual_seed(0)
    wrap_peak = _measured(lambda: overlap.wrap(model))
    names = [n for n, _ in model.named_parameters()]
    checkpoint = None
    if rank == 0:
        checkpoint = {n: _checkpoint_value(i, p.shape) for i, (n, p) in enumerate(model.named_parameters())}
    load_peak = _measured(functools.partial(overlap.load_full_state_dict, model, checkpoint))
    del checkpoint
    wrong = []
    for i, (name, p) in enumerate(model.named_parameters()):
        local = p.detach().to_local()
        rows = -(-p.shape[0] // world)
        expected = _checkpoint_value(i, p.shape)[rank * rows : rank * rows + local.shape[0]]
        if not torch.equal(local, expected):
            wrong.append(name)
    x = torch.randn(2, DIM)
    with torch.no_grad():
        out = model(x)
    return {
        "full_bytes": full_bytes,
        "wrap_peak": wrap_peak,
        "load_peak": load_peak,
        "wrong": wrong,
        "num_params": len(names),
        "finite": bool(torch.isfinite(out).all()),
    }


def test_meta_model_wraps_and_loads_without_the_full_model_anywhere():
    world = World(2)  # fresh processes: nothing else has touched their memory
    try:
        results = world.run(wrap_and_load, timeout_s=600)
    finally:
        world.close()
    for rank, r in enumerate(results):
        full = r["full_bytes"]
        assert full >= 1.5 * 2**30, full
        assert r["wrong"] == [] and r["finite"], (rank, r["wrong"][:5])
        report = f"rank {rank}: wrap peak {r['wrap_peak'] / full:.3f}x, load peak {r['load_peak'] / full:.3f}x"
        assert 0.45 * full < r["wrap_peak"] < 0.6 * full, report  # the shards alone are 0.5x
        # rank 0 packs one unit at a time; rank 1 receives into its shards in place
        assert r["load_peak"] < 0.1 * full, report
        print(report)
