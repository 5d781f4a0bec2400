"""accelerate with overlap (overlap.integrations.accelerate), 2 ranks on gloo, multi-CPU mode.

The ranks are the harness's spawned world with torchrun's environment variables set; an
`Accelerator(cpu=True)` finds them and the process group initialized (DistributedType.MULTI_CPU).

- `prepare` + `accelerator.accumulate` (2 micro-batches per step; the first one's backward
  reduces nothing) + `accelerator.clip_grad_norm_` + a prepared scheduler, 2 epochs of 2 steps,
  against the same script with `accelerator.prepare(model, ...)` (DDP): the first step's
  micro-batch losses equal bitwise; the global norm of the clip is summed over shards here and over
  whole tensors by DDP ([Note: what is bitwise] in tests/helpers/tolerance.py), so the later losses and the
  final parameters are within `reordered_rtol` of DDP's.
- `save_state` after epoch 1, then `load_state` into a freshly built model, optimizer and
  scheduler: epoch 2 gives bitwise the losses and final parameters of the uninterrupted run (the
  AdamW moments of both ranks' shards came back, and `accelerator.step`, and an object registered
  with `accelerator.register_for_checkpointing`, in place).
- `load_state` of the folder `accelerator.save_state` wrote in the DDP run after epoch 1: epoch 2
  has DDP's learning rates and first micro-batch losses bitwise, and its later losses and final
  parameters within `reordered_rtol` (the clip); the registered object is restored.
- Exports after training: `accelerator.save_model(model, dir)` writes the whole trained model
  (safetensors, bitwise the gathered parameters); `accelerator.get_state_dict(model)` is the whole
  model on rank 0 and {} on rank 1. With a tiny Hugging Face Llama:
  `unwrap_model(model).save_pretrained(dir, state_dict=accelerator.get_state_dict(model))` and
  accelerate's recipe without a state dict (`is_main_process=`, `save_function=accelerator.save`)
  both write what `from_pretrained` loads bitwise; `state_dict=model.state_dict()` (shards) is
  refused on every rank. Each is followed by `accelerator.wait_for_everyone()`: no rank waits.
- `accelerator.save_state` / `load_state` on a wrapped model raise on every rank, naming the fix;
  so does `prepare` under `Accelerator()` without `cpu=True` (a world of one process per rank).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.nn as nn

accelerate = pytest.importorskip(
    "accelerate", reason="optional extra `integrations` (pip install -e '.[integrations]'); CI installs it"
)

from helpers.harness import ddp_and_overlap, torchrun_env
from helpers.hf import tiny_config, tiny_model
from helpers.tolerance import losses_within, reordered_mismatches, reordered_rtol

import overlap
from overlap.integrations import accelerate as overlap_accelerate
from overlap.integrations import is_wrapped

TIMEOUT_S = 300
SAMPLES = 16  # 2 ranks x 4 batches of 2: one epoch is 2 optimizer steps of 2 micro-batches
ACCUMULATE = 2


def net() -> nn.Module:
    """Three repeated blocks (the units) between two linear layers; 17 rows split unevenly."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3)]
    return nn.Sequential(nn.Linear(8, 16), nn.Sequential(*blocks), nn.Linear(16, 17))


def loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(3)
    ds = torch.utils.data.TensorDataset(torch.randn(SAMPLES, 8, generator=g), torch.randn(SAMPLES, 17, generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=2, shuffle=False)


class Counter:
    """A user's object registered with `accelerator.register_for_checkpointing`."""

    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = state["count"]


def setup(mode: str) -> tuple[Any, ...]:
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE)
    assert accelerator.distributed_type == accelerate.DistributedType.MULTI_CPU
    model = net()
    if mode == "overlap":
        model = overlap.wrap(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    prepare = accelerator.prepare if mode == "ddp" else (lambda *o: overlap_accelerate.prepare(accelerator, *o))
    model, optimizer, data, scheduler = prepare(model, optimizer, loader(), scheduler)
    return accelerator, model, optimizer, data, scheduler


def epoch(accelerator: Any, model: Any, optimizer: Any, data: Any, scheduler: Any, record: dict) -> None:
    for x, y in data:
        with accelerator.accumulate(model):
            loss = ((model(x) - y) ** 2).mean()
            accelerator.backward(loss)
            if is_wrapped(model):
                record["sync_flags"].append(model._overlap_state.schedule.sync_grads)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        record["losses"].append(loss.item())
        record["lrs"].append(scheduler.get_last_lr()[0])


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    if is_wrapped(model):
        return overlap.full_state_dict(model)
    model = model.module if hasattr(model, "module") else model
    return {k: v.clone() for k, v in model.state_dict().items()}


def run(rank: int, world: int, *, mode: str, root: str) -> dict:
    torchrun_env(rank, world)
    accelerator, model, optimizer, data, scheduler = setup(mode)
    record: dict = {"losses": [], "lrs": [], "sync_flags": [], "wrapper": type(model).__name__}
    epoch(accelerator, model, optimizer, data, scheduler, record)
    counter = Counter()
    counter.count = 7
    accelerator.register_for_checkpointing(counter)
    if mode == "overlap":
        overlap_accelerate.save_state(accelerator, root, model, optimizer, scheduler, step=2, extra={"epoch": 1})
    else:  # accelerate's own folder: model.safetensors, optimizer.bin (keyed by position), ...
        accelerator.save_state(root)
    epoch(accelerator, model, optimizer, data, scheduler, record)
    record["params"] = params(model)
    if mode == "overlap":  # exports of the trained model, every rank calling
        accelerator.save_model(model, os.path.join(root, "saved_model"))
        accelerator.wait_for_everyone()
        exported = accelerator.get_state_dict(model)
        record["get_state_dict"] = {k: v.clone() for k, v in exported.items()}
    return record


def resume(rank: int, world: int, *, root: str) -> dict:
    torchrun_env(rank, world)
    accelerator, model, optimizer, data, scheduler = setup("overlap")
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    info = overlap_accelerate.load_state(accelerator, root, model, optimizer, scheduler)
    record: dict = {
        "losses": [],
        "lrs": [],
        "sync_flags": [],
        "info": (info["step"], info["extra"]),
        "counter": counter.count,
    }
    epoch(accelerator, model, optimizer, data, scheduler, record)
    record["params"] = params(model)
    return record


def export_hf(rank: int, world: int, *, root: str) -> dict:
    """A tiny Llama wrapped and prepared, exported by accelerate's routes (after one step)."""
    import transformers

    torchrun_env(rank, world)
    accelerator = accelerate.Accelerator(cpu=True)
    config = tiny_config("llama", vocab_size=61, hidden_size=16, intermediate_size=23, num_attention_heads=2,
                         num_key_value_heads=1, max_position_embeddings=32)  # fmt: skip
    model = overlap.wrap(tiny_model(transformers.LlamaForCausalLM, config))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = overlap_accelerate.prepare(accelerator, model, optimizer)
    ids = torch.randint(0, 61, (2, 8), generator=torch.Generator().manual_seed(rank))
    accelerator.backward(model(input_ids=ids, labels=ids).loss)
    optimizer.step()
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(os.path.join(root, "with_state_dict"), state_dict=accelerator.get_state_dict(model))
    accelerator.wait_for_everyone()
    unwrapped.save_pretrained(  # accelerate's recipe (its nlp examples), no state dict
        os.path.join(root, "recipe"), is_main_process=accelerator.is_main_process, save_function=accelerator.save
    )
    accelerator.wait_for_everyone()
    try:
        unwrapped.save_pretrained(os.path.join(root, "shards"), state_dict=model.state_dict())
        refused = "no error"
    except ValueError as e:
        refused = str(e)
    accelerator.wait_for_everyone()
    return {"full": overlap.full_state_dict(model), "refused": refused}


def no_cpu_switch(rank: int, world: int) -> str:
    torchrun_env(rank, world)
    # accelerate keeps its state per process; start from none, as a fresh torchrun process does
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
    try:
        accelerator = accelerate.Accelerator()  # no cpu=True: a world of one process on each rank
        assert accelerator.num_processes == 1, accelerator.num_processes
        overlap_accelerate.prepare(accelerator, overlap.wrap(net()))
    except ValueError as e:
        return str(e)
    finally:
        accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
    return "no error"


def accelerate_save_state(rank: int, world: int, *, root: str) -> list[str]:
    torchrun_env(rank, world)
    accelerator, *_ = setup("overlap")
    errors = []
    for call in (accelerator.save_state, accelerator.load_state):
        try:
            call(root)
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_matches_ddp_and_resumes(world2, tmp_path):
    ddp, ours = ddp_and_overlap(
        world2, run, "Sequential", TIMEOUT_S, {"root": str(tmp_path / "ddp")}, {"root": str(tmp_path / "ckpt")}
    )
    ref, full = ddp[0]["params"], ours[0]["params"]
    rtol = reordered_rtol(sum(v.numel() for v in ref.values()), steps=4)
    for rank in range(2):
        assert len(ours[rank]["losses"]) == 8
        assert ours[rank]["losses"][:2] == ddp[rank]["losses"][:2], rank  # before any update
        assert losses_within(ours[rank]["losses"], ddp[rank]["losses"], rtol), (rank, ours, ddp)
        assert ours[rank]["sync_flags"] == [False, True] * 4  # accumulate: one reduce per step
    assert not reordered_mismatches(full, ref, rtol)

    resumed = world2.run(resume, timeout_s=TIMEOUT_S, root=str(tmp_path / "ckpt"))
    for rank in range(2):
        assert resumed[rank]["info"] == (2, {"epoch": 1})
        assert resumed[rank]["counter"] == 7, rank  # the registered object, in place
        assert resumed[rank]["losses"] == ours[rank]["losses"][4:], rank
    assert [k for k in full if not torch.equal(full[k], resumed[0]["params"][k])] == []

    # accelerate's DDP save_state folder, resumed as DDP's epoch 2: the learning rates and the
    # first micro-batch losses equal, the rest within the clip's tolerance
    from_ddp = world2.run(resume, timeout_s=TIMEOUT_S, root=str(tmp_path / "ddp"))
    for rank in range(2):
        got, want = from_ddp[rank], ddp[rank]
        assert got["info"] == (None, None) and got["counter"] == 7, rank
        assert got["lrs"] == want["lrs"][4:], (rank, got["lrs"], want["lrs"])
        assert got["losses"][:2] == want["losses"][4:6], rank
        assert losses_within(got["losses"], want["losses"][4:], rtol), (rank, got["losses"], want["losses"])
    assert not reordered_mismatches(from_ddp[0]["params"], ref, rtol)

    # exports: the whole trained model on rank 0, nothing on rank 1
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "ckpt" / "saved_model" / "model.safetensors")
    assert saved.keys() == full.keys() and all(torch.equal(saved[k], full[k]) for k in full)
    assert ours[0]["get_state_dict"].keys() == full.keys()
    assert all(torch.equal(ours[0]["get_state_dict"][k], full[k]) for k in full)
    assert ours[1]["get_state_dict"] == {}


