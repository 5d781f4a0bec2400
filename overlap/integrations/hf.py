"""Hugging Face `Trainer` with a model sharded by `overlap.wrap`.

    trainer = OverlapTrainer(model=model, args=args, train_dataset=ds)   # was: Trainer(...)
    trainer.train()                                   # or train(resume_from_checkpoint=True)
    trainer.save_model(out)                           # model.safetensors: from_pretrained loads it

`OverlapTrainer` is `transformers.Trainer` with the model sharded at construction, before the
Trainer builds anything from it. Launch as for DDP (`torchrun --nproc-per-node N train.py`);
the model may be passed plain (it is wrapped with `overlap_config`) or already wrapped.

[Note: Trainer seams]
What the Trainer does by default, and what changes here:
- It wraps the model in DDP through `accelerator.prepare` (a DTensor model breaks DDP's
  broadcast of module states). The constructor registers the wrapped model with
  `accelerator.prepare_model(model, evaluation_mode=True)`: autocast is applied as usual
  (`bf16=True`), and accelerate returns a prepared model untouched from every later `prepare`.
- Gradient accumulation calls `accelerator.no_sync(model)`, which enters `model.no_sync()` (the
  wrapped model's own, overlap/engine/module.py): nothing changes.
- It builds the optimizer from `self.model` in `train()`: the wrapped model, so the optimizer holds
  the shards. An optimizer passed in `optimizers=` is checked at construction.
- `save_model` / every checkpoint writes `model.safetensors` from rank 0 via `save_pretrained`,
  which would read `model.state_dict()` (DTensor shards). `_save` gathers the full state dict on
  every rank first (`overlap.full_state_dict`), so the file is the whole model.
- Checkpoints pickle `optimizer.state_dict()` on rank 0 only, which would lose every other rank's
  optimizer shard. `_save_optimizer_and_scheduler` writes `<checkpoint>/overlap/step_N` with
  `overlap.checkpoint.save` (model, optimizer and scheduler; every rank writes its rows) instead,
  and `_load_optimizer_and_scheduler` restores all three from it. A checkpoint a DDP Trainer
  wrote (`optimizer.pt` and `scheduler.pt`, no `overlap/`) resumes as under DDP: the full optimizer
  state dict is loaded into the shards ([Note: a DDP optimizer state dict] in resume.py) and the
  scheduler's state into the scheduler. One an FSDP Trainer wrote (`optimizer_0/`,
  `optimizer.bin`) is refused on every rank, naming the supported route.
- On resume and at `load_best_model_at_end` it loads `model.safetensors` with
  `model.load_state_dict`, which cannot write full tensors into shards. The model comes from the
  overlap checkpoint when there is one (exact: the shards as saved; on resume it is loaded with
  the optimizer), else `_load_from_checkpoint` and `_load_best_model` read the full weights file
  on rank 0 and scatter it with `overlap.load_full_state_dict`.
- It moves the model with `model.to(args.device)`, which on the wrapped model would replace the
  shards by copies the engine never reads (`torch.device("cpu:0")` is not the shards' "cpu", so
  DTensor.to copies). The model is moved before the wrap instead; `_move_model_to_device` checks
  that it is there and moves nothing.
- `model.save_pretrained(dir)` after training reads `model.state_dict()` too: the constructor
  makes the wrapped model's own `save_pretrained` gather ([Note: gathered exports] in export.py).
- Launched by torchrun on CPU without `use_cpu=True`, the Trainer sees a world of one process:
  refused at construction (`check_process_count`).
The six methods are private to `transformers.Trainer` (the seams DeepSpeed, FSDP and SageMaker
use inside it); `OverlapTrainer` checks at construction that each still exists with the
parameters used here, so a release that renames one fails there, naming it, not mid-run.
Per-rank RNG states and the gradient scaler stay with the Trainer's own files.
"""

from __future__ import annotations

import inspect
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import transformers
from transformers.trainer_pt_utils import reissue_pt_warnings

