"""The symmetric-memory all-gather (overlap/transport/symm_mem.py), as far as a CPU can check it:
it imports without CUDA; `symmetric_memory=True` is ignored with a warning for CPU tensors; and
with torch's symmetric-memory calls stood in for, the strategy allocates every output from the
pool, rendezvouses that very tensor before its all-gather, and training stays DDP's bitwise.
benchmarks/gpu_check.py runs it for real on a GPU."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import pytest
import torch
from helpers.harness import World
from test_seam import _parity

from overlap.config import OverlapConfig
from overlap.transport import symm_mem
from overlap.transport.strategy import AllGather


class StandInSymmMem:
    """torch.distributed._symmetric_memory's calls the strategy makes, recorded."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.rendezvoused: list[int] = []

    def set_backend(self, name: str) -> None:
        self.calls.append(f"set_backend {name}")

    def get_mem_pool(self, device: torch.device) -> str:
        self.calls.append("pool")
        return "pool"

    @contextlib.contextmanager
    def use_mem_pool(self, pool: str) -> Any:
        self.calls.append(f"allocate from {pool}")
        yield

    def rendezvous(self, tensor: torch.Tensor, group: str) -> None:
        self.calls.append("rendezvous")
        self.rendezvoused.append(tensor.data_ptr())


class RecordedSymmMemAllGather(symm_mem.SymmMemAllGather):
    """The strategy, recording where each gather's output is."""

    def __init__(self, module: Any) -> None:
        super().__init__(lambda: module)
        self.outputs: list[int] = []

    def __call__(self, *args: Any) -> Any:
        result = super().__call__(*args)
        self.outputs.append(result.output.data_ptr())
        return result


def symm_mem_on_cpu(rank: int, world: int) -> dict:
    fake = StandInSymmMem()
    real_pool = getattr(torch.cuda, "use_mem_pool", None)
    strategy = RecordedSymmMemAllGather(fake)
    torch.cuda.use_mem_pool = fake.use_mem_pool
    try:

        def setup(model: Any) -> Any:
            model._overlap_state.runtime.transport.set_custom_all_gather(strategy)
            return lambda: {"calls": fake.calls, "same_tensor": fake.rendezvoused == strategy.outputs}

        return _parity(rank, 2, setup, shared_memory="off")
    finally:
        if real_pool is not None:
            torch.cuda.use_mem_pool = real_pool


def symmetric_memory_on_cpu_tensors(rank: int, world: int) -> list[str]:
    from helpers.models import encoder_stack

    import overlap

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = overlap.wrap(encoder_stack(), symmetric_memory=True, shared_memory="off")
    kinds = [type(model._overlap_state.runtime.transport.all_gather).__name__]
    return kinds + [str(w.message) for w in caught if "symmetric_memory" in str(w.message)]


@pytest.fixture(scope="module")
def world2():
    w = World(2)
    yield w
    w.close()


def test_off_by_default_and_imports_without_cuda():
    assert OverlapConfig().symmetric_memory is False
    assert issubclass(symm_mem.SymmMemAllGather, AllGather)


def test_strategy_allocates_from_the_pool_and_rendezvous_its_output(world2):
    for rank, r in enumerate(world2.run(symm_mem_on_cpu, timeout_s=240)):
        assert r["diff"] == 0.0, (rank, r["diff"])
        calls, gathers = r["seen"]["calls"], r["seen"]["calls"].count("rendezvous")
        assert calls[0] == "set_backend NCCL" and gathers > 0, calls
        # per gather: the pool's output, allocated under it, then that very tensor rendezvoused
        assert calls[1:] == ["pool", "allocate from pool", "rendezvous"] * gathers, calls
        assert r["seen"]["same_tensor"], r["seen"]


def test_cpu_tensors_ignore_it_with_a_warning(world2):
    for kinds in world2.run(symmetric_memory_on_cpu_tensors, timeout_s=120):
        assert kinds[0] == "GlooAllGather" and len(kinds) == 2 and "CUDA tensors only" in kinds[1], kinds
