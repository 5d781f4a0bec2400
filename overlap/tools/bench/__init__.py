"""`overlap bench`: microbenchmarks that give the numbers users choose a setup by.

    overlap bench comm      nccl-tests-style collective sweep (all_gather, reduce_scatter, ...)
    overlap bench overlap   compute alone vs comm alone vs both at once: how much comm hides
    overlap bench step      a training step side by side: overlap, FSDP2, DDP and two floors
    overlap bench overhead  the CPU cost per unit of each wrapper on a model with almost no compute
    overlap bench memory    peak memory per rank, each contender in its own fresh processes
    overlap bench mesh      FSDP x TP: overlap beside FSDP2 on a (dp, tp) mesh

Each benchmark is a module exposing `add_arguments(parser)`, `run(args) -> int` and an importable
function taking a frozen config whose fields are its flags (overlap/tools/flags.py); adding one is
one row in `BENCHES`. comm, overlap and step accept `--link RATE[,DELAY]` to run the ranks over an
emulated network link (`overlap.tools.worlds.link`). The peers (DeepSpeed ZeRO-3, DDP's
compression hooks, PowerSGD) are built in `peers/`; their packages come with the `bench` extra
(`pip install overlap[bench]`), and a peer whose package is missing is skipped with one line.
"""

from __future__ import annotations

import argparse
import importlib

from overlap.tools.worlds.link import LinkError

BENCHES: dict[str, tuple[str, str]] = {
    "comm": ("overlap.tools.bench.comm", "collective bandwidth sweep, printed as nccl-tests does"),
    "overlap": ("overlap.tools.bench.overlap", "matmuls with concurrent collectives: share of comm hidden"),
    "step": (
        "overlap.tools.bench.step",
        "training step side by side (overlap, FSDP2, DDP, floors); --nproc 1,2,4 for scaling",
    ),
    "overhead": (
        "overlap.tools.bench.overhead",
        "per-unit wrapper overhead over the plain model (U tiny blocks); --profile for cProfile",
    ),
    "memory": (
        "overlap.tools.bench.memory",
        "peak memory per rank of overlap, FSDP2 and DDP, each in its own fresh process world",
    ),
    "mesh": ("overlap.tools.bench.mesh", "FSDP x TP: overlap beside FSDP2 on a (dp, tp) mesh"),
}
"""Benchmark -> (module, one-line help); a module is imported only when its benchmark is chosen."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one sub-parser per benchmark; each module adds its own flags."""
    sub = parser.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for name, (module, help_text) in BENCHES.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(p)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark chosen on the command line; its exit code. A link that cannot be set
    up here (not root, no iproute2) is a one-line error, not a traceback."""
    try:
        return int(importlib.import_module(BENCHES[args.bench][0]).run(args))
    except LinkError as e:
        raise SystemExit(f"overlap bench {args.bench}: {e}") from None
