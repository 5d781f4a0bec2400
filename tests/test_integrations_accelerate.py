"""accelerate with overlap (overlap.integrations.accelerate), 2 ranks on gloo, multi-CPU mode.

The ranks are the harness's spawned world with torchrun's environment variables set; an
`Accelerator(cpu=True)` finds them and the process group initialized (DistributedType.MULTI_CPU).

- `prepare` + `accelerator.accumulate` (2 micro-batches per step; the first one's backward
  reduces nothing) + `accelerator.clip_grad_norm_` + a prepared scheduler, 2 epochs of 2 steps,
  against the same script with `accelerator.prepare(model, ...)` (DDP): the first step's
  micro-batch losses equal bitwise; the global norm of the clip is summed over shards here and over
  whole tensors by DDP ([Note: what is bitwise] in tests/tolerance.py), so the later losses and the
  final parameters are within `reordered_rtol` of DDP's.
- `save_state` after epoch 1, then `load_state` into a freshly built model, optimizer and
  scheduler: epoch 2 gives bitwise the losses and final parameters of the uninterrupted run (the
  AdamW moments of both ranks' shards came back, and `accelerator.step`).
- `accelerator.save_state` / `load_state` on a wrapped model raise on every rank, naming the fix.
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

import overlap  # noqa: E402
from harness import rank_threads  # noqa: E402
from tolerance import losses_within, reordered_mismatches, reordered_rtol  # noqa: E402
from overlap.integrations import accelerate as overlap_accelerate  # noqa: E402
from overlap.integrations import is_wrapped  # noqa: E402

TIMEOUT_S = 300
SAMPLES = 16  # 2 ranks x 4 batches of 2: one epoch is 2 optimizer steps of 2 micro-batches
ACCUMULATE = 2


def torchrun_env(rank: int, world: int) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
        OMP_NUM_THREADS=str(rank_threads()),  # else accelerate's CPU mode sets torch's thread count itself
    )


def net() -> nn.Module:
    """Three repeated blocks (the units) between two linear layers; 17 rows split unevenly."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3)]
    return nn.Sequential(nn.Linear(8, 16), nn.Sequential(*blocks), nn.Linear(16, 17))


def loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(3)
    ds = torch.utils.data.TensorDataset(torch.randn(SAMPLES, 8, generator=g), torch.randn(SAMPLES, 17, generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=2, shuffle=False)


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


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    if is_wrapped(model):
        return overlap.full_state_dict(model)
    model = model.module if hasattr(model, "module") else model
    return {k: v.clone() for k, v in model.state_dict().items()}


def run(rank: int, world: int, *, mode: str, root: str) -> dict:
    torchrun_env(rank, world)
    accelerator, model, optimizer, data, scheduler = setup(mode)
    record: dict = {"losses": [], "sync_flags": [], "wrapper": type(model).__name__}
    epoch(accelerator, model, optimizer, data, scheduler, record)
    if mode == "overlap":
        overlap_accelerate.save_state(accelerator, root, model, optimizer, scheduler, step=2, extra={"epoch": 1})
    epoch(accelerator, model, optimizer, data, scheduler, record)
    record["params"] = params(model)
    return record


def resume(rank: int, world: int, *, root: str) -> dict:
    torchrun_env(rank, world)
    accelerator, model, optimizer, data, scheduler = setup("overlap")
    info = overlap_accelerate.load_state(accelerator, root, model, optimizer, scheduler)
    record: dict = {"losses": [], "sync_flags": [], "info": (info["step"], info["extra"])}
    epoch(accelerator, model, optimizer, data, scheduler, record)
    record["params"] = params(model)
    return record


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
    ddp = world2.run(run, timeout_s=TIMEOUT_S, mode="ddp", root=str(tmp_path / "unused"))
    ours = world2.run(run, timeout_s=TIMEOUT_S, mode="overlap", root=str(tmp_path / "ckpt"))
    assert [r["wrapper"] for r in ddp] == ["DistributedDataParallel"] * 2
    assert [r["wrapper"] for r in ours] == ["Sequential"] * 2  # not put inside DDP
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
        assert resumed[rank]["losses"] == ours[rank]["losses"][4:], rank
    assert [k for k in full if not torch.equal(full[k], resumed[0]["params"][k])] == []


def test_accelerator_save_state_is_refused(world2, tmp_path):
    for errors in world2.run(accelerate_save_state, timeout_s=TIMEOUT_S, root=str(tmp_path)):
        assert len(errors) == 2, errors
        assert "overlap.integrations.accelerate.save_state(" in errors[0]
        assert "overlap.integrations.accelerate.load_state(" in errors[1]
