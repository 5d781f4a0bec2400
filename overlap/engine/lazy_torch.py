"""Checks against torch's heavy subsystems that do not import them, and a decorator that imports
dynamo late.

[Note: import cost]
`import overlap` costs about what `import torch` does: torch.distributed.tensor (DTensor, ~0.8 s:
its op tables, sympy), torch._dynamo (~0.6 s) and torch.distributed.checkpoint load on first use,
not at import (tests/unit/test_import_cost.py checks that they stay out). Every torchrun rank and
every `overlap` command pays the import, and a tool that wraps no model (`overlap --help`, `plan`,
`report`) needs none of them. A rank that wraps loads DTensor and, through it, dynamo
(`DTensor.from_local` is itself `torch.compiler.disable`d); only one that checkpoints loads DCP.
So the engine imports them inside the functions that build DTensors, register the hooks or save,
and asks the questions below instead of importing: no DTensor can exist before
torch.distributed.tensor is imported, and nothing is compiled before torch._dynamo is.
tests/helpers/harness.py preloads them in the ranks' forkserver.
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


class _CompileDisabled:
    """A method that is `torch.compiler.disable`d when first looked up (see compile_disabled)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.disabled: Callable[..., Any] | None = None
        functools.update_wrapper(self, fn)

    def __get__(self, obj: object, objtype: type | None = None) -> Any:
        if self.disabled is None:
            self.disabled = torch.compiler.disable(self.fn)
        return self.disabled.__get__(obj, objtype)  # type: ignore[attr-defined]


def compile_disabled(fn: F) -> F:
    """A method decorator: `torch.compiler.disable(fn)`, made when the method is first looked up
    (when `wrap` registers it as a hook) instead of when its class is defined, which would import
    torch._dynamo with the module. What the lookup returns is the same bound method as under
    `@torch.compiler.disable`."""
    return _CompileDisabled(fn)  # type: ignore[return-value]
