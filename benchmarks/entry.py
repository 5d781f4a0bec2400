"""Run a benchmark script as a module its ranks can import.

Ranks unpickle a benchmark's rank function by module name: spawned ranks find the module on
sys.path, ranks behind an emulated link (fresh interpreters in their own network namespaces)
through PYTHONPATH. `run_as_module(__file__)` puts the script's folder and the checkout (its
`overlap`) on both, imports the script as a module and runs its `main()`.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def run_as_module(file: str) -> int:
    here = Path(file).resolve().parent
    paths = [str(here), str(here.parent)]
    sys.path[:0] = paths
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [*paths, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    )
    return importlib.import_module(Path(file).stem).main()


def run_timed(name: str, rank_fn: Callable[..., Any], cfg: Any) -> int:
    """`run_bench(rank_fn, cfg)` (its worlds, report and JSON), then the wall time it took in
    all; the exit status, 0."""
    from overlap.tools.worlds.runner import run_bench

    t0 = time.perf_counter()
    run_bench(rank_fn, cfg)
    print(f"{name}: {time.perf_counter() - t0:.0f} s in all")
    return 0
