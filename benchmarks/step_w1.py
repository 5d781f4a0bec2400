"""W1: one training step of an 8-layer transformer on CPU/gloo, overlap vs FSDP2 vs DDP vs floors.

    python benchmarks/step_w1.py                       # W1, all contenders, 3 rounds
    python benchmarks/step_w1.py --overlap-config prefetch_depth=2 --json out/w1.json
    python benchmarks/step_w1.py --contenders ddp,floor-compute --layers 2 --rounds 1
    python benchmarks/step_w1.py --link 1gbit          # each rank behind an emulated 1 Gbit/s link

`overlap bench step --model w1` with W1's defaults, plus `--world-size N` (the same as
`--nproc N`). The protocol, contenders, floors, parity guard, memory accounting and JSON schema
are documented in overlap/tools/bench/step/.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's `overlap`

from overlap.tools.bench import step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    step.add_arguments(parser)
    parser.add_argument("--world-size", type=int, default=None, help="ranks (same as --nproc N)")
    parser.set_defaults(model="w1")
    args = parser.parse_args()
    if args.world_size is not None:
        args.nproc = (args.world_size,)
    return step.run(args)


if __name__ == "__main__":
    sys.exit(main())
