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
  parameters are within `reordered_rtol` of DDP's (tests/tolerance.py).
- `save_model()` writes the whole model: `from_pretrained` loads it bitwise equal to the trained
  model's full state dict.
- `train(resume_from_checkpoint=...)` from the step-2 checkpoint: the resumed steps 3-4 give
  bitwise the losses and final parameters of the uninterrupted run (the AdamW moments of both
  ranks' shards came back, and the scheduler, and the data position).
- A checkpoint without the sharded state (`save_only_model=True`, or one written by a DDP
  Trainer) resumes from its `model.safetensors`, read on rank 0 and scattered: the next step's
  micro-batch losses (computed before its update) equal the uninterrupted run's bitwise.
- An optimizer built before the wrap, and a model left on the meta device (overlap's deferred
  init would run `reset_parameters()`, which Hugging Face models do not initialize with), are
  refused at construction, on every rank.
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
pytest.importorskip(
    "accelerate", reason="optional extra `integrations` (Trainer needs accelerate); CI installs it"
)

import overlap  # noqa: E402
from harness import rank_threads  # noqa: E402
from tolerance import losses_within, reordered_mismatches, reordered_rtol  # noqa: E402
from overlap.integrations.hf import OVERLAP_DIR, OverlapTrainer  # noqa: E402

transformers.logging.set_verbosity_error()
VOCAB = 97
STEPS = 4
SAVE_EVERY = 2
TIMEOUT_S = 300  # a Trainer run is a few seconds; generous for a loaded machine


def torchrun_env(rank: int, world: int) -> None:
    """What torchrun sets, so that the Trainer (accelerate) sees a distributed launch."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
        OMP_NUM_THREADS=str(rank_threads()),  # else accelerate's CPU mode sets torch's thread count itself
    )


def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM._from_config(config, attn_implementation="eager")


def dataset() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    rows = [torch.randint(2, VOCAB, (8,), generator=g) for _ in range(64)]
    return [{"input_ids": ids, "labels": ids} for ids in rows]


def training_args(out: str, max_steps: int = STEPS) -> Any:
    return transformers.TrainingArguments(
        output_dir=out, use_cpu=True, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_steps=max_steps, learning_rate=1e-2, lr_scheduler_type="linear", max_grad_norm=1.0,
        save_strategy="steps", save_steps=SAVE_EVERY, logging_strategy="no", report_to=[],
        disable_tqdm=True, seed=1, dataloader_pin_memory=False,
    )


class _Recording:
    """Keeps every micro-batch loss this rank computed."""

    losses: list[float]

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        loss = super().training_step(model, inputs, num_items_in_batch)  # type: ignore[misc]
        self.losses.append(loss.item())
        return loss


class RecordingTrainer(_Recording, transformers.Trainer):
    pass


class RecordingOverlapTrainer(_Recording, OverlapTrainer):
    pass


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def run(
    rank: int, world: int, *, mode: str, out: str, resume: str | None = None, max_steps: int = STEPS
) -> dict:
    """One Trainer run: "ddp" (Trainer) or "overlap" (OverlapTrainer, save_model at the end)."""
    torchrun_env(rank, world)
    args = training_args(out, max_steps)
    cls = RecordingTrainer if mode == "ddp" else RecordingOverlapTrainer
    trainer = cls(model=tiny_llama(), args=args, train_dataset=dataset())
    trainer.losses = []
    trainer.train(resume_from_checkpoint=resume)
    result: dict = {"losses": trainer.losses, "wrapper": type(trainer.model_wrapped).__name__}
    if mode == "ddp":
        result["params"] = full_params(trainer.model)
        return result
    result["params"] = overlap.full_state_dict(trainer.model)  # {} on rank 1
    trainer.save_model(os.path.join(out, "final"))
    torch.distributed.barrier()
    return result


def refused(rank: int, world: int, *, out: str, what: str) -> str:
    torchrun_env(rank, world)
    kwargs: dict = {}
    if what == "meta":
        with torch.device("meta"):
            model = tiny_llama()
    else:
        model = tiny_llama()
        kwargs["optimizers"] = (torch.optim.AdamW(model.parameters()), None)  # before the wrap
    try:
        OverlapTrainer(model=model, args=training_args(out), train_dataset=dataset(), **kwargs)
    except ValueError as e:
        return str(e)
    return "no error"


def test_trainer_matches_ddp_saves_and_resumes(world2, tmp_path):
    ddp = world2.run(run, timeout_s=TIMEOUT_S, mode="ddp", out=str(tmp_path / "ddp"))
    ours = world2.run(run, timeout_s=TIMEOUT_S, mode="overlap", out=str(tmp_path / "ours"))
    assert [r["wrapper"] for r in ddp] == ["DistributedDataParallel"] * 2
    assert [r["wrapper"] for r in ours] == ["LlamaForCausalLM"] * 2  # not put inside DDP
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

    # the same checkpoint without overlap/: the weights come from model.safetensors, the optimizer
    # starts afresh; step 3's micro-batch losses (both before its update) are the weights' own
    weights_only = tmp_path / "weights_only"
    shutil.copytree(ckpt, weights_only, ignore=shutil.ignore_patterns(OVERLAP_DIR))
    from_file = world2.run(
        run, timeout_s=TIMEOUT_S, mode="overlap", out=str(tmp_path / "from_file"), resume=str(weights_only),
        max_steps=SAVE_EVERY + 1,
    )
    for rank in range(2):
        assert from_file[rank]["losses"] == ours[rank]["losses"][SAVE_EVERY * 2 : SAVE_EVERY * 2 + 2], rank


def test_stale_optimizer_and_meta_model_are_refused(world2, tmp_path):
    for error in world2.run(refused, timeout_s=TIMEOUT_S, out=str(tmp_path), what="optimizer"):
        assert "built before overlap.wrap" in error, error
    for error in world2.run(refused, timeout_s=TIMEOUT_S, out=str(tmp_path), what="meta"):
        assert "the model is on the meta device" in error, error
