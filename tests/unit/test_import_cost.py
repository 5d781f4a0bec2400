"""`import overlap` costs about what `import torch` does: DTensor (torch.distributed.tensor),
torch._dynamo, torch.distributed.checkpoint and triton load on first use ([Note: import cost] in
overlap/engine/lazy_torch.py). Each check runs in a fresh interpreter, which sees what an import
loads; none times anything (a loaded machine makes wall time meaningless), they check which modules
are loaded and that the deferred features still work."""

from __future__ import annotations

import json
import subprocess
import sys

DEFERRED = ("torch.distributed.tensor", "torch._dynamo", "torch.distributed.checkpoint", "triton")


def loaded_after(code: str) -> dict[str, bool]:
    """Run `code` in a fresh interpreter; which of DEFERRED are loaded after it."""
    probe = f"import json, sys; print(json.dumps({{m: m in sys.modules for m in {DEFERRED!r}}}))"
    done = subprocess.run([sys.executable, "-c", f"{code}\n{probe}"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_import_overlap_defers_dtensor_dynamo_and_dcp():
    assert loaded_after("import overlap; overlap.wrap; overlap.ShardedGradScaler") == dict.fromkeys(DEFERRED, False)


def test_checkpoint_loads_on_first_access():
    code = """
import overlap
assert "checkpoint" in dir(overlap) and "checkpoint" in overlap.__all__
save, load, latest = overlap.checkpoint.save, overlap.checkpoint.load, overlap.checkpoint.latest
from overlap import checkpoint
import overlap.checkpoint as again
assert checkpoint is again is overlap.checkpoint and callable(save) and callable(load) and callable(latest)
"""
    assert loaded_after(code)["torch.distributed.checkpoint"]


def test_missing_attribute_is_an_attribute_error():
    code = """
import overlap
try:
    overlap.no_such_name
except AttributeError as error:
    assert "no_such_name" in str(error)
else:
    raise AssertionError("no AttributeError")
assert not hasattr(overlap, "no_such_name")
"""
    assert not loaded_after(code)["torch.distributed.checkpoint"]


def test_cli_help_loads_no_command_and_nothing_deferred():
    code = """
import contextlib, io, sys
from overlap.tools.cli import main
with contextlib.redirect_stdout(io.StringIO()) as out:
    try:
        main(["--help"])
    except SystemExit as done:
        assert done.code == 0, done.code
assert "usage: overlap" in out.getvalue()
assert not [m for m in sys.modules if m.startswith(("overlap.tools.plan", "overlap.tools.bench"))]
"""
    assert loaded_after(code) == dict.fromkeys(DEFERRED, False)


def test_subcommand_help_loads_nothing_deferred():
    """Each command's --help imports its module (to add its flags), none of the deferred ones."""
    code = """
import contextlib, io
from overlap.tools.cli import COMMANDS, main
for command in COMMANDS:
    with contextlib.redirect_stdout(io.StringIO()) as out:
        try:
            main([command, "--help"])
        except SystemExit as done:
            assert done.code == 0, (command, done.code)
    assert "usage: overlap " + command in out.getvalue(), command
"""
    assert loaded_after(code) == dict.fromkeys(DEFERRED, False)


def test_wrap_and_a_step_leave_dcp_out():
    """A one-rank world: wrap builds DTensors (DTensor loads then, and dynamo with it:
    `DTensor.from_local` is `torch.compiler.disable`d) and trains a step; nothing saves, so DCP
    stays out."""
    code = """
import os, tempfile, torch, torch.distributed as dist, torch.nn as nn
import overlap
torch.manual_seed(0)
store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
model = overlap.wrap(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)))
opt = torch.optim.AdamW(model.parameters(), lr=0.1)
for _ in range(2):
    model(torch.randn(4, 8)).square().sum().backward()
    overlap.clip_grad_norm_(model, 1.0)
    opt.step()
    opt.zero_grad()
from torch.distributed.tensor import DTensor
assert all(isinstance(p, DTensor) for p in model.parameters())
assert set(overlap.full_state_dict(model)) == {"0.weight", "0.bias", "2.weight", "2.bias"}
dist.destroy_process_group()
"""
    loaded = loaded_after(code)
    assert loaded["torch.distributed.tensor"] and not loaded["torch.distributed.checkpoint"], loaded


def test_compile_disabled_is_disable_made_at_lookup():
    """`compile_disabled` defines a method without importing torch._dynamo; looked up, it is
    `torch.compiler.disable`'s bound method: a module whose pre-hook it is, compiled, compiles
    once and runs the hook eagerly, whatever Python state the hook changes."""
    code = """
import sys, torch, torch.nn as nn
from overlap.engine.lazy_torch import compile_disabled

class Hooks:
    def __init__(self):
        self.calls = []

    @compile_disabled
    def pre(self, module, args):
        self.calls.append(torch.compiler.is_compiling())
        return (args[0] * len(self.calls),)

assert "torch._dynamo" not in sys.modules
hooks = Hooks()
assert hooks.pre._torchdynamo_disable and hooks.pre.__self__ is hooks and Hooks.pre.__name__ == "pre"
layer = nn.Linear(4, 4)
layer.register_forward_pre_hook(hooks.pre)
from torch._dynamo.testing import CompileCounter
counter = CompileCounter()
compiled = torch.compile(layer, backend=counter)
x = torch.randn(2, 4)
for step in range(1, 4):
    torch.testing.assert_close(compiled(x), layer.forward(x * step))
assert hooks.calls == [False] * 3, hooks.calls
assert counter.frame_count == 1, counter.frame_count
"""
    assert loaded_after(code)["torch._dynamo"]
