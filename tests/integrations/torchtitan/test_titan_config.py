"""`use_overlap` on torchtitan's configs, without a world: what it changes, what it refuses, and
that `import overlap` needs no torchtitan. In a fresh interpreter, as torchtitan's imports set
process-wide state the rest of the suite should not see."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # spawns worlds or runs a command end to end: `-m 'not slow'` leaves it out

HERE = os.path.dirname(os.path.abspath(__file__))

CHECKS = r"""
import sys
import overlap, overlap.integrations.torchtitan as ot
assert "torchtitan" not in sys.modules, "import overlap imported torchtitan"

import titan_shims
titan_shims.install_device()
from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.models.llama3.parallelize import parallelize_llama


config = llama3_debugmodel()
spec = config.model_spec
assert ot.use_overlap(config, prefetch_depth=2) is config
assert config.model_spec is not spec and spec.parallelize_fn is parallelize_llama  # a copy; the registry's untouched
assert config.model_spec.parallelize_fn.fn is parallelize_llama
assert config.model_spec.parallelize_fn.overrides == {"prefetch_depth": 2}
assert config.model_spec.pipelining_fn.fn is spec.pipelining_fn
try:
    ot.use_overlap(config)
except ValueError as e:
    assert "already uses overlap" in str(e), e
else:
    raise AssertionError("use_overlap applied twice")
try:
    ot.use_overlap(llama3_debugmodel(), no_such_field=1)
except (TypeError, ValueError) as e:
    assert "no_such_field" in str(e), e
else:
    raise AssertionError("an unknown OverlapConfig field was accepted")
print("ok")
"""


@pytest.mark.timeout(300)
def test_use_overlap_config():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", CHECKS], capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-3000:] + proc.stderr[-3000:]
