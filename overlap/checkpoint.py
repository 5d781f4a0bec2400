"""Sharded checkpoints of a wrapped model through `torch.distributed.checkpoint` (DCP).

    overlap.checkpoint.save(root, model, opt, step=i, scheduler=sched, extra={"data_position": i})
    path = overlap.checkpoint.latest(root)            # root/step_000123, or None
    info = overlap.checkpoint.load(path, model, opt, scheduler=sched)   # {"step", "extra", ...}

Every tensor is stored under its original parameter name and full (unpadded) shape: the model's
state dict holds `Shard(0)` DTensors and the optimizer's state (via
`torch.distributed.checkpoint.state_dict`) is keyed by the same names. Nothing depends on the
world size or on how parameters were grouped into units, so a checkpoint saved by N ranks loads
on M ranks (DCP reads the rows each rank's shard needs).

[Note: atomic checkpoint]
DCP has no notion of an incomplete save: a folder with some ranks' files is indistinguishable
from a finished one to a reader that only lists folders. So `save` writes into
`root/step_000123.tmp-<token>` (the token is drawn on rank 0 and broadcast, so every rank writes
into the same folder), and only after `dcp.save` has returned on every rank (DCP's coordinator
writes `.metadata` last, after gathering every rank's write results) does rank 0 rename the folder
to `root/step_000123` and fsync `root`. Rank 0 then broadcasts whether the rename worked, which
is also the barrier that makes the folder visible to every rank before `save` returns. A crash
anywhere before the rename leaves a `.tmp-` folder that `latest` ignores: the previous checkpoint
stays the latest. A failing write on any rank raises on every rank (DCP gathers the failure to
the coordinator and broadcasts it), so no rank waits for one that gave up.

[Note: what a checkpoint holds]
- `model`: `model.state_dict()` (DTensor shards, plain tensors for buffers).
- `optim`: `get_optimizer_state_dict(model, optimizer)`: per-parameter state keyed by name; or,
  for an optimizer without state yet, `optim_hyper`: its pickled `state_dict()` (hyperparameters).
- `scheduler`, `extra`, `meta` (step, world size, `gradient_divide_factor`): pickled bytes, written
  once (rank 0's copy). The divide factor is restored on load (a warning where it replaces the
  model's own): it sets the gradients' scale, which the optimizer state was built with.
- `rank<r>`: what is rank r's own: the torch (CPU and current CUDA device), Python `random`
  and NumPy generator states, and `rank_extra` (e.g. a per-rank data generator's state). Random
  streams are per rank and cannot be re-split over another number of ranks, so on load rank r
  restores what rank r saved when the checkpoint has a rank r, and otherwise keeps its own
  generators and gets `rank_extra=None` (with a warning). Data order should come from `extra` (a
  global data position), not from per-rank state, for a resume at another world size to see the
  same data.
- Error-feedback residuals (`OverlapConfig.error_feedback`), inside `rank<r>`, follow the same rule as
  the RNG states: they are a per-rank correction of that rank's gradient contribution, restored
  rank by rank at the same world size and reset to zero (with a warning) at another, which costs
  one step of uncompensated quantization error and biases nothing. Each is stored compactly as
  `FeedbackResidual.saved()` (its format, one row per peer rank; format 2). A checkpoint of
  format 1 holds a dense (world_size, columns) tensor instead, whose own-rank row (never
  encoded, so zero) is dropped on load. A residual saved in another `error_feedback_dtype` is
  converted to the configured one; a run without error feedback ignores them (with a warning).

Loading writes into the tensors that exist: DCP copies into the local tensor of each DTensor in
`model.state_dict()`, which is a view of the unit's flat shard buffer that the all-gather reads
(see `shard_unit` in engine/sharding.py). `_copy_into_model` checks that and copies where a state dict
entry turned out not to alias the parameter. Pickled entries are read back with pickle, as DCP
itself does for non-tensor values: load only checkpoints you trust.
"""

from __future__ import annotations

import io
import os
import pickle
import random
import re
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.tensor import DTensor

from overlap.compression.feedback import FeedbackResidual, make_residual_format
from overlap.engine.late_checks import check_deferred
from overlap.engine.state import OverlapState, state_of

try:  # NumPy is optional; its generator state is saved when it is importable
    import numpy as np
