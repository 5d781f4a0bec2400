"""Every process-wide hook the library installs: installed here, at most once, known, and switchable.

[Note: process-wide hooks]
`overlap.wrap` changes a few things that belong to the whole process rather than to one model.
Each is installed the first time a wrap needs it, once per process however many models are
wrapped, and only through `install` below, which remembers it (`installed()` lists them):

- "optimizer_step_check": a global optimizer step pre-hook (torch's
  `register_optimizer_step_pre_hook`, guard.py and step_hooks.py) that raises at the first
  `step()` of an optimizer built before `wrap`, from the parameters `wrap` replaced. Off: such an
  optimizer steps nothing and the model silently does not train; build every optimizer after
  `wrap`, from the wrapped model's parameters.
- "local_step": global optimizer step pre- and post-hooks (local_step.py) that let SGD, Adam and
  AdamW over CPU shards step the shards' local tensors instead of the DTensors. Off: the same
  values to the bit, through DTensor's dispatch, so a CPU step is slower (tens of µs per op and
  parameter); nothing to call instead. CUDA parameters are never swapped.
- "exit": an `atexit` hook (teardown.py) that logs the checks the last step left unread
  ([Note: final checks] in late_checks.py) and waits for the process group's worker threads
  ([Note: quiet exit] in teardown.py). Off: a divergence or a non-finite block in a CUDA run's
  last step is reported only by `overlap.checkpoint.save` or `overlap.full_state_dict`, and a gloo
  rank can abort at interpreter exit ("terminate called without an active exception") after its
  work is done; call `overlap.engine.teardown.quiet_exit()` at the end of the script to get both.
- "cpu_allocator": glibc's `mallopt` thresholds ([Note: CPU page faults] in transport/host.py),
  set when a model is wrapped on the CPU with `OverlapConfig.cpu_keep_freed_memory` (the default).
  Off: as `cpu_keep_freed_memory=False` for every model, the CPU step pays the page faults of
  fresh memory. It cannot be undone once set (glibc has no way back to its adaptive default).

The switch is `disable()`: process-wide, as the hooks are, and not an `OverlapConfig` field,
since two models with different values could not both be honoured. Call it before the first
`overlap.wrap` (FSDP2 and DDP install nothing process-wide; this is how to get the same):

    import overlap.engine.process_hooks as process_hooks
    process_hooks.disable()                    # all of them
    process_hooks.disable("local_step")        # or some, by name

A hook already installed when it is disabled is removed, except "cpu_allocator". `enable()`
undoes `disable()` for the next wrap; it installs nothing by itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, cast, get_args

from overlap.transport.host import keep_freed_cpu_memory as set_cpu_thresholds

HookName = Literal["optimizer_step_check", "local_step", "exit", "cpu_allocator"]
HOOK_NAMES: tuple[HookName, ...] = get_args(HookName)

Remove = Callable[[], None]


@dataclass(frozen=True)
class InstalledHook:
    """One process-wide hook in place."""

    name: HookName
    owner: str
    """What asked for it (a module-qualified name): two owners may install hooks of one name."""
    remove: Remove | None
    """Takes the hook out again; None where it cannot be undone."""


_disabled: set[HookName] = set()
_installed: dict[tuple[HookName, str], InstalledHook] = {}


def _names(names: tuple[str, ...]) -> tuple[HookName, ...]:
    unknown = [n for n in names if n not in HOOK_NAMES]
    if unknown:
        raise ValueError(
            f"overlap.engine.process_hooks: unknown hook name(s) {unknown}; "
            f"the process-wide hooks are {list(HOOK_NAMES)} (no name: all of them)"
        )
    return cast("tuple[HookName, ...]", names) if names else HOOK_NAMES


def disable(*names: HookName) -> None:
    """Keep the library from installing these process-wide hooks (no name: all of them), and
    remove those already installed that can be; see [Note: process-wide hooks] for what stops."""
    for name in _names(names):
        _disabled.add(name)
        for key, hook in list(_installed.items()):
            if hook.name == name and hook.remove is not None:
                hook.remove()
                del _installed[key]


def enable(*names: HookName) -> None:
    """Let the library install these hooks again (no name: all) the next time a wrap needs them."""
    for name in _names(names):
        _disabled.discard(name)


def is_enabled(name: HookName) -> bool:
    """Whether the library may install hook `name`."""
    _names((name,))
    return name not in _disabled


def install(name: HookName, owner: str, installer: Callable[[], Remove | None]) -> bool:
    """Install hook `name` for `owner` unless it is in place or disabled; `installer` puts it
    in place and returns how to remove it. True when it is in place afterwards."""
    assert name in HOOK_NAMES, f"unknown process-wide hook {name!r}"
    if name in _disabled:
        return False
    key = (name, owner)
    if key not in _installed:
        _installed[key] = InstalledHook(name, owner, installer())
    return True


def installed() -> list[InstalledHook]:
    """The process-wide hooks in place, in the order they were installed."""
    return list(_installed.values())


def keep_freed_cpu_memory() -> bool:
    """The "cpu_allocator" hook: glibc keeps freed large blocks for reuse ([Note: CPU page
    faults] in transport/host.py). True when the settings are in effect; set once per process."""
    if is_enabled("cpu_allocator") and set_cpu_thresholds():  # cached: mallopt runs once
        return install("cpu_allocator", "overlap.transport.host", lambda: None)
    return False
