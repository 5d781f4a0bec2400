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


PACKAGE = Path(overlap.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports, read with `ast`: top-level, lazy (inside a
    function) and `TYPE_CHECKING` imports alike. `from pkg import name` counts as importing
    `pkg.name` when that is a module, else `pkg`. A module importing a package above it (its own
    `__init__`) is left out: a package re-exporting its children would otherwise close a circle."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}

    def resolve(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolved against the importing package
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                found = resolve(target) if target.split(".")[0] == "overlap" else ""
                if found and found != name and not name.startswith(found + "."):
                    edges.add(found)
        graph[name] = edges
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


KNOWN_CIRCLES: list[list[str]] = []
"""Every circle the graph holds, exactly: a new one fails, and so does a known one that is gone
(then delete its row)."""


def test_graph_reads_lazy_and_type_checking_imports():
    graph = import_graph()
    assert "overlap.tools.bench.mesh" in graph["overlap.tools.bench.step"]  # top-level
    assert "overlap.observe.report" in graph["overlap.tools.bench.step.contenders"]  # lazy, inside a function
    assert "overlap.engine.compose" in graph["overlap.engine.units"]  # TYPE_CHECKING only
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle_but_the_known_ones():
    assert circles(import_graph()) == KNOWN_CIRCLES


def test_planner_dispatcher_sits_above_both_paths():
    """estimate() picks fsdp.py's path or parallel.py's; neither imports estimate.py, and the old
    names stay importable from it as the same objects."""
    graph = import_graph()
    assert {"overlap.tools.plan.fsdp", "overlap.tools.plan.parallel"} <= graph["overlap.tools.plan.estimate"]
    assert "overlap.tools.plan.estimate" not in graph["overlap.tools.plan.parallel"] | graph["overlap.tools.plan.fsdp"]
    from overlap.tools.plan import estimate, fsdp

    for name in ("Cluster", "Estimate", "MemoryEstimate", "build_units", "check_whole_nodes", "dtype_bytes"):
        assert getattr(estimate, name) is getattr(fsdp, name), name


APPS = ("demo", "plan", "tune", "bench")
"""The commands' layers under overlap/tools; below them `worlds`, `workloads` and `flags`."""
BELOW_APPS = ("worlds", "workloads", "flags", "moved")
PLAN_CROSSINGS: dict[str, set[str]] = {}
"""What the planner may still reach of another command (none: it uses worlds and workloads)."""


def tool_layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["overlap", "tools"] else None


def test_commands_use_worlds_and_workloads_never_each_other():
    """demo, plan, tune and bench import (top-level, lazily or for types) their own modules,
    worlds, workloads and the flag helper, never another command's; worlds, workloads and flags
    import no command."""
    graph = import_graph()
    crossings: dict[str, set[str]] = {}
    for module, edges in graph.items():
        layer = tool_layer(module)
        for target in edges:
            other = tool_layer(target)
            if layer is None or other is None or other == layer:
                continue
            if (layer in APPS and other not in BELOW_APPS) or (layer in BELOW_APPS and other in APPS):
                crossings.setdefault(module, set()).add(target)
    plan = {m: t for m, t in crossings.items() if tool_layer(m) == "plan"}
    others = {m: t for m, t in crossings.items() if tool_layer(m) != "plan"}
    assert others == {}, others
    for module, targets in plan.items():
        assert targets <= PLAN_CROSSINGS.get(module, set()), (module, targets)
    assert tool_layer("overlap.tools.worlds.launch") == "worlds" and "bench" in APPS  # the test reads names


def test_old_tool_paths_are_the_new_modules_and_warn():
    """Every module that moved is importable by its old name for one release: the same module
    object, with one DeprecationWarning naming the new path."""
    code = """
import importlib, json, warnings
from overlap.tools.moved import MOVED
out = {}
for old, new in MOVED.items():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    moved = [str(w.message) for w in seen if issubclass(w.category, DeprecationWarning) and old in str(w.message)]
    out[old] = [module is importlib.import_module(new), len(moved), new in (moved or [""])[0]]
from overlap.tools.models.gpt import GPT
from overlap.tools.workloads import gpt
out["from the old path"] = GPT is gpt.GPT
print(json.dumps(out))
"""
    out = json.loads(run_python(code))
    assert len(out) > 15
    for old, row in out.items():
        assert row in ([True, 1, True], True), (old, row)


def test_import_overlap_tools_loads_no_command():
    loaded = json.loads(run_python("import json, sys, overlap.tools; print(json.dumps(sorted(sys.modules)))"))
    assert [m for m in loaded if tool_layer(m) in APPS] == []
