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
from pathlib import Path


def run_as_module(file: str) -> int:
    here = Path(file).resolve().parent
    paths = [str(here), str(here.parent)]
    sys.path[:0] = paths
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [*paths, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    )
    return importlib.import_module(Path(file).stem).main()
