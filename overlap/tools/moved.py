"""Old import paths of modules that moved, kept for one release: an old module is the new
module object itself (as `overlap.comm` is), and importing it by the old path warns once.

Two ways in: a module left at its old path calls `alias_module` from its body (the step model's
old homes under overlap/tools/plan), and every row of `MOVED` is served by `MovedFinder`, which
`overlap.tools` installs, so the folders hold no leftover files.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

MOVED: dict[str, str] = {
    # worlds: where ranks run
    "overlap.tools.launch": "overlap.tools.worlds.launch",
    "overlap.tools.bench.link": "overlap.tools.worlds.link",
    "overlap.tools.bench.world": "overlap.tools.worlds.runner",
    # workloads: what they train
    "overlap.tools.models": "overlap.tools.workloads",
    "overlap.tools.models.gpt": "overlap.tools.workloads.gpt",
    "overlap.tools.data": "overlap.tools.workloads.data",
    "overlap.tools.bench.step_workload": "overlap.tools.bench.step",
    # demo, bench step and the peers as folders
    "overlap.tools.demo_config": "overlap.tools.demo.config",
    "overlap.tools.demo_checkpoint": "overlap.tools.demo.checkpoint",
    "overlap.tools.demo_metrics": "overlap.tools.demo.metrics",
    "overlap.tools.demo_train": "overlap.tools.demo.train",
    "overlap.tools.bench.step_contenders": "overlap.tools.bench.step.contenders",
    "overlap.tools.bench.step_protocol": "overlap.tools.bench.step.protocol",
    "overlap.tools.bench.step_report": "overlap.tools.bench.step.report",
    "overlap.tools.bench.peers_trainer": "overlap.tools.bench.peers.trainer",
    "overlap.tools.bench.peers_ddp_hooks": "overlap.tools.bench.peers.ddp_hooks",
    "overlap.tools.bench.peers_deepspeed": "overlap.tools.bench.peers.deepspeed",
}
"""Old module name -> the module it is now. Delete a row when its release has passed."""


def warn_moved(old_name: str, new_name: str, stacklevel: int = 3) -> None:
    """The DeprecationWarning of importing `old_name`, called from that module's body: it points
    at the line that imports it (`warnings` skips the import machinery's frames)."""
    warnings.warn(
        f"{old_name} moved to {new_name}: import it from there ({old_name} is an alias for one release)",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def alias_module(old_name: str, module: ModuleType) -> None:
    """Make `old_name` (the module being imported) the same object as `module`, with a warning."""
    warn_moved(old_name, module.__name__, stacklevel=4)
    sys.modules[old_name] = module


class MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old names of `MOVED`; loading one imports the new module and puts it in
    `sys.modules` under the old name too (the import system returns what stands there)."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=False)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # a placeholder; exec_module replaces it

    def exec_module(self, module: ModuleType) -> None:
        new = importlib.import_module(MOVED[module.__name__])
        warn_moved(module.__name__, new.__name__, stacklevel=3)
        sys.modules[module.__name__] = new


def install() -> None:
    """Serve the old names of `MOVED` (once per process; `overlap.tools` calls it)."""
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        # First: an old name whose parent is itself an alias (overlap.tools.models.gpt) would
        # otherwise be found again as a file in the new folder and loaded a second time.
        sys.meta_path.insert(0, MovedFinder())
