"""Shared-memory all-gather and reduce-scatter against gloo's and a memory copy, 1-64 MiB.

    python benchmarks/shm_bandwidth.py [--nproc 2] [--reps 20] [--json PATH]

Each size S is what one collective delivers to a rank: an all-gather's output (S / nproc sent by
each rank) and a reduce-scatter's input (S summed into S / nproc). Bandwidth = S / the median
time of one collective (issue, then wait), the slowest rank; `copy` is one rank copying S bytes
(`csrc/shm.cpp`'s parallel memcpy and torch's `copy_`, the faster) while the others wait.
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from overlap.kernels import cpu
from overlap.transport import backend, shm
from overlap.transport import collectives as comm
from overlap.transport.gloo import gloo_strategies
from overlap.transport.strategy import UnitWire, Wire

SIZES_MIB = (1, 4, 16, 64)


def _timed(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    slowest = torch.tensor([statistics.median(times)])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.item()


def _copy_s(nbytes: int, reps: int) -> float:
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    ext = cpu.load_extension()
    best = []
    for fn in (lambda: dst.copy_(src), lambda: ext.shm_copy_bytes(dst, src)):
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        best.append(statistics.median(times))
    return min(best)


def _rank(rank: int, nproc: int, init: str, reps: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=nproc, timeout=timedelta(seconds=300))
    torch.set_num_threads(1)
    group = dist.group.WORLD
    semantics = backend.semantics(group, torch.device("cpu"))
    largest = max(SIZES_MIB) << 20
    units = (UnitWire(largest // 4 // nproc, 4, largest // nproc, True),)
    wire = Wire(group, rank, nproc, torch.device("cpu"), semantics, "auto", "all_to_all", None, units)
    plan = shm.ShmPlan(timedelta(seconds=120))
    plan.segments = shm.ShmSegments(group, 4 * largest, plan.timeout)
    gloo = gloo_strategies()
    shm_gather, shm_reduce = shm.ShmAllGather(plan, gloo[0]), shm.ShmReduceScatter(plan, gloo[1])
    for strategy in (shm_gather, shm_reduce, *gloo[:2]):
        strategy.plan(wire)
    rows = []
    for mib in SIZES_MIB:
        nbytes = mib << 20
        part = torch.randn(nbytes // 4 // nproc)
        full = torch.randn(nproc, nbytes // 4 // nproc)

        def shm_all_gather() -> None:
            comm.wait(shm_gather(0, part, torch.float32, None, None, False))

        def shm_reduce_scatter() -> None:
            buf = shm_reduce.allocate(nproc, full.shape[1], torch.float32, full.device)
            buf.copy_(full)  # the copy-in, which writes the input in any case
            comm.wait(shm_reduce(buf, None))

        def gloo_all_gather() -> None:
            comm.wait(comm.all_gather_flat(part, group, nproc, torch.float32))

        def gloo_reduce_scatter() -> None:
            buf = torch.empty_like(full)
            buf.copy_(full)
            comm.wait(comm.reduce_scatter_flat(buf.view(-1), group, nproc, "all_to_all"))

        row = {"MiB": mib}
        for name, fn in (
            ("shm all-gather", shm_all_gather),
            ("shm reduce-scatter", shm_reduce_scatter),
            ("gloo all-gather", gloo_all_gather),
            ("gloo reduce-scatter", gloo_reduce_scatter),
        ):
            fn()
            row[name] = nbytes / _timed(fn, reps) / 1e9
        dist.barrier()
        copy_s = _copy_s(nbytes, reps) if rank == 0 else 0.0
        dist.barrier()
        row["copy"] = nbytes / copy_s / 1e9 if rank == 0 else 0.0
        rows.append(row)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", default="shm_bandwidth.json")
    args = parser.parse_args()
    cpu.load_extension()  # built once before the ranks start
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        mp.start_processes(
            _rank, (args.nproc, f"file://{tmp}/store", args.reps, out), nprocs=args.nproc, start_method="spawn"
        )
        rows = json.load(open(out))
    names = [k for k in rows[0] if k != "MiB"]
    print(f"{'MiB':>5} " + " ".join(f"{n:>20}" for n in names) + "   GB/s; shm / copy")
    for row in rows:
        ratio = f"{row['shm all-gather'] / row['copy']:.2f} / {row['shm reduce-scatter'] / row['copy']:.2f}"
        print(f"{row['MiB']:>5} " + " ".join(f"{row[n]:>20.2f}" for n in names) + f"   {ratio}")
    with open(args.json, "w") as f:
        json.dump({"nproc": args.nproc, "reps": args.reps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
