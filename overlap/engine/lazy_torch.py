"""Checks against torch's heavy subsystems that do not import them.

[Note: import cost]
`import overlap` costs about what `import torch` does: torch.distributed.tensor (DTensor, ~0.8 s:
its op tables, sympy), torch._dynamo (~0.6 s) and torch.distributed.checkpoint load on first use,
not at import (tests/unit/test_import_cost.py checks that they stay out). Every torchrun rank and
every `overlap` command pays the import; only a rank that wraps a model needs DTensor, only one
that compiles needs dynamo, only one that checkpoints needs DCP. So the engine imports them inside
the functions that build DTensors or save, and asks the questions below instead of importing:
no DTensor can exist before torch.distributed.tensor is imported, and nothing is compiled before
torch._dynamo is. tests/helpers/harness.py preloads them in the ranks' forkserver.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


def is_dtensor(x: object) -> bool:
    """`isinstance(x, DTensor)`, without importing DTensor where none can exist yet."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(x, module.DTensor)


def is_compiled_module(module: object) -> bool:
    """Whether `module` is `torch.compile(module)`'s wrapper (dynamo's `OptimizedModule`)."""
    if "torch._dynamo" not in sys.modules:
        return False
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(module, OptimizedModule)


def compile_disabled(fn: F) -> F:
    """`torch.compiler.disable(fn)`, with torch._dynamo imported only once something compiles.

    Until torch._dynamo is imported nothing can trace `fn`, which then runs as it is. Afterwards
    it runs as `torch.compiler.disable(fn)` (made on first need), and the wrapper carries the
    marker that keeps dynamo from inlining it, as `disable`'s own wrapper does: a traced caller
    breaks its graph here and `fn` runs eagerly, with compilation off inside it."""
    disabled: Callable[..., Any] | None = None

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal disabled
        if "torch._dynamo" not in sys.modules:
            return fn(*args, **kwargs)
        if disabled is None:
            disabled = torch.compiler.disable(fn)
        return disabled(*args, **kwargs)

    call._torchdynamo_disable = True  # type: ignore[attr-defined]  # dynamo's marker of a disabled function
    return call  # type: ignore[return-value]