import overlap
from overlap import checkpoint
from overlap.config import OverlapConfig
from overlap.integrations import check_optimizer, check_process_count, is_wrapped
from overlap.integrations.export import gather_on_save_pretrained
from overlap.integrations.resume import load_full_optimizer_state_dict, load_full_weights, read_pickled

OVERLAP_DIR = "overlap"  # inside each checkpoint-N folder: the DCP checkpoint root
_DDP_OPTIMIZER = "optimizer.pt"  # transformers' OPTIMIZER_NAME and SCHEDULER_NAME
_DDP_SCHEDULER = "scheduler.pt"
_FSDP_OPTIMIZER = "optimizer"  # FSDP's optimizer.bin, or folders optimizer_0, ...

# the private Trainer methods overridden below, with the parameters they are called with
_SEAMS = {
    "_save": ("output_dir", "state_dict"),
    "_save_optimizer_and_scheduler": ("output_dir",),
    "_load_optimizer_and_scheduler": ("checkpoint",),
    "_load_from_checkpoint": ("resume_from_checkpoint", "model"),
    "_load_best_model": (),
    "_move_model_to_device": ("model", "device"),
}


def _check_seams() -> None:
    for name, params in _SEAMS.items():
        method = getattr(transformers.Trainer, name, None)
        found = () if method is None else tuple(inspect.signature(method).parameters)[1:]
        if method is None or found[: len(params)] != params:
            raise RuntimeError(
                f"OverlapTrainer: transformers {transformers.__version__} has no Trainer.{name}"
                f"(self, {', '.join(params)}) (found {found if method else 'nothing'}); this "
                "integration overrides it ([Note: Trainer seams] in overlap/integrations/hf.py). "
                "Use a transformers release it supports (tested: 5.24)"
            )