def test_hf_model_exports(world2, tmp_path):
    transformers = pytest.importorskip("transformers", reason="optional extra `hf`; CI installs it")
    results = world2.run(export_hf, timeout_s=TIMEOUT_S, root=str(tmp_path))
    full = results[0]["full"]
    for folder in ("with_state_dict", "recipe"):
        loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / folder).state_dict()
        assert [k for k in full if not torch.equal(loaded[k], full[k])] == [], folder
    for result in results:
        assert "state_dict holds the DTensor shards" in result["refused"], result["refused"]
        assert "accelerator.get_state_dict(model)" in result["refused"]
    assert not (tmp_path / "shards").exists() or not any((tmp_path / "shards").glob("*.safetensors"))


def test_accelerator_save_state_and_missing_cpu_switch_are_refused(world2, tmp_path):
    for errors in world2.run(accelerate_save_state, timeout_s=TIMEOUT_S, root=str(tmp_path)):
        assert len(errors) == 2, errors
        assert "overlap.integrations.accelerate.save_state(" in errors[0]
        assert "overlap.integrations.accelerate.load_state(" in errors[1]
    for error in world2.run(no_cpu_switch, timeout_s=TIMEOUT_S):
        assert "the framework runs 1 process(es), the launched world 2" in error, error
        assert "Accelerator(cpu=True)" in error, error
