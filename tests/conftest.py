import os
import subprocess
import sys
import time

import pytest

# The helpers package and every layer's folder are importable by name: the ranks of a local
# world import a test's functions by its module name (`test_parity`), and some tests name a
# module path on a command line (`--model test_plan_cli:tiny_lm`).
_TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_TESTS] + sorted(
    os.path.join(_TESTS, d)
    for d in os.listdir(_TESTS)
    if os.path.isdir(os.path.join(_TESTS, d))
    and not d.startswith((".", "_"))
    and not os.path.exists(os.path.join(_TESTS, d, "__init__.py"))  # packages (helpers, gpu) import by name
)

from helpers.harness import DEEPSPEED_BUILD_S, World


def _world(size: int):
    """A module-scoped fixture `world{size}`: a World of `size` gloo ranks, closed after the module."""

    @pytest.fixture(scope="module", name=f"world{size}")
    def world():
        w = World(size)
        yield w
        w.close()

    return world


world1, world2, world4, world8 = _world(1), _world(2), _world(4), _world(8)


@pytest.fixture(scope="session")
def deepspeed_op() -> float:
    """Build (or load from the cache) DeepSpeed's CPU op once per session, in a process of its
    own, before any rank needs it: the ranks then start in seconds. Returns the seconds it took."""
    code = (
        "import os; os.environ.setdefault('DS_ACCELERATOR', 'cpu')\n"
        "from deepspeed.accelerator import get_accelerator\n"
        "builder = get_accelerator().create_op_builder('ShareMemCommBuilder')\n"
        "assert builder is not None and builder.load() is not None\n"
    )
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=DEEPSPEED_BUILD_S)
    assert proc.returncode == 0, f"DeepSpeed's CPU op did not build:\n{proc.stdout}\n{proc.stderr}"
    return time.monotonic() - start
