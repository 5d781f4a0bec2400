"""Shared-memory all-gather and reduce-scatter against a memory copy and gloo's, 1-64 MiB.

    python benchmarks/shm_bandwidth.py [--nproc 2] [--reps 20] [--json PATH]

Each size S is what one collective delivers to a rank: an all-gather's output (S / nproc sent by
each rank) and a reduce-scatter's input (S summed into S / nproc). Bandwidth = S / the time of
one collective (issue, then wait) on the slowest rank. Each collective's buffers are where the
engine's strategies put them: a shared-memory all-gather's output is allocated by the strategy
(`ShmAllGather.allocate`: in the rank's ring, where peers read its row in place) inside the
clock and dropped after the wait, as the runtime drops it after copy-out; gloo's all-gathers write
into one output buffer kept across calls. A reduce-scatter's input is written (the copy-in every
transport has) before its clock starts, as the training step does; the sum's output is allocated
by the collective, with the engine's allocator settings (`keep_freed_cpu_memory`).

The floor, `copy`, is one memcpy of S bytes (`csrc/shm.cpp`'s) between two private buffers kept
across calls, run by every rank at once: the same number of processes on the same cores as the
collectives. The contenders are interleaved: each of `--reps` rounds times each of them in turn
(calls back to back, at least 8 MiB a round, after a barrier), so load that comes and goes on a
shared machine falls on all of them alike. Prints the median and the spread (min-max over the
rounds) of each, and the collectives' medians as a share of the copy's; writes JSON.

Where the time goes: `waits excluded` is the same shared-memory calls' bandwidth counting only
the time outside flag waits (the peer had not posted yet: `shm_wait_flag`, and the waits a pull
clocks itself), that is the copies,
the sums, posts and bookkeeping, the collective's own work on one rank.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from overlap.kernels import cpu
from overlap.tools.bench import comm as bench_comm
from overlap.transport import collectives as comm
from overlap.transport import shm
from overlap.transport.host import keep_freed_cpu_memory

SIZES_MIB = (1, 4, 16, 64)
ROUND_BYTES = 8 << 20  # calls back to back in one round: at least this many bytes delivered
NAMES = ("copy", "shm all-gather", "shm reduce-scatter", "gloo all-gather", "gloo reduce-scatter")
WORK = ("shm all-gather", "shm reduce-scatter")  # also timed without their flag waits


class _WaitClock:
    """The compiled module, with the seconds spent in flag waits added up."""

    def __init__(self, ext: object) -> None:
        self.ext, self.waited_s = ext, 0.0

    def __getattr__(self, name: str) -> object:
        return getattr(self.ext, name)

    def shm_wait_flag(self, *args: object) -> int:
        t0 = time.perf_counter()
        status = self.ext.shm_wait_flag(*args)
        self.waited_s += time.perf_counter() - t0
        return status

    def shm_pull_gather(self, *args: object) -> list[int]:
        outcome = self.ext.shm_pull_gather(*args)
        self.waited_s += outcome[-1] / 1e9  # the pull's own clock around its flag waits
        return outcome

    def shm_pull_reduce(self, *args: object) -> list[int]:
        outcome = self.ext.shm_pull_reduce(*args)
        self.waited_s += outcome[-1] / 1e9
        return outcome


def _round_s(step: Callable[[], float], calls: int, clock: _WaitClock) -> tuple[float, float]:
    """Seconds per call over `calls` calls after a barrier, and the same outside flag waits, on
    the slowest rank; `step` returns the seconds of one call that count."""
    dist.barrier()
    waited_s = clock.waited_s
    spent = sum(step() for _ in range(calls))
    slowest = torch.tensor([spent / calls, (spent - clock.waited_s + waited_s) / calls])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest[0].item(), slowest[1].item()


def _clocked(fn: Callable[[], None]) -> Callable[[], float]:
    def step() -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return step


def _contenders(seg: shm.ShmSegments, nbytes: int, nproc: int) -> dict[str, Callable[[], float]]:
    group, ext = dist.group.WORLD, cpu.load_extension()
    numel = nbytes // 4 // nproc
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    part, out = torch.randn(numel), torch.zeros(nproc * numel)
    full = torch.randn(nproc, numel)

    def shm_reduce_scatter() -> float:
        room = bench_comm.shm_stage(seg, full)  # the copy-in, outside the clock
        t0 = time.perf_counter()
        bench_comm.shm_reduce_scatter(seg, room)
        return time.perf_counter() - t0

    def gloo_reduce_scatter() -> float:
        buf = torch.empty_like(full)
        buf.copy_(full)
        t0 = time.perf_counter()
        comm.wait(comm.reduce_scatter_flat(buf.view(-1), group, nproc, "all_to_all"))
        return time.perf_counter() - t0

    return {
        "copy": _clocked(lambda: ext.shm_copy_bytes(dst, src)),
        "shm all-gather": _clocked(lambda: bench_comm.shm_all_gather(seg, part, out)),
        "shm reduce-scatter": shm_reduce_scatter,
        "gloo all-gather": _clocked(
            lambda: comm.wait(comm.all_gather_flat(part, group, nproc, torch.float32, out=out))
        ),
        "gloo reduce-scatter": gloo_reduce_scatter,
    }


def _rank(rank: int, nproc: int, init: str, reps: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=nproc, timeout=timedelta(seconds=300))
    torch.set_num_threads(1)
    keep_freed_cpu_memory()  # as `wrap` sets it: freed blocks are reused, not fresh pages
    seg = shm.ShmSegments(dist.group.WORLD, 4 * (max(SIZES_MIB) << 20), timedelta(seconds=120))
    seg.ext = clock = _WaitClock(seg.ext)
    rows = []
    for mib in SIZES_MIB:
        nbytes = mib << 20
        calls = max(1, ROUND_BYTES // nbytes)
        contenders = _contenders(seg, nbytes, nproc)
        for step in contenders.values():  # warm: pages mapped, buffers allocated
            step()
        times: dict[str, list[float]] = {name: [] for name in (*contenders, *(f"{n}, waits excluded" for n in WORK))}
        for _ in range(reps):
            for name, step in contenders.items():
                spent, working = _round_s(step, calls, clock)
                times[name].append(spent)
                if name in WORK:
                    times[f"{name}, waits excluded"].append(working)
        row: dict[str, object] = {"MiB": mib, "calls_per_round": calls}
        for name, ts in times.items():
            gbps = sorted(nbytes / t / 1e9 for t in ts)
            row[name] = {"median_gbps": statistics.median(gbps), "min_gbps": gbps[0], "max_gbps": gbps[-1]}
        rows.append(row)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=os.path.dirname(__file__)
        ).stdout.strip()
    except OSError:
        return ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--reps", type=int, default=20, help="rounds, each timing every contender in turn")
    parser.add_argument("--json", default="shm_bandwidth.json")
    args = parser.parse_args()
    cpu.load_extension()  # built once before the ranks start
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        mp.start_processes(
            _rank, (args.nproc, f"file://{tmp}/store", args.reps, out), nprocs=args.nproc, start_method="spawn"
        )
        with open(out) as f:
            rows = json.load(f)
    load_after = os.getloadavg()
    print(f"{args.nproc} ranks, {args.reps} rounds; GB/s median (min-max over rounds); % of copy: the medians")
    names = (*NAMES, *(f"{n}, waits excluded" for n in WORK))
    shares = (*WORK, *(f"{n}, waits excluded" for n in WORK))
    print(f"{'MiB':>4} " + " ".join(f"{n.replace(', waits excluded', ' -w'):>22}" for n in names))
    for row in rows:
        cells = [f"{row[n]['median_gbps']:.2f} ({row[n]['min_gbps']:.1f}-{row[n]['max_gbps']:.1f})" for n in names]
        print(f"{row['MiB']:>4} " + " ".join(f"{c:>22}" for c in cells))
    print(
        "% of copy (medians): " + " / ".join(s.replace("shm ", "").replace(", waits excluded", " -w") for s in shares)
    )
    for row in rows:
        copy = row["copy"]["median_gbps"]
        print(f"{row['MiB']:>4} " + " / ".join(f"{100 * row[n]['median_gbps'] / copy:.0f}" for n in shares))
    print(f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after; commit {_commit()}")
    with open(args.json, "w") as f:
        json.dump(
            {
                "nproc": args.nproc,
                "reps": args.reps,
                "load_avg": [load_before, load_after],
                "commit": _commit(),
                "rows": rows,
            },
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
