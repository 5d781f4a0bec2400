"""Hugging Face `Trainer` with overlap (overlap.integrations.hf.OverlapTrainer), 2 ranks on gloo.

The ranks are the harness's spawned world with torchrun's environment variables set (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE): the Trainer's accelerate state reads them and finds the
process group already initialized, as under torchrun. `use_cpu=True`: accelerate's multi-CPU mode.

- Parity: a tiny Llama (from a config, fp32, eager attention) trains 4 optimizer steps of 2
  micro-batches each (gradient accumulation: the first micro-batch under `model.no_sync()`),
  gradient clipping at 1.0, AdamW with linear decay, under `Trainer` (DDP) and under
  `OverlapTrainer`. The first step's micro-batch losses are equal bitwise (same weights, same
  batch); after the first clipped update the global gradient norm (summed over shards here, over
  whole tensors by DDP) carries [Note: what is bitwise]'s reordering, so later losses and the final
  parameters are within `reordered_rtol` of DDP's (tests/helpers/tolerance.py).
- `save_model()` writes the whole model: `from_pretrained` loads it bitwise equal to the trained
  model's full state dict.
- `train(resume_from_checkpoint=...)` from the step-2 checkpoint: the resumed steps 3-4 give
  bitwise the losses and final parameters of the uninterrupted run (the AdamW moments of both
  ranks' shards came back, and the scheduler, and the data position).
- `model.save_pretrained(dir)` after training, on every rank, writes the whole model too.
- A checkpoint a plain DDP `Trainer` wrote (`model.safetensors`, `optimizer.pt`, `scheduler.pt`,
  no `overlap/`) resumes as the DDP Trainer resumes it: the learning rate of every step after the
  resume equal (the scheduler came back), the first resumed step's micro-batch losses equal bitwise
  (the weights came back), and every later loss, the final parameters and the final AdamW state
  (moments and step counts of both ranks' shards) within `reordered_rtol` of the DDP resume's
  (clipping). A parameter whose saved optimizer state is missing starts without one, as under
  DDP. An optimizer state dict that does not match the model is refused on every rank.
- A checkpoint without the sharded state or an optimizer (`save_only_model=True`) resumes from
  its `model.safetensors` alone, as under DDP: the next step's micro-batch losses (computed before
  its update) equal the uninterrupted run's bitwise.
- An optimizer built before the wrap, a model left on the meta device (overlap's deferred
  init would run `reset_parameters()`, which Hugging Face models do not initialize with), a
  launch without `use_cpu=True` on CPU (the Trainer would see a world of one process) and a
  checkpoint an FSDP Trainer wrote are refused on every rank.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="optional extra `hf` (pip install -e '.[hf]'); CI installs it"
)
pytest.importorskip("accelerate", reason="optional extra `integrations` (Trainer needs accelerate); CI installs it")

from helpers.harness import ddp_and_overlap, torchrun_env
from helpers.hf import tiny_config, tiny_model
from helpers.tolerance import losses_within, reordered_mismatches, reordered_rtol

import overlap
from overlap.integrations import is_wrapped
from overlap.integrations.hf import OVERLAP_DIR, OverlapTrainer

transformers.logging.set_verbosity_error()
VOCAB = 97
STEPS = 4
SAVE_EVERY = 2
TIMEOUT_S = 300  # a Trainer run is a few seconds; generous for a loaded machine


def tiny_llama() -> torch.nn.Module:
    config = tiny_config("llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=37)
    return tiny_model(transformers.LlamaForCausalLM, config)


def dataset() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    rows = [torch.randint(2, VOCAB, (8,), generator=g) for _ in range(64)]
    return [{"input_ids": ids, "labels": ids} for ids in rows]


def training_args(out: str, max_steps: int = STEPS, use_cpu: bool = True) -> Any:
    return transformers.TrainingArguments(
        output_dir=out,
        use_cpu=use_cpu,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=max_steps,
        learning_rate=1e-2,
        lr_scheduler_type="linear",
        max_grad_norm=1.0,
        save_strategy="steps",
        save_steps=SAVE_EVERY,
        logging_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=1,
        dataloader_pin_memory=False,
    )


class _Recording:
    """Keeps every micro-batch loss this rank computed, and the learning rate it was taken at."""

    losses: list[float]
    lrs: list[float]

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        loss = super().training_step(model, inputs, num_items_in_batch)  # type: ignore[misc]
        self.losses.append(loss.item())
        self.lrs.append(self.lr_scheduler.get_last_lr()[0])  # type: ignore[attr-defined]
        return loss


class RecordingTrainer(_Recording, transformers.Trainer):
    pass


class RecordingOverlapTrainer(_Recording, OverlapTrainer):
    pass


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def optimizer_state(trainer: Any) -> dict[str, torch.Tensor]:
    """Every tensor of the optimizer's state as `<parameter name>.<key>`, whole (collective for
    the wrapped model; {} on rank 1 there)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    optimizer = trainer.optimizer.optimizer  # inside accelerate's AcceleratedOptimizer
    if is_wrapped(trainer.model):
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        by_name = get_optimizer_state_dict(trainer.model, optimizer, options=options).get("state", {})  # {} on rank 1
    else:
        names = {id(p): n for n, p in trainer.model.named_parameters()}
        by_name = {names[id(p)]: state for p, state in optimizer.state.items()}
    return {f"{n}.{k}": v.detach().clone() for n, st in by_name.items() for k, v in st.items()}