class OverlapTrainer(transformers.Trainer):
    """`transformers.Trainer` training a model sharded by `overlap.wrap` (see the module note).

    `model` is wrapped here (with `overlap_config`) unless it already is; it is moved to
    `args.device` first, and `args.device` sets up torch.distributed (as the Trainer does), so
    a script launched by torchrun needs no `init_process_group` of its own. `model_init`
    (hyperparameter search builds a new model per trial) is not supported. The other arguments
    are the Trainer's, by keyword."""

    def __init__(
        self,
        model: nn.Module,
        args: transformers.TrainingArguments | None = None,
        *,
        overlap_config: OverlapConfig | None = None,
        **kwargs: Any,
    ) -> None:
        _check_seams()
        if kwargs.get("model_init") is not None or model is None:
            raise ValueError(
                "OverlapTrainer: model_init is not supported (each trial would build an unwrapped "
                "model); pass the model, wrapped by overlap.wrap or to be wrapped here"
            )
        if args is None:
            args = transformers.TrainingArguments(output_dir="trainer_output")
        device = args.device  # initializes torch.distributed when launched distributed
        if device.type == "cpu":
            device = torch.device("cpu")  # accelerate says "cpu:0"; tensors say "cpu"
        check_process_count(args.world_size, "OverlapTrainer", "TrainingArguments(use_cpu=True)")
        if is_wrapped(model):
            if overlap_config is not None:
                raise ValueError(
                    "OverlapTrainer: the model is already wrapped; pass overlap_config to "
                    "overlap.wrap, or pass the unwrapped model"
                )
        elif any(p.is_meta for p in model.parameters()):
            # overlap's deferred init runs reset_parameters(); Hugging Face models initialize
            # through their own _init_weights and compute buffers (rotary) in __init__
            raise ValueError(
                "OverlapTrainer: the model is on the meta device; pass a materialized model "
                "(from_pretrained / from_config), or wrap the meta model yourself with its init: "
                "overlap.wrap(model, param_init_fn=..., device=...), and pass the wrapped model"
            )
        else:
            model = overlap.wrap(model.to(device), config=overlap_config)
        super().__init__(model=model, args=args, **kwargs)
        if self.optimizer is not None:
            check_optimizer(self.optimizer, self.model, "OverlapTrainer(optimizers=...)")
        # no DDP around the sharded model: see [Note: Trainer seams]
        self.accelerator.prepare_model(self.model, device_placement=False, evaluation_mode=True)
        gather_on_save_pretrained(self.model)

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        if not is_wrapped(model):  # not ours: the Trainer's behaviour
            super()._move_model_to_device(model, device)
            return
        here = next(iter(model.parameters())).device
        if not _same_device(here, torch.device(device)):
            raise ValueError(
                f"OverlapTrainer: the wrapped model is on {here}, the Trainer's device is {device}; "
                "a wrapped model cannot be moved: move it to args.device before overlap.wrap"
            )

    # -- the whole model, for from_pretrained ------------------------------------------------------

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if state_dict is None:  # collective; {} on the ranks that do not write
            state_dict = overlap.full_state_dict(self.model, rank0_only=not self.args.save_on_each_node)
        super()._save(output_dir, state_dict=state_dict)

    # -- sharded state for resuming ----------------------------------------------------------------

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        checkpoint.save(
            Path(output_dir) / OVERLAP_DIR,
            self.model,
            _unwrap(self.optimizer),
            step=self.state.global_step,
            scheduler=self.lr_scheduler,
        )

    def _load_optimizer_and_scheduler(self, checkpoint_dir: str | None) -> None:
        if checkpoint_dir is None:
            return
        folder = Path(checkpoint_dir)
        if checkpoint.latest(folder / OVERLAP_DIR) is not None:
            checkpoint.load(
                folder / OVERLAP_DIR,
                self.model,
                _unwrap(self.optimizer),
                scheduler=self.lr_scheduler,
                restore_rng=False,
            )
            return
        _refuse_fsdp(folder)
        # the Trainer's own rule: both files or neither (save_only_model: the weights were loaded)
        if (folder / _DDP_OPTIMIZER).is_file() and (folder / _DDP_SCHEDULER).is_file():
            load_full_optimizer_state_dict(
                self.model,
                _unwrap(self.optimizer),
                folder / _DDP_OPTIMIZER,
                f"OverlapTrainer: resuming from {folder / _DDP_OPTIMIZER}",
            )
            with warnings.catch_warnings(record=True) as caught:
                self.lr_scheduler.load_state_dict(read_pickled(folder / _DDP_SCHEDULER))
            reissue_pt_warnings(caught)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        if checkpoint.latest(Path(resume_from_checkpoint) / OVERLAP_DIR) is not None:
            return  # _load_optimizer_and_scheduler loads the model with the optimizer
        _refuse_fsdp(Path(resume_from_checkpoint))
        self._load_weights(resume_from_checkpoint)

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        assert best is not None, "the Trainer calls _load_best_model with a best checkpoint"
        self._load_weights(best)

    def _load_weights(self, folder: str) -> None:
        """The model's parameters from a checkpoint folder: its overlap checkpoint (the shards as
        saved) or its full weights file, read on rank 0 and scattered."""
        root = Path(folder) / OVERLAP_DIR
        if checkpoint.latest(root) is not None:
            checkpoint.load(root, self.model, restore_rng=False)
            return
        load_full_weights(self.model, Path(folder), f"OverlapTrainer: {folder} (holds no {OVERLAP_DIR}/ either)")


def _same_device(a: torch.device, b: torch.device) -> bool:
    """ "cpu" and "cpu:0" are one device; "cuda" is the current CUDA device."""
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    current = torch.cuda.current_device()
    return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)


def _unwrap(optimizer: Any) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer


def _refuse_fsdp(folder: Path) -> None:
    """Raise on every rank (each sees the same folder) for an FSDP Trainer's optimizer state."""
    found = sorted(p.name for p in folder.glob(f"{_FSDP_OPTIMIZER}*") if p.name != _DDP_OPTIMIZER)
    if found:
        raise ValueError(
            f"OverlapTrainer: {folder} holds an FSDP Trainer's optimizer state ({', '.join(found)}), "
            "which this integration does not read. To continue from its weights, merge them "
            f"(accelerate merge-weights {folder}/pytorch_model_fsdp_0 <dir>) and train from <dir> "
            "with a new optimizer; to resume exactly, resume the run under FSDP"
        )


__all__ = ["OVERLAP_DIR", "OverlapTrainer"]
