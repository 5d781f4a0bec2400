"""The process-wide hooks: installed once however many models are wrapped, listed, and switchable.

Each check runs in a fresh interpreter (a one-rank gloo world): hooks installed by other tests of
this pytest process would otherwise be in place already.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from overlap.engine import process_hooks

_SCRIPT = """
import atexit, copy, json, sys
import torch, torch.distributed as dist
from torch.optim import optimizer as torch_optimizer
import overlap
from overlap.engine import process_hooks, teardown
# what wrap loads on first use (torch.distributed.tensor, dynamo) registers exit hooks of its
# own: loaded up front, so that only overlap's are counted
import torch._dynamo, torch.distributed.tensor

def reported(*args, **kwargs):
    print("quiet exit ran", flush=True)
    return True

teardown.wait_threads_idle = reported  # what the exit hook calls, once the script has ended

def hooks():
    return {{
        "installed": [[h.name, h.owner] for h in process_hooks.installed()],
        "torch_pre": len(torch_optimizer._global_optimizer_pre_hooks),
        "torch_post": len(torch_optimizer._global_optimizer_post_hooks),
        "atexit": atexit._ncallbacks(),
    }}

{before}
dist.init_process_group("gloo", init_method="file://{store}", rank=0, world_size=1)
seen = {{"before": hooks()}}
torch.manual_seed(0)
losses = []
for _ in range(3):  # three models wrapped, each trained one step
    reference = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    model = overlap.wrap(copy.deepcopy(reference))
    x = torch.randn(8, 4)
    for m in (model, reference):
        opt = torch.optim.AdamW(m.parameters(), lr=0.01)
        m(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    losses.append([reference(x).pow(2).mean().item(), model(x).pow(2).mean().item()])
seen["after"] = hooks()
seen["losses"] = losses
{after}
print(json.dumps(seen), flush=True)
dist.destroy_process_group()
"""


def _run(tmp_path, before: str = "", after: str = "") -> dict:
    """What the script saw, and "exit_runs": how often the exit hook ran after it ended."""
    script = tmp_path / "hooks.py"
    script.write_text(_SCRIPT.format(store=tmp_path / "store", before=before, after=after))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    seen = json.loads(next(line for line in lines if line.startswith("{")))
    seen["exit_runs"] = lines.count("quiet exit ran")
    return seen


def _trained(seen: dict) -> None:
    for expected, got in seen["losses"]:
        assert got == pytest.approx(expected, rel=1e-5)  # the wrapped model stepped as the plain one


def test_installed_once_however_many_models_are_wrapped(tmp_path):
    seen = _run(tmp_path)
    assert seen["before"]["installed"] == []
    names = [name for name, _ in seen["after"]["installed"]]
    assert sorted(names) == sorted(process_hooks.HOOK_NAMES), seen["after"]  # each exactly once
    # the step check's and local step's pre-hooks, local step's post-hook, one exit hook
    assert seen["after"]["torch_pre"] - seen["before"]["torch_pre"] == 2
    assert seen["after"]["torch_post"] - seen["before"]["torch_post"] == 1
    assert seen["after"]["atexit"] - seen["before"]["atexit"] == 1
    assert seen["exit_runs"] == 1
    _trained(seen)


def test_disabled_none_is_installed_and_training_still_works(tmp_path):
    seen = _run(tmp_path, before="process_hooks.disable()")
    assert seen["after"]["installed"] == []
    for key in ("torch_pre", "torch_post", "atexit"):
        assert seen["after"][key] == seen["before"][key], key
    assert seen["exit_runs"] == 0
    _trained(seen)


def test_disable_some_by_name(tmp_path):
    seen = _run(tmp_path, before='process_hooks.disable("local_step", "exit")')
    names = sorted(name for name, _ in seen["after"]["installed"])
    assert names == ["cpu_allocator", "optimizer_step_check"]
    assert seen["after"]["torch_pre"] - seen["before"]["torch_pre"] == 1
    assert seen["after"]["torch_post"] == seen["before"]["torch_post"]
    assert seen["after"]["atexit"] == seen["before"]["atexit"]
    assert seen["exit_runs"] == 0
    _trained(seen)


def test_disable_after_wrap_removes_what_can_be_removed(tmp_path):
    after = """
process_hooks.disable()
seen["disabled"] = hooks()
process_hooks.enable()
overlap.wrap(torch.nn.Linear(4, 4))
seen["enabled"] = hooks()
process_hooks.disable("exit")
"""
    seen = _run(tmp_path, after=after)
    # the allocator settings stay: glibc has no way back
    assert [name for name, _ in seen["disabled"]["installed"]] == ["cpu_allocator"]
    for key in ("torch_pre", "torch_post"):
        assert seen["disabled"][key] == seen["before"][key], key
    assert sorted(n for n, _ in seen["enabled"]["installed"]) == sorted(process_hooks.HOOK_NAMES)
    assert seen["enabled"]["torch_pre"] - seen["before"]["torch_pre"] == 2
    assert seen["enabled"]["torch_post"] - seen["before"]["torch_post"] == 1
    assert seen["exit_runs"] == 0  # installed twice, removed twice


def test_unknown_name_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="local_step"):
        process_hooks.disable("atexit")  # type: ignore[arg-type]