def run(rank: int, world: int, *, mode: str, out: str, resume: str | None = None, max_steps: int = STEPS) -> dict:
    """One Trainer run: "ddp" (Trainer) or "overlap" (OverlapTrainer, save_model at the end)."""
    torchrun_env(rank, world)
    args = training_args(out, max_steps)
    cls = RecordingTrainer if mode == "ddp" else RecordingOverlapTrainer
    trainer = cls(model=tiny_llama(), args=args, train_dataset=dataset())
    trainer.losses, trainer.lrs = [], []
    trainer.train(resume_from_checkpoint=resume)
    result: dict = {
        "losses": trainer.losses,
        "lrs": trainer.lrs,
        "wrapper": type(trainer.model_wrapped).__name__,
        "optimizer": optimizer_state(trainer),
    }
    if mode == "ddp":
        result["params"] = full_params(trainer.model)
        return result
    result["params"] = overlap.full_state_dict(trainer.model)  # {} on rank 1
    trainer.save_model(os.path.join(out, "final"))
    trainer.model.save_pretrained(os.path.join(out, "pretrained"))  # every rank: it gathers
    torch.distributed.barrier()
    return result


def refused(rank: int, world: int, *, out: str, what: str, resume: str | None = None) -> str:
    """The error OverlapTrainer raises for `what`, or "no error"."""
    torchrun_env(rank, world)
    kwargs: dict = {}
    args = training_args(out, use_cpu=what != "no_use_cpu")
    if what == "meta":
        with torch.device("meta"):
            model = tiny_llama()
    else:
        model = tiny_llama()
    if what == "optimizer":
        kwargs["optimizers"] = (torch.optim.AdamW(model.parameters()), None)  # before the wrap
    try:
        trainer = OverlapTrainer(model=model, args=args, train_dataset=dataset(), **kwargs)
        if resume is not None:
            trainer.train(resume_from_checkpoint=resume)
    except ValueError as e:
        return str(e)
    return "no error"