except ImportError:  # pragma: no cover
    np = None  # type: ignore[assignment]

__all__ = ["latest", "load", "save"]

FORMAT_VERSION = 2  # 2: error-feedback residuals as FeedbackResidual.saved()
_STEP_DIR = re.compile(r"step_(\d+)")
_TMP_MARK = ".tmp-"


def step_dir_name(step: int) -> str:
    """`step_000123`: the name of a finished checkpoint of `step`."""
    return f"step_{step:06d}"


def latest(root: str | os.PathLike[str]) -> Path | None:
    """The finished checkpoint folder under `root` with the highest step, or None. Folders that
    are still being written or were left by a crash (`step_*.tmp-*`) are ignored."""
    root = Path(root)
    if not root.is_dir():
        return None
    best: tuple[int, Path] | None = None
    for child in root.iterdir():
        match = _STEP_DIR.fullmatch(child.name)
        if match is None or not (child / ".metadata").is_file():
            continue
        step = int(match.group(1))
        if best is None or step > best[0]:
            best = (step, child)
    return None if best is None else best[1]


def save(
    root: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int,
    scheduler: Any | None = None,
    extra: dict[str, Any] | None = None,
    rank_extra: Any | None = None,
) -> Path:
    """Save a sharded checkpoint of `model` (wrapped by `overlap.wrap`), its optimizer and LR
    scheduler as `root/step_<step>`, atomically (see [Note: atomic checkpoint]). Collective:
    every rank of the model's group calls it with the same `root` and `step`. `extra` (the same
    on every rank, picklable: data position, metrics, ...) comes back from `load`. An existing
    checkpoint of the same step is replaced. `rank_extra` is this rank's own (picklable) state,
    returned to the same rank by `load` (see [Note: what a checkpoint holds]). Returns the
    checkpoint folder. A failed write raises DCP's `CheckpointException` (a `BaseException`) on
    every rank. Before anything is written, the checks the last step left unread run on every
    rank ([Note: final checks] in engine/late_checks.py): ranks that diverged, or a codec that met
    Inf/NaN, raise here on every rank instead of being saved silently."""
    state = state_of(model)
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"overlap.checkpoint.save: step must be an int >= 0, got {step!r}")
    check_deferred(state, "overlap.checkpoint.save")
    group = _dcp_group(state)
    rank = dist.get_rank(group)
    root = Path(root)
    final = root / step_dir_name(step)
    tmp = root / f"{final.name}{_TMP_MARK}{_broadcast_token(group, rank)}"
    state_dict: dict[str, Any] = {
        "model": model.state_dict(),
        "meta": _pickled(
            {
                "format": FORMAT_VERSION,
                "step": step,
                "world_size": state.world_size,
                "gradient_divide_factor": state.config.gradient_divide_factor,
            }
        ),
        "extra": _pickled(extra),
        f"rank{rank}": _pickled(
            {
                "rng": _rng_states(),
                "extra": rank_extra,
                "residuals": {k: v.saved() for k, v in state.runtime.residuals.items()},
            }
        ),
    }
    if optimizer is not None and optimizer.state:
        state_dict["optim"] = get_optimizer_state_dict(model, optimizer)
    elif optimizer is not None:
        # No state yet (before the first step, or a stateless optimizer): only hyperparameters.
        # get_optimizer_state_dict would create the state by an optimizer step with lr 0, which
        # counts a step (AdamW's bias correction) that training never took.
        state_dict["optim_hyper"] = _pickled(optimizer.state_dict())
    if scheduler is not None:
        state_dict["scheduler"] = _pickled(scheduler.state_dict())
    dcp.save(state_dict, storage_writer=FileSystemWriter(tmp), process_group=group)
    error: list[str | None] = [None]
    if rank == 0:
        try:
            _commit(tmp, final)
        except Exception as e:  # every rank must hear of it, or they would all report success
            error[0] = f"{type(e).__name__}: {e}"
    dist.broadcast_object_list(error, group=group, group_src=0)
    if error[0] is not None:
        raise RuntimeError(
            f"overlap.checkpoint.save: rank 0 could not rename {tmp} to {final} ({error[0]}); "
            f"the previous checkpoint under {root} is unchanged"
        )
    return final


