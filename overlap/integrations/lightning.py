"""Lightning (`Trainer` and `Fabric`) with modules sharded by `overlap.wrap`.

Trainer: shard in `configure_model`, the hook Lightning runs before it builds the optimizers,
and train with `OverlapStrategy`:

    class LitModel(L.LightningModule):
        def configure_model(self):                   # idempotent: runs for fit, validate, test
            self.model = overlap.integrations.lightning.wrap(self.model, self.device_mesh)
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters())   # the shards

    trainer = L.Trainer(strategy=OverlapStrategy(), accelerator="gpu", devices=8)

Fabric: `OverlapFabricStrategy()` wraps the module passed to `fabric.setup_module` itself:

    fabric = L.Fabric(strategy=OverlapFabricStrategy(), devices=8); fabric.launch()
    model = fabric.setup_module(model)               # sharded here
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))

Both strategies are Lightning's `ModelParallelStrategy` (its user-defined-parallelism route,
which already saves and loads DTensor state through `torch.distributed.checkpoint`: a folder in
which every rank writes its own rows of the model and optimizer state) with:
- the whole world as the data-parallel dimension (no tensor parallelism), so the defaults need
  no sizes;
- gradient accumulation that skips the reduce-scatter: `Trainer(accumulate_grad_batches=k)` and
  `fabric.no_backward_sync(model)` enter `no_sync()` of every wrapped module (Lightning's own
  switch only knows DDP and FSDP2 modules, and would reduce every micro-batch);
- a check at setup that every trainable parameter is inside a wrapped module: this strategy
  wraps nothing in DDP, so a parameter outside would silently train apart on each rank;
- no `.to(device)` of a wrapped module (it would copy the shards away from the buffers the
  engine gathers): the Trainer's move skips them, and `wrap` moves the module first;
- a check at setup that Lightning's process count (`devices` x `num_nodes`) is the process
  group's size: on CPU with `devices` left at "auto" (1) inside a larger launched world, each
  rank would train on its own data while `overlap.wrap` shards over all of them;
- `fabric.load(path, state)` of a distributed checkpoint restores the stateful objects of `state`
  (an LR scheduler) in place, as `strategy="ddp"` does: Lightning's ModelParallelStrategy puts the
  saved state dict in their place instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any

import torch
import torch.nn as nn
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallelStrategy
from lightning.fabric.utilities.types import _PATH, _Stateful
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.device_mesh import DeviceMesh

import overlap
from overlap.config import OverlapConfig
from overlap.integrations import check_optimizer, check_process_count, is_wrapped

DATA_PARALLEL = "data_parallel"  # the mesh dimension Lightning's ModelParallelStrategy names


def wrap(module: nn.Module, device_mesh: DeviceMesh, **wrap_kwargs: Any) -> nn.Module:
    """`overlap.wrap(module)` over the mesh's data-parallel dimension, for `configure_model`:
    returns `module` unchanged when it is already wrapped (the hook runs again for every
    fit / validate / test), and moves it to this rank's device of the mesh first (Lightning
    calls the hook before it moves the model, and a wrapped model cannot be moved)."""
    if is_wrapped(module):
        return module
    if device_mesh.mesh_dim_names and DATA_PARALLEL in device_mesh.mesh_dim_names:
        device_mesh = device_mesh[DATA_PARALLEL]
    device = torch.device(device_mesh.device_type)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    return overlap.wrap(module.to(device), group=device_mesh, **wrap_kwargs)


def wrapped_modules(module: nn.Module) -> list[nn.Module]:
    """The outermost modules under `module` (itself included) that `overlap.wrap` returned."""
    found: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        if is_wrapped(m):
            found.append(m)
            return
        for child in m.children():
            visit(child)

    visit(module)
    return found


@contextlib.contextmanager
def no_sync(module: nn.Module, enabled: bool = True) -> Iterator[None]:
    """`model.no_sync()` of every wrapped module under `module` (nothing when not `enabled`)."""
    with contextlib.ExitStack() as stack:
        if enabled:
            for wrapped in wrapped_modules(module):
                stack.enter_context(wrapped.no_sync())  # type: ignore[operator]
        yield


def check_all_wrapped(module: nn.Module, where: str) -> None:
    """Raise when a trainable parameter of `module` is outside every wrapped module: nothing
    would average its gradient over the ranks (see the module docstring)."""
    inside = {id(p) for wrapped in wrapped_modules(module) for p in wrapped.parameters()}
    outside = [name for name, p in module.named_parameters() if p.requires_grad and id(p) not in inside]
    if outside:
        shown = ", ".join(outside[:3]) + (f" and {len(outside) - 3} more" if len(outside) > 3 else "")
        raise ValueError(
            f"{where}: {len(outside)} trainable parameter(s) are not inside a module wrapped by "
            f"overlap.wrap ({shown}); their gradients would not be averaged over the ranks. Wrap the "
            "module holding them (in configure_model: self.model = "
            "overlap.integrations.lightning.wrap(self.model, self.device_mesh)), or freeze them"
        )


def _move_unwrapped(module: nn.Module, device: torch.device) -> None:
    """`module.to(device)` for everything outside the wrapped modules (whose shards stay put)."""
    if is_wrapped(module):
        return
    module._apply(lambda t: t.to(device), recurse=False)
    for child in module.children():
        _move_unwrapped(child, device)


def _resolve_sizes(strategy: Any) -> None:
    # ModelParallelStrategy's "auto" means one data-parallel rank per node; here every process
    # is a data-parallel rank.
    if strategy._data_parallel_size == "auto":
        strategy._data_parallel_size = strategy.num_nodes * strategy.num_processes


def _check_world(strategy: Any) -> None:
    """Before Lightning's setup_environment, which fails on a rank beyond `devices` (IndexError)
    and would join a process group that is already there. A group Lightning starts itself has its
    size; under torchrun Lightning compares `devices` with WORLD_SIZE itself."""
    check_process_count(
        strategy.num_nodes * strategy.num_processes,
        type(strategy).__name__,
        "devices=<processes per node> (and num_nodes) in Trainer / Fabric, as torchrun launched them",
    )


class OverlapStrategy(ModelParallelStrategy):
    """Lightning `Trainer` strategy for modules wrapped by `overlap.wrap` in `configure_model`
    (see the module docstring). Checkpoints: `save_distributed_checkpoint=True` (default) writes
    a DCP folder, every rank its own shards; False gathers the full model and optimizer state on
    rank 0 into one file, as Lightning's ModelParallelStrategy does."""

    strategy_name = "overlap"

    def __init__(
        self,
        data_parallel_size: int | str = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )

    def setup_environment(self) -> None:
        _resolve_sizes(self)
        _check_world(self)
        super().setup_environment()

    def setup(self, trainer: Any) -> None:
        assert self.model is not None
        check_all_wrapped(self.model, f"{type(self).__name__}")
        super().setup(trainer)
        for optimizer in self.optimizers:
            check_optimizer(optimizer, self.model, "configure_optimizers")

    def model_to_device(self) -> None:
        assert self.model is not None
        _move_unwrapped(self.model, self.root_device)

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        assert self.model is not None
        with no_sync(self.model):
            yield