def test_trainer_matches_ddp_saves_and_resumes(world2, tmp_path):
    ddp, ours = ddp_and_overlap(
        world2, run, "LlamaForCausalLM", TIMEOUT_S, {"out": str(tmp_path / "ddp")}, {"out": str(tmp_path / "ours")}
    )
    ref, full = ddp[0]["params"], ours[0]["params"]
    rtol = reordered_rtol(sum(v.numel() for v in ref.values()), steps=STEPS)
    for rank in range(2):  # 4 steps x 2 micro-batches, each rank its own data
        assert len(ours[rank]["losses"]) == STEPS * 2
        assert ours[rank]["losses"][:2] == ddp[rank]["losses"][:2], rank  # before any update
        assert losses_within(ours[rank]["losses"], ddp[rank]["losses"], rtol), (rank, ours, ddp)
    assert not reordered_mismatches(full, ref, rtol)

    # save_model(): a whole model that from_pretrained loads
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "ours" / "final")
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, full[name]), name

    # every checkpoint-N holds the sharded state of both ranks and a loadable model.safetensors
    ckpt = tmp_path / "ours" / f"checkpoint-{SAVE_EVERY}"
    assert (ckpt / "model.safetensors").is_file() and (ckpt / OVERLAP_DIR / "step_000002" / ".metadata").is_file()
    assert not (ckpt / "optimizer.pt").exists()  # the Trainer's rank-0-only pickle is not written

    resumed = world2.run(run, timeout_s=TIMEOUT_S, mode="overlap", out=str(tmp_path / "resumed"), resume=str(ckpt))
    for rank in range(2):  # steps 3 and 4 again, from the checkpoint
        assert resumed[rank]["losses"] == ours[rank]["losses"][SAVE_EVERY * 2 :], rank
    for name, value in resumed[0]["params"].items():
        assert torch.equal(value, full[name]), name

    # save_pretrained() after training, on every rank: the whole model as well
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "ours" / "pretrained")
    assert [k for k, v in loaded.state_dict().items() if not torch.equal(v, full[k])] == []

    # resuming the DDP Trainer's checkpoint-2: as the DDP Trainer resumes it
    ddp_ckpt = str(tmp_path / "ddp" / f"checkpoint-{SAVE_EVERY}")
    ddp_resumed = world2.run(run, timeout_s=TIMEOUT_S, mode="ddp", out=str(tmp_path / "ddp_resumed"), resume=ddp_ckpt)
    from_ddp = world2.run(run, timeout_s=TIMEOUT_S, mode="overlap", out=str(tmp_path / "from_ddp"), resume=ddp_ckpt)
    resumed_rtol = reordered_rtol(sum(v.numel() for v in ref.values()), steps=STEPS - SAVE_EVERY)
    for rank in range(2):
        want, got = ddp_resumed[rank], from_ddp[rank]
        assert want["losses"] == ddp[rank]["losses"][SAVE_EVERY * 2 :], rank  # the reference is exact
        assert want["lrs"] == ddp[rank]["lrs"][SAVE_EVERY * 2 :], rank
        assert got["lrs"] == want["lrs"], (rank, got["lrs"], want["lrs"])  # the schedule came back
        assert got["losses"][:2] == want["losses"][:2], rank  # the weights came back
        assert losses_within(got["losses"], want["losses"], resumed_rtol), (rank, got, want)
    assert not reordered_mismatches(from_ddp[0]["params"], ddp_resumed[0]["params"], resumed_rtol)
    # the AdamW moments and step counts of both ranks' shards came back (gathered on rank 0)
    assert from_ddp[0]["optimizer"].keys() == ddp_resumed[0]["optimizer"].keys()
    assert not reordered_mismatches(from_ddp[0]["optimizer"], ddp_resumed[0]["optimizer"], resumed_rtol)

    # a DDP optimizer.pt of other param groups, and an FSDP Trainer's checkpoint: refused on every rank
    mismatched, fsdp = tmp_path / "mismatched", tmp_path / "fsdp"
    shutil.copytree(ddp_ckpt, mismatched)
    shutil.copytree(ddp_ckpt, fsdp)
    saved = torch.load(mismatched / "optimizer.pt", weights_only=True)
    saved["param_groups"][0]["params"].pop()
    torch.save(saved, mismatched / "optimizer.pt")
    (fsdp / "optimizer.pt").rename(fsdp / "optimizer.bin")
    for error in world2.run(
        refused, timeout_s=TIMEOUT_S, out=str(tmp_path / "r"), what="resume", resume=str(mismatched)
    ):
        assert (
            "cannot load the optimizer state (on rank 0: ValueError: the saved optimizer has param groups" in error
        ), error
    for error in world2.run(refused, timeout_s=TIMEOUT_S, out=str(tmp_path / "r"), what="resume", resume=str(fsdp)):
        assert "holds an FSDP Trainer's optimizer state (optimizer.bin)" in error, error

    # a parameter without saved optimizer state starts without one, as under DDP (its first step
    # is AdamW's step 1), not with the step count of set_optimizer_state_dict's lr-0 step
    partial = tmp_path / "partial"
    shutil.copytree(ddp_ckpt, partial)
    saved = torch.load(partial / "optimizer.pt", weights_only=True)
    del saved["state"][0]
    torch.save(saved, partial / "optimizer.pt")
    one_step = {"timeout_s": TIMEOUT_S, "resume": str(partial), "max_steps": SAVE_EVERY + 1}
    ddp_partial = world2.run(run, mode="ddp", out=str(tmp_path / "ddp_partial"), **one_step)
    ours_partial = world2.run(run, mode="overlap", out=str(tmp_path / "ours_partial"), **one_step)
    want, got = ddp_partial[0]["optimizer"], ours_partial[0]["optimizer"]
    assert min(v.item() for k, v in want.items() if k.endswith(".step")) == 1  # the one without
    assert not reordered_mismatches(got, want, resumed_rtol)

    # the same checkpoint without overlap/: the weights come from model.safetensors, the optimizer
    # starts afresh (save_only_model, as under DDP); step 3's micro-batch losses (both before its
    # update) are the weights' own
    weights_only = tmp_path / "weights_only"
    shutil.copytree(ckpt, weights_only, ignore=shutil.ignore_patterns(OVERLAP_DIR))
    from_file = world2.run(
        run,
        timeout_s=TIMEOUT_S,
        mode="overlap",
        out=str(tmp_path / "from_file"),
        resume=str(weights_only),
        max_steps=SAVE_EVERY + 1,
    )
    for rank in range(2):
        assert from_file[rank]["losses"] == ours[rank]["losses"][SAVE_EVERY * 2 : SAVE_EVERY * 2 + 2], rank


def test_stale_optimizer_meta_model_and_missing_cpu_switch_are_refused(world2, tmp_path):
    for error in world2.run(refused, timeout_s=TIMEOUT_S, out=str(tmp_path), what="optimizer"):
        assert "built before overlap.wrap" in error, error
    for error in world2.run(refused, timeout_s=TIMEOUT_S, out=str(tmp_path), what="meta"):
        assert "the model is on the meta device" in error, error
    for error in world2.run(refused, timeout_s=TIMEOUT_S, out=str(tmp_path), what="no_use_cpu"):
        assert "the framework runs 1 process(es), the launched world 2" in error, error
        assert "TrainingArguments(use_cpu=True)" in error, error
