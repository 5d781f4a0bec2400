"""Does the order of a gloo exchange's sends and receives decide how long it takes?

    python benchmarks/exchange_order.py                      # 2 ranks behind the emulated 1 Gbit link
    python benchmarks/exchange_order.py --world loopback --mib 6 --calls 20

Two ranks exchange `--mib` MiB each way (W1's one-layer exchange by default: 6 MiB, half of a
12 MiB unit), `--calls` times per way, the ways interleaved call by call; before each call the
ranks meet at a barrier and the call is timed on both (the slowest rank's time counts). Ways:

   one direction   rank 0 sends, rank 1 receives: the wire's time for the bytes, the floor
   all_to_all      `dist.all_to_all_single` with the peer's splits (what the exchange was)
   send first      `isend` then `irecv`, as gloo's all-to-all posts them
   receive first   `pairwise.exchange`: every `irecv`, then every `isend` ([Note: receive
                   before send] in overlap/transport/pairwise.py)

Prints the median, min-max and each call's time in ms; the ratio of each way's median to the
floor's. `--world` takes what `overlap.tools.plan.world.World.parse` takes (`1gbit` needs root
and iproute2).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

WAYS = ("one direction", "all_to_all", "send first", "receive first")


def rank_fn(rank: int, world_size: int, numel: int, calls: int) -> dict[str, list[float]]:
    from overlap.tools.plan.world import max_over_ranks
    from overlap.transport import pairwise

    assert world_size == 2, world_size
    peer = 1 - rank
    send, recv = torch.randn(numel), torch.empty(numel)
    splits = [0, 0]
    splits[peer] = numel
    receives: list[torch.Tensor | None] = [None, None]
    sends: list[torch.Tensor | None] = [None, None]
    receives[peer], sends[peer] = recv, send

    def one_direction() -> None:
        if rank == 0:
            dist.send(send, 1)
        else:
            dist.recv(recv, 0)

    def all_to_all() -> None:
        dist.all_to_all_single(recv, send, output_split_sizes=splits, input_split_sizes=splits)

    def send_first() -> None:
        works = [dist.isend(send, peer), dist.irecv(recv, peer)]
        for work in works:
            work.wait()

    def receive_first() -> None:
        pairwise.exchange(dist.group.WORLD, receives, sends).wait()

    ways: dict[str, Any] = dict(zip(WAYS, (one_direction, all_to_all, send_first, receive_first)))
    for fn in ways.values():  # warm-up: connections, buffers
        fn()
    times: dict[str, list[float]] = {way: [] for way in ways}
    for _ in range(calls):
        for way, fn in ways.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times[way].append(time.perf_counter() - t0)
    return {way: [t * 1e3 for t in max_over_ranks(ts)] for way, ts in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", default="1gbit", help="loopback or a link: 1gbit, 100mbit,200us (default 1gbit)")
    parser.add_argument("--mib", type=float, default=6.0, help="MiB each way (default 6: W1's one-layer exchange)")
    parser.add_argument("--calls", type=int, default=12, help="timed calls per way (default 12)")
    args = parser.parse_args()
    if args.calls < 1 or args.mib <= 0:
        parser.error("--calls must be >= 1 and --mib > 0")
    from overlap.tools.plan.world import World

    world = World.parse(args.world)
    if world.num_ranks != 2:
        parser.error(f"--world {args.world!r}: the exchange is between two ranks")
    numel = int(args.mib * 2**20) // 4
    print(f"{args.world}, 2 ranks, {numel * 4 / 2**20:g} MiB each way, {args.calls} calls per way (interleaved)")
    result = world.run(rank_fn, numel, args.calls)[0]
    floor = statistics.median(result["one direction"])
    print(f"{'way':15s} {'median ms':>10s} {'min-max':>15s} {'/ floor':>8s}  calls")
    for way, ms in result.items():
        med = statistics.median(ms)
        spread = f"{min(ms):.1f}-{max(ms):.1f}"
        print(f"{way:15s} {med:10.1f} {spread:>15s} {med / floor:7.2f}x  {' '.join(f'{t:.0f}' for t in ms)}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from entry import run_as_module  # ranks import this script by module name

    sys.exit(run_as_module(__file__))