def load(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    scheduler: Any | None = None,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint written by `save` (at any world size) into `model` (wrapped by
    `overlap.wrap`), `optimizer` and `scheduler`, in place. `path` is a checkpoint folder, or a
    root whose `latest` checkpoint is taken. Collective. Returns `{"step", "extra",
    "world_size" (of the save), "rank_extra" (this rank's, None if the save had no such rank),
    "rank_restored" (whether this rank's generators and rank_extra were in the checkpoint)}`.
    `restore_rng=False` leaves the random generators as they are."""
    state = state_of(model)
    path = Path(path)
    if not (path / ".metadata").is_file():
        found = latest(path)
        if found is None:
            raise FileNotFoundError(
                f"overlap.checkpoint.load: {path} is neither a finished checkpoint folder nor a "
                "root holding one (folders named step_*.tmp-* are unfinished saves)"
            )
        path = found
    saved_keys = set(FileSystemReader(path).read_metadata().state_dict_metadata)

    def has(prefix: str) -> bool:
        return any(k == prefix or k.startswith(prefix + ".") for k in saved_keys)

    for name, wanted in (("optim", optimizer), ("scheduler", scheduler)):
        if wanted is not None and not (has(name) or has(f"{name}_hyper")):
            raise ValueError(
                f"overlap.checkpoint.load: {path} holds no {name} state; pass {name}=None "
                "or load a checkpoint saved with one"
            )
    group = _dcp_group(state)
    rank = dist.get_rank(group)
    model_state = model.state_dict()
    rank_key = f"rank{rank}"
    state_dict: dict[str, Any] = {"model": model_state, "meta": b"", "extra": b""}
    stateless: list[str] = []  # parameters the checkpoint holds no optimizer state for
    if optimizer is not None and has("optim"):
        # on a fresh optimizer this creates the state by a step with lr 0 and zero gradients,
        # which leaves the parameters as they are; the load below overwrites that state. A
        # parameter that had no state when saved (it never got a gradient: an unused expert,
        # a layer frozen until then) keeps none, as Optimizer.load_state_dict leaves it under
        # DDP: the lr-0 step's state would count a step (AdamW's bias correction) never taken.
        optim_state = get_optimizer_state_dict(model, optimizer)
        stateless = [fqn for fqn in optim_state["state"] if not has(f"optim.state.{fqn}")]
        for fqn in stateless:
            del optim_state["state"][fqn]
        state_dict["optim"] = optim_state
    elif optimizer is not None:
        state_dict["optim_hyper"] = b""
    if scheduler is not None:
        state_dict["scheduler"] = b""
    if rank_key in saved_keys:
        state_dict[rank_key] = b""
    dcp.load(state_dict, storage_reader=FileSystemReader(path), process_group=group)

    _copy_into_model(model, state_dict["model"])
    if optimizer is not None and "optim" in state_dict:
        # strict=False only to let the stateless ones through; every other key was loaded above
        options = StateDictOptions(strict=not stateless)
        set_optimizer_state_dict(model, optimizer, state_dict["optim"], options=options)
        params = dict(model.named_parameters())
        for fqn in stateless:
            optimizer.state.pop(params[fqn], None)
    elif optimizer is not None:  # saved without state: the optimizer starts afresh
        optimizer.load_state_dict(_unpickled(state_dict["optim_hyper"]))
    if scheduler is not None:
        scheduler.load_state_dict(_unpickled(state_dict["scheduler"]))
    meta = _unpickled(state_dict["meta"])
    own: dict[str, Any] = {"rng": None, "extra": None}
    state = state_of(model)
    if rank_key in state_dict:
        own = _unpickled(state_dict[rank_key])
        if restore_rng:
            _set_rng_states(own["rng"])
    else:
        warnings.warn(
            f"overlap.checkpoint.load: {path} was saved by {meta['world_size']} ranks and has no "
            f"rank {rank}: this rank keeps its random generators and gets rank_extra=None",
            stacklevel=2,
        )
    _restore_residuals(state, own.get("residuals") or {}, meta["world_size"])
    if "gradient_divide_factor" in meta:  # older checkpoints: the model keeps its own
        _restore_divide_factor(state, meta["gradient_divide_factor"])
    return {
        "step": meta["step"],
        "extra": _unpickled(state_dict["extra"]),
        "world_size": meta["world_size"],
        "rank_extra": own["extra"],
        "rank_restored": rank_key in state_dict,
    }


def _restore_residuals(state: Any, saved: dict, saved_world_size: int) -> None:
    """Error-feedback residuals back at the same world size, in the configured format; zero
    (with a warning) at another world size or when error feedback is off."""
    runtime = state.runtime
    residuals: dict[tuple[int, ...], FeedbackResidual] = {}
    if saved and runtime.residual_dtype is None:
        warnings.warn(
            "overlap.checkpoint.load: the checkpoint holds error-feedback residuals and this "
            "model runs without error feedback: they are ignored",
            stacklevel=3,
        )
    elif saved and saved_world_size != state.world_size:
        warnings.warn(
            "overlap.checkpoint.load: error-feedback residuals were saved at world size "
            f"{saved_world_size} and start from zero at {state.world_size} "
            "([Note: what a checkpoint holds])",
            stacklevel=3,
        )
    elif saved:
        fmt = make_residual_format(runtime.residual_dtype, runtime.grad_codec)
        residuals = {
            k: FeedbackResidual.from_saved(v, fmt, runtime.rank, runtime.world_size, runtime.device)
            for k, v in saved.items()
        }
    runtime.residuals = residuals
    runtime.memory.set("residuals", sum(r.nbytes for r in residuals.values()))


def _restore_divide_factor(state: OverlapState, saved: float | None) -> None:
    """The gradient divide factor the run was saved with (`OverlapConfig.gradient_divide_factor`,
    or what `model.set_gradient_divide_factor` made of it), with a warning where it replaces
    another: the gradients' scale is part of the training state."""
    current = state.config.gradient_divide_factor
    if saved == current:
        return
    warnings.warn(
        f"overlap.checkpoint.load: the checkpoint was saved with gradient_divide_factor={saved!r}; "
        f"it replaces this model's {current!r} (call model.set_gradient_divide_factor after "
        "loading to change it)",
        stacklevel=3,
    )
    state.set_gradient_divide_factor(saved)


def _commit(tmp: Path, final: Path) -> None:
    """Rank 0: make the finished `tmp` folder the checkpoint `final`, replacing an older one."""
    old: Path | None = None
    if final.exists():  # rename(2) does not replace a non-empty folder: move the old one aside
        old = final.with_name(f"{final.name}{_TMP_MARK}replaced-{uuid.uuid4().hex[:8]}")
        final.rename(old)
    tmp.rename(final)
    _fsync_dir(final.parent)
    if old is not None:
        import shutil

        shutil.rmtree(old, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@torch.no_grad()
def _copy_into_model(model: nn.Module, loaded: dict[str, Any]) -> None:
    """Make sure the loaded values are in the tensors the engine reads (see the module note)."""
    own: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    own.update(model.named_buffers(remove_duplicate=False))
    for name, value in loaded.items():
        target = own.get(name)
        if target is None or not isinstance(value, torch.Tensor):
            continue
        dst = target.to_local() if isinstance(target, DTensor) else target
        src = value.to_local() if isinstance(value, DTensor) else value
        if dst.data_ptr() != src.data_ptr():
            dst.copy_(src)


def _dcp_group(state: OverlapState) -> dist.ProcessGroup | None:
    # DCP gathers every rank's plan to a coordinator: it must span every rank holding a shard.
    # A 1-D mesh is the model's group; for an N-D mesh (HSDP), or tensor-parallel parameters
    # (their shards span dp x tp), the default (world) group is used.
    return state.group if state.mesh.ndim == 1 and state.tensor_group is None else None


def _broadcast_token(group: dist.ProcessGroup | None, rank: int) -> str:
    token = [uuid.uuid4().hex[:12] if rank == 0 else None]
    dist.broadcast_object_list(token, group=group, group_src=0)
    return str(token[0])


def _pickled(obj: Any) -> bytes:
    # bytes, not the object itself: DCP would flatten a dict into keys that `load` cannot know
    return pickle.dumps(obj)


def _unpickled(data: Any) -> Any:
    if isinstance(data, io.BytesIO):
        data = data.getvalue()
    return pickle.loads(data)


def _rng_states() -> dict[str, Any]:
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    if np is not None:
        states["numpy"] = np.random.get_state()
    return states


def _set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
    if "numpy" in states and np is not None:
        np.random.set_state(states["numpy"])