class _NoSyncControl:
    """What `fabric.no_backward_sync(model, enabled)` asks the strategy for."""

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        return no_sync(module, enabled)


class OverlapFabricStrategy(FabricModelParallelStrategy):
    """Lightning `Fabric` strategy: `fabric.setup_module(model)` wraps `model` by `overlap.wrap`
    (with `config`), or by `parallelize_fn(model, mesh)` when given (which must return a module
    whose trainable parameters are all inside wrapped modules, e.g. by calling `wrap` on parts).
    Build the optimizer after `setup_module`. See the module docstring."""

    def __init__(
        self,
        config: OverlapConfig | None = None,
        parallelize_fn: Callable[[nn.Module, DeviceMesh], nn.Module] | None = None,
        data_parallel_size: int | str = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        if parallelize_fn is None:

            def parallelize_fn(module: nn.Module, mesh: DeviceMesh) -> nn.Module:
                return wrap(module, mesh, config=config)

        elif config is not None:
            raise ValueError(
                "OverlapFabricStrategy: config is for the default wrap; with a parallelize_fn, "
                "pass it to overlap.wrap there"
            )
        super().__init__(
            parallelize_fn,
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._backward_sync_control = _NoSyncControl()  # Fabric's seam for no_backward_sync

    def setup_environment(self) -> None:
        _resolve_sizes(self)
        _check_world(self)
        super().setup_environment()

    def setup_module(self, module: nn.Module) -> nn.Module:
        module = super().setup_module(module)
        check_all_wrapped(module, f"{type(self).__name__}.setup_module")
        return module

    def load_checkpoint(
        self,
        path: _PATH,
        state: nn.Module | torch.optim.Optimizer | dict[str, Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Lightning's load, then every stateful object of `state` that the distributed load
        replaced by its saved state dict gets it through `load_state_dict`, in place."""
        stateful = {}
        if isinstance(state, dict):
            stateful = {
                key: obj
                for key, obj in state.items()
                if isinstance(obj, _Stateful) and not isinstance(obj, (nn.Module, torch.optim.Optimizer))
            }
        remaining = super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        assert isinstance(state, dict) or not stateful
        for key, obj in stateful.items():
            if state[key] is not obj:  # type: ignore[index]
                obj.load_state_dict(state[key])  # type: ignore[index]
                state[key] = obj  # type: ignore[index]
        return remaining


__all__ = ["OverlapFabricStrategy", "OverlapStrategy", "check_all_wrapped", "no_sync", "wrap", "wrapped_modules"]
