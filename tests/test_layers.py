"""The step model's place in the layers: below the engine's autotune, which imports it, and below
the tools, which build on it. `import overlap` loads none of the tools; the step model imports
nothing from them nor from autotune; its old paths under overlap/tools/plan still work, warn,
and are the same objects. Subprocesses: a fresh interpreter sees what an import loads."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import overlap

STEP_MODEL = Path(overlap.__file__).parent / "step_model"


def run_python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_import_overlap_loads_no_tools_and_the_step_model_directly():
    loaded = json.loads(run_python("import json, sys, overlap; print(json.dumps(sorted(sys.modules)))"))
    assert [m for m in loaded if m.startswith("overlap.tools")] == []
    assert "overlap.step_model.online" in loaded  # autotune's proposals, imported by the engine


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports: top-level, lazy and `TYPE_CHECKING` ones alike."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            raise AssertionError(f"{path.name}: a relative import; the layers are read by absolute names")
    return names


def test_step_model_imports_nothing_above_it():
    files = sorted(STEP_MODEL.glob("*.py"))
    assert {f.stem for f in files} >= {"cost", "simulate", "calibration", "online", "tuning"}
    for path in files:
        above = [
            m for m in imported_modules(path)
            if m.startswith(("overlap.tools", "overlap.engine.autotune", "overlap.engine.wrap", "overlap.engine.state"))
            or m in ("overlap", "overlap.api")
        ]  # fmt: skip
        assert above == [], f"overlap/step_model/{path.name} imports {above}"


def test_old_paths_are_the_step_model_and_warn():
    code = """
import json, warnings
warnings.simplefilter("always")
out = {}
for name in ("simulate", "cost", "online", "calibration"):
    with warnings.catch_warnings(record=True) as seen:
        old = __import__(f"overlap.tools.plan.{name}", fromlist=["_"])
    new = __import__(f"overlap.step_model.{name}", fromlist=["_"])
    moved = [str(w.message) for w in seen if issubclass(w.category, DeprecationWarning)]
    out[name] = [old is new, len(moved), moved[0] if moved else ""]
from overlap.tools.plan.calibration import Calibration, default_world_calibration
from overlap.step_model import calibration
out["same class"] = Calibration is calibration.Calibration
out["link text"] = default_world_calibration(2, "gloo", "1gbit").gather_link.name
print(json.dumps(out))
"""
    out = json.loads(run_python(code))
    for name in ("simulate", "cost", "online"):
        same, warned, message = out[name]
        assert same and warned == 1 and f"overlap.step_model.{name}" in message, (name, out[name])
    same, warned, message = out["calibration"]  # its own module: the old `--link` text form of one function
    assert not same and warned == 1 and "overlap.step_model.calibration" in message, out["calibration"]
    assert out["same class"] and out["link text"] == "emulated:1gbit", out
