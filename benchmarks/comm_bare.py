"""`overlap bench comm` vs a bare torch.distributed loop: does the harness cost bandwidth?

    python benchmarks/comm_bare.py                      # 2 gloo ranks, a few sizes, 5 rounds
    python benchmarks/comm_bare.py --sizes 1048576,67108864 --rounds 3

One world; per op and size, rounds alternate the bare loop and `overlap.tools.bench.comm.measure`
(who goes first flips each round) with the same iteration counts. The bare loop is what one would
write by hand: a tensor, warm-up, barrier, timed loop of blocking collectives, mean over ranks.
Its busbw arithmetic is written out here too, independent of the harness. Prints median busbw
of each and their ratio; the harness should be within 10%.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from overlap.tools.bench.comm import iters_for, measure
from overlap.tools.worlds.launch import run_local_world


def bare_busbw_gbps(op: str, num_bytes: int, iters: int, warmup: int) -> float:
    n = dist.get_world_size()
    if op == "all_reduce":
        buf = torch.ones(num_bytes // 4)
        call, factor = (lambda: dist.all_reduce(buf)), 2 * (n - 1) / n
    else:  # all_gather
        out, inp = torch.empty(num_bytes // 4), torch.ones(num_bytes // 4 // n)
        call, factor = (lambda: dist.all_gather_single(out, inp)), (n - 1) / n
    for _ in range(warmup):
        call()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    seconds = torch.tensor([(time.perf_counter() - start) / iters])
    dist.all_reduce(seconds)
    return num_bytes / (seconds.item() / n) / 1e9 * factor


def compare(rank: int, world_size: int, args: argparse.Namespace) -> list[tuple] | None:
    rows = []
    for op in args.ops.split(","):
        for size in map(int, args.sizes.split(",")):
            iters, warmup = iters_for(size, args.iters, args.warmup, args.budget_bytes)
            bare, harness = [], []
            for r in range(args.rounds):
                for who in ("bare", "harness") if r % 2 == 0 else ("harness", "bare"):
                    if who == "bare":
                        bare.append(bare_busbw_gbps(op, size, iters, warmup))
                    else:
                        inplace = op == "all_reduce"  # the only form torch has
                        row = measure(op, size, torch.float32, inplace,
                                      iters=iters, warmup=warmup, device=torch.device("cpu"))  # fmt: skip
                        assert row is not None and row.num_wrong == 0, f"rank {rank}: {row}"
                        harness.append(row.busbw_gbps)
            rows.append((op, size, iters, statistics.median(bare), statistics.median(harness),
                         min(bare), max(bare), min(harness), max(harness)))  # fmt: skip
    return rows if rank == 0 else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", default="all_reduce,all_gather")
    p.add_argument("--sizes", default="65536,1048576,16777216,67108864")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--budget-bytes", type=int, default=256 * 2**20)
    p.add_argument("--nproc", type=int, default=2)
    args = p.parse_args()
    rows = run_local_world(compare, args.nproc, args)[0]
    print(f"busbw GB/s, median over {args.rounds} interleaved rounds (min-max), "
          f"{args.nproc} gloo ranks, loopback")  # fmt: skip
    print(f"{'op':<11}{'bytes':>10}{'iters':>6}{'bare':>22}{'bench comm':>22}{'ratio':>7}")
    for op, size, iters, bare, harness, blo, bhi, hlo, hhi in rows:
        print(f"{op:<11}{size:>10}{iters:>6}{f'{bare:.3f} ({blo:.3f}-{bhi:.3f})':>22}"
              f"{f'{harness:.3f} ({hlo:.3f}-{hhi:.3f})':>22}{harness / bare:>7.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
