"""What a dropped model leaves behind: build, wrap, train and drop a model, round after round.

    python benchmarks/dropped_models.py                       # overlap, FSDP2, DDP; 2 gloo ranks
    python benchmarks/dropped_models.py --rounds 6 --json out/dropped.json

A tuner, a notebook or a sweep builds model after model in one process. Each round, every
contender (in its own spawned world, so that high-water marks do not mix) builds W1
(8 x TransformerEncoderLayer 512/8/2048), wraps it, trains two AdamW steps, then drops model and
optimizer and runs `gc.collect()`. Printed per contender: the resident memory of rank 0 after
each round's release, its growth per round (least squares over rounds 2..N: the first round
also pays for one-time allocations), and how many of the contender's per-model objects are
still alive after the last round (overlap's `OverlapState`, FSDP2's `FSDPParamGroup`s, DDP's
`DistributedDataParallel`). One model's own bytes (its fp32 shard plus AdamW's two moments, on
rank 0) are printed beside, as the yardstick for a leak.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's `overlap`

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

import overlap
from overlap.observe.monitor import rss_bytes
from overlap.tools.worlds.launch import run_local_world

CONTENDERS = ("overlap", "fsdp2", "ddp")
LIVE_TYPES = {"overlap": "OverlapState", "fsdp2": "FSDPParamGroup", "ddp": "DistributedDataParallel"}


def build(layers: int, dim: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.TransformerEncoderLayer(dim, 8, 4 * dim, batch_first=True, dropout=0.0) for _ in range(layers)]
    )


def wrap(contender: str, model: nn.Module) -> nn.Module:
    if contender == "overlap":
        return overlap.wrap(model)
    if contender == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            fully_shard(layer)
        return fully_shard(model)
    return nn.parallel.DistributedDataParallel(model)


def _local_bytes(t: torch.Tensor) -> int:
    t = t._local_tensor if isinstance(t, DTensor) else t  # type: ignore[attr-defined]
    return t.numel() * t.element_size()


def rounds_rank(rank: int, world_size: int, contender: str, rounds: int, layers: int, dim: int) -> dict:
    torch.set_num_threads(1)
    after, model_bytes = [], 0
    for _ in range(rounds):
        model = wrap(contender, build(layers, dim))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for _ in range(2):
            model(torch.randn(2, 64, dim)).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        model_bytes = sum(_local_bytes(p) for p in model.parameters()) + sum(
            _local_bytes(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()
        )
        del model, opt
        gc.collect()
        after.append(rss_bytes())
    live = sum(type(o).__name__ == LIVE_TYPES[contender] for o in gc.get_objects())
    return {"rss_after": after, "model_bytes": model_bytes, "live": live}


def growth_per_round(values: list[int]) -> float:
    """Least-squares slope over rounds 2..N (bytes per round)."""
    ys = values[1:]
    if len(ys) < 2:
        return float("nan")
    xs = list(range(len(ys)))
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--json", dest="json_path", default=None)
    args = ap.parse_args(argv)
    mib = 1 << 20
    report = {}
    print(
        f"{args.rounds} rounds of build + wrap + 2 AdamW steps + drop; W-like {args.layers} x TEL {args.dim}; "
        f"{args.nproc} gloo ranks, rank 0's RSS after each release (MiB)"
    )
    for contender in args.contenders.split(","):
        if contender not in CONTENDERS:
            raise SystemExit(f"unknown contender {contender!r}; pick from {', '.join(CONTENDERS)}")
        r = run_local_world(rounds_rank, args.nproc, contender, args.rounds, args.layers, args.dim, deadline_s=1800)[0]
        slope = growth_per_round(r["rss_after"])
        report[contender] = dict(r, growth_per_round=slope)
        print(
            f"{contender:8s} after each round: {' '.join(f'{b / mib:7.0f}' for b in r['rss_after'])}"
            f" | growth {slope / mib:+7.1f} MiB/round | one model {r['model_bytes'] / mib:6.1f} MiB"
            f" | alive after the last round: {r['live']} {LIVE_TYPES[contender]}"
        )
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
