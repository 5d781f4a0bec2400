"""One case of `overlap bench comm`: the ops and transports it names, a collective's buffers
filled with known values, the check of its output, and the timed loop ([Note: comm bench timing]
in overlap/tools/bench/comm.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.distributed as dist

from overlap.tools.worlds.collectives import all_gather_single, reduce_scatter_single

Op = Literal["all_gather", "reduce_scatter", "all_reduce", "all_to_all"]
OPS: tuple[Op, ...] = get_args(Op)
Transport = Literal["backend", "shm"]
_CHUNKED: frozenset[Op] = frozenset({"all_gather", "reduce_scatter", "all_to_all"})


def count_for(op: Op, num_bytes: int, element_size: int, world_size: int) -> int:
    """Elements per buffer: a multiple of the world size for chunked ops (0: too small)."""
    count = num_bytes // element_size
    return count - count % world_size if op in _CHUNKED else count


@dataclass(frozen=True)
class CommCase:
    """The buffers of one collective; `inp` aliases `out` for the in-place variants."""

    op: Op
    inp: torch.Tensor
    out: torch.Tensor

    def launch(self, async_op: bool = False) -> dist.Work | None:
        match self.op:
            case "all_gather":
                return all_gather_single(self.out, self.inp, async_op=async_op)
            case "reduce_scatter":
                return reduce_scatter_single(self.out, self.inp, async_op=async_op)
            case "all_reduce":
                return dist.all_reduce(self.out, async_op=async_op)
            case "all_to_all":
                return dist.all_to_all_single(self.out, self.inp, async_op=async_op)
        raise AssertionError(f"rank {dist.get_rank()}: unknown op {self.op}")


def _blocks(values: list[int], block_numel: int, like: torch.Tensor) -> torch.Tensor:
    """`values[j]` repeated `block_numel` times, block after block."""
    small = torch.tensor(values, dtype=like.dtype, device=like.device)  # a case's fill, once per check: no loop
    return small.repeat_interleave(block_numel)


def build_case(op: Op, count: int, inplace: bool, dtype: torch.dtype, device: torch.device) -> CommCase:
    n, r = dist.get_world_size(), dist.get_rank()
    chunk = count // n if op in _CHUNKED else count
    big = torch.zeros(count, dtype=dtype, device=device)
    if op == "all_reduce":
        return CommCase(op, big, big)
    small = big.narrow(0, r * chunk, chunk) if inplace else torch.zeros(chunk, dtype=dtype, device=device)
    if op == "all_gather":
        return CommCase(op, small, big)
    if op == "reduce_scatter":
        return CommCase(op, big, small)
    return CommCase(op, big, torch.zeros_like(big))  # all_to_all


def _fill_and_expect(case: CommCase) -> torch.Tensor:
    """Write this rank's known values into the input; return the output the collective must
    produce (small integers, exact in every dtype for a few ranks)."""
    n, r = dist.get_world_size(), dist.get_rank()
    chunk = case.out.numel() // n if case.op != "reduce_scatter" else case.out.numel()
    match case.op:
        case "all_gather":
            case.inp.fill_(r + 1)
            return _blocks([j + 1 for j in range(n)], chunk, case.out)
        case "reduce_scatter":
            case.inp.copy_(_blocks([(r + 1) * (j + 1) for j in range(n)], chunk, case.inp))
            return torch.full_like(case.out, (r + 1) * n * (n + 1) // 2)
        case "all_reduce":
            case.inp.fill_(r + 1)
            return torch.full_like(case.out, n * (n + 1) // 2)
        case "all_to_all":
            case.inp.copy_(_blocks([r * n + j + 1 for j in range(n)], chunk, case.inp))
            return _blocks([j * n + r + 1 for j in range(n)], chunk, case.out)
    raise AssertionError(f"rank {r}: unknown op {case.op}")


def _is_correct(case: CommCase, device: torch.device, launch: Callable[[], torch.Tensor] | None = None) -> bool:
    """Fill `case`, run it once (`launch`, which returns the output, or `case.launch`) and
    compare the output with what it must be."""
    expected = _fill_and_expect(case)
    if launch is None:
        case.launch()
        out = case.out
    else:
        out = launch()
    _sync(device)
    if out.dtype in (torch.float16, torch.bfloat16):  # partial sums may round
        return torch.allclose(out, expected, rtol=1e-2, atol=0.0)
    return torch.equal(out, expected)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the benchmark's clock edges: before and after a timed loop, never inside it


def _loop_us(call: Callable[[], object], iters: int, warmup: int, device: torch.device) -> float:
    """Microseconds per `call` in a loop of `iters` after `warmup` calls and a barrier."""
    for _ in range(warmup):
        call()
    _sync(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    _sync(device)
    return (time.perf_counter() - start) / iters * 1e6
