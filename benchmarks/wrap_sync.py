"""What DDP's promise costs at wrap: `overlap.wrap` with and without `sync_module_states`.

    python benchmarks/wrap_sync.py                     # W1 and 12 x TEL(1024), 2 gloo ranks
    python benchmarks/wrap_sync.py --rounds 5 --json out/wrap_sync.json

One world. Per model and round, each rank builds the model (seeded per rank, not timed), then
times `overlap.wrap` after a barrier; rounds alternate which setting goes first. Prints the
median wall time of wrap over rounds (the slowest rank's), and the bytes rank 0 scatters.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's `overlap`

import torch
import torch.distributed as dist
import torch.nn as nn

import overlap
from overlap.tools.worlds.launch import run_local_world

MODELS = {  # name: (layers, d_model, heads, dim_feedforward)
    "W1 (8 x TEL 512/8/2048)": (8, 512, 8, 2048),
    "12 x TEL 1024/16/4096": (12, 1024, 16, 4096),
}


def build(rank: int, layers: int, dim: int, heads: int, ff: int) -> nn.Module:
    torch.manual_seed(100 + rank)  # as a DDP script that seeds ranks differently
    return nn.Sequential(
        *[nn.TransformerEncoderLayer(dim, heads, ff, batch_first=True, dropout=0.0) for _ in range(layers)]
    )


def timed_wrap(rank: int, shape: tuple[int, int, int, int], sync: bool) -> float:
    model = build(rank, *shape)
    dist.barrier()
    start = time.perf_counter()
    overlap.wrap(model, sync_module_states=sync)
    seconds = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return seconds.item() * 1e3


def measure(rank: int, world_size: int, rounds: int) -> list[dict] | None:
    rows = []
    for name, shape in MODELS.items():
        times: dict[bool, list[float]] = {False: [], True: []}
        timed_wrap(rank, shape, True)  # warm-up: extension load, allocator, gloo pairs
        for r in range(rounds):
            for sync in (False, True) if r % 2 == 0 else (True, False):
                times[sync].append(timed_wrap(rank, shape, sync))
        numel = sum(p.numel() for p in build(rank, *shape).parameters())
        rows.append(
            {
                "model": name,
                "params": numel,
                "scattered_bytes": numel * 4 * (world_size - 1) // world_size,
                "wrap_ms_no_sync": times[False],
                "wrap_ms_sync": times[True],
            }
        )
    return rows if rank == 0 else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args()
    rows = run_local_world(measure, args.nproc, args.rounds, threads_per_rank=1)[0]
    print(f"overlap.wrap wall time, median of {args.rounds} alternating rounds, {args.nproc} gloo ranks")
    print(f"{'model':<26}{'params':>12}{'scattered MB':>14}{'no sync ms':>12}{'sync ms':>10}{'extra ms':>10}")
    for row in rows:
        off, on = statistics.median(row["wrap_ms_no_sync"]), statistics.median(row["wrap_ms_sync"])
        print(
            f"{row['model']:<26}{row['params']:>12,}{row['scattered_bytes'] / 1e6:>14.1f}"
            f"{off:>12.1f}{on:>10.1f}{on - off:>10.1f}"
        )
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps({"nproc": args.nproc, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
