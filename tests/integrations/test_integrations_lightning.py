"""Lightning with overlap (overlap.integrations.lightning), 2 ranks on gloo.

The ranks are the harness's spawned world with torchrun's environment variables set: Lightning
finds an externally launched world (LightningEnvironment) and the process group initialized.

- Trainer: `OverlapStrategy` with the model wrapped in `configure_model` trains 2 epochs of 2
  optimizer steps (accumulate_grad_batches=2; the first micro-batch's backward reduces nothing)
  with every training-step loss and every final parameter equal bitwise to Lightning's DDP
  strategy. Its ModelCheckpoint after epoch 1 (a DCP folder: every rank's shards) resumes with
  `fit(ckpt_path=...)`: epoch 2 gives bitwise the losses and final parameters of the
  uninterrupted run (the AdamW moments of both ranks' shards and the scheduler came back). The
  final DCP checkpoint, converted to one file by torch's `dcp_to_torch_save`, loads strictly into
  an unwrapped LightningModule with bitwise the trained parameters; so does a one-file
  `trainer.save_checkpoint(path, weights_only=True)` (which holds no optimizer state). The
  same from a one-file checkpoint (`save_distributed_checkpoint=False`: gathered on rank 0), and
  from the checkpoint Lightning's DDP strategy wrote after its epoch 1 (one file, the optimizer
  state keyed by position): epoch 2 gives bitwise DDP's losses and final parameters. At one rank,
  our 2-rank checkpoint resumes (resharded) bitwise as Lightning's DDP resumes its own on one rank.
- Fabric: `OverlapFabricStrategy` with `fabric.no_backward_sync` accumulation and a StepLR
  scheduler, 5 steps, equal bitwise to Fabric's DDP; `fabric.save` after step 3, then
  `fabric.load` into a freshly built model, optimizer and scheduler, from our checkpoint (a DCP
  folder) and from the one Fabric's DDP saved (one file, the optimizer state keyed by position):
  each restores the scheduler in place (the same object, its step count, as under
  `strategy="ddp"`) and reproduces steps 4 and 5 (losses, learning rates) and DDP's final
  parameters bitwise.
- A LightningModule whose `configure_model` leaves a trainable parameter outside every wrapped
  module is refused at setup, on every rank (nothing would average its gradient); so is a
  Trainer or Fabric with `devices=1` in a world of 2 launched processes (each rank would train
  alone on all the data while `overlap.wrap` shards over both).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.nn as nn

L = pytest.importorskip(
    "lightning", reason="optional extra `integrations` (pip install -e '.[integrations]'); CI installs it"
)

from helpers.harness import torchrun_env

import overlap
from overlap.integrations import is_wrapped
from overlap.integrations import lightning as overlap_lightning

TIMEOUT_S = 300  # a fit is a few seconds; generous for a loaded machine
BATCH = 2
SAMPLES = 16  # 2 ranks x 4 batches of 2: one epoch is 2 optimizer steps of 2 micro-batches


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class Net(nn.Module):
    """Blocks are the units; 17 output rows do not split evenly over 2 ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.out = nn.Linear(16, 17)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(3)
    ds = torch.utils.data.TensorDataset(torch.randn(SAMPLES, 8, generator=g), torch.randn(SAMPLES, 17, generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=False)


class LitNet(L.LightningModule):
    def __init__(self, wrap: str | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = Net()
        self.head = nn.Linear(17, 17)  # outside self.net: wrapped with it only when wrap == "all"
        self.wrap = wrap
        self.losses: list[float] = []
        self.sync_flags: list[bool] = []

    def configure_model(self) -> None:
        if self.wrap == "net":
            self.head.requires_grad_(False)
            self.net = overlap_lightning.wrap(self.net, self.device_mesh)
        elif self.wrap == "net_only":  # forgets the trainable head
            self.net = overlap_lightning.wrap(self.net, self.device_mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.net(x))

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        x, y = batch
        loss = ((self(x) - y) ** 2).mean()
        self.losses.append(loss.item())
        return loss

    def on_after_backward(self) -> None:
        if is_wrapped(self.net):
            self.sync_flags.append(self.net._overlap_state.schedule.sync_grads)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)}


def fit(
    rank: int, world: int, *, mode: str, out: str, epochs: int, resume: str | None = None, full: bool = False
) -> dict:
    """Lightning DDP ("ddp") or OverlapStrategy ("overlap": a ModelCheckpoint every epoch; with
    `full`, one-file checkpoints: `out/full.ckpt` saved after fit instead)."""
    torchrun_env(rank, world, NODE_RANK="0")
    lit = LitNet(wrap=None if mode == "ddp" else "net")
    if mode == "ddp":
        lit.head.requires_grad_(False)
    callbacks = []
    if resume is None and not full:
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=out, save_top_k=-1, every_n_epochs=1))
    strategy = "ddp" if mode == "ddp" else overlap_lightning.OverlapStrategy(save_distributed_checkpoint=not full)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_epochs=epochs,
        accumulate_grad_batches=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(callbacks),
        callbacks=callbacks,
        default_root_dir=out,
    )
    trainer.fit(lit, data(), ckpt_path=resume)
    if full and resume is None:
        trainer.save_checkpoint(os.path.join(out, "full.ckpt"))
        trainer.save_checkpoint(os.path.join(out, "weights.ckpt"), weights_only=True)
    full = overlap.full_state_dict(lit.net) if mode == "overlap" else lit.net.state_dict()
    return {"losses": lit.losses, "sync_flags": lit.sync_flags, "params": {k: v.clone() for k, v in full.items()}}


def refused(rank: int, world: int, *, out: str, what: str) -> str:
    """The error for `what`: "unwrapped" (a trainable head outside the wrap), "trainer_devices" /
    "fabric_devices" (devices=1 in a world of `world` processes); or "no error"."""
    torchrun_env(rank, world, NODE_RANK="0")
    devices = 1 if what.endswith("devices") else world
    try:
        if what == "fabric_devices":
            fabric = L.Fabric(accelerator="cpu", devices=devices, strategy=overlap_lightning.OverlapFabricStrategy())
            fabric.launch()
            return "no error"
        trainer = L.Trainer(
            accelerator="cpu",
            devices=devices,
            strategy=overlap_lightning.OverlapStrategy(),
            max_steps=1,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            default_root_dir=out,
        )
        trainer.fit(LitNet(wrap="net_only" if what == "unwrapped" else "net"), data())
    except ValueError as e:
        return str(e)
    return "no error"


def fabric_run(rank: int, world: int, *, mode: str, out: str) -> dict:
    torchrun_env(rank, world, NODE_RANK="0")
    strategy = "ddp" if mode == "ddp" else overlap_lightning.OverlapFabricStrategy()
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()

    def build() -> tuple[Any, Any, Any]:
        torch.manual_seed(0)
        net = Net()
        if mode == "ddp":
            model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
        else:
            model = fabric.setup_module(net)
            optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
        return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

    def step(model: Any, optimizer: Any, i: int, record: dict) -> None:
        for micro in range(2):
            g = torch.Generator().manual_seed(100 * i + 10 * micro + rank)
            x, y = torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 17, generator=g)
            with fabric.no_backward_sync(model, enabled=micro == 0):
                loss = ((model(x) - y) ** 2).mean()
                fabric.backward(loss)
                if mode == "overlap":
                    record["sync_flags"].append(model.module._overlap_state.schedule.sync_grads)
            record["losses"].append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
        record["lrs"].append(optimizer.param_groups[0]["lr"])

    def fresh() -> dict:
        return {"losses": [], "sync_flags": [], "lrs": []}

    def full_params(model: Any) -> dict[str, torch.Tensor]:
        if mode == "ddp":
            return {k: v.clone() for k, v in model.module.state_dict().items()}
        return overlap.full_state_dict(model.module)  # {} on rank 1

    def resume_from(path: str) -> dict:
        """A fresh model, optimizer and scheduler (trained one step, to differ), loaded from
        `path`, then steps 3 and 4."""
        model, optimizer, scheduler = build()
        step(model, optimizer, 7, fresh())
        scheduler.step()
        state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
        fabric.load(path, state)
        record = {**fresh(), "step": state["step"], "in_place": (state["scheduler"] is scheduler, scheduler.last_epoch)}
        for i in (3, 4):
            step(model, optimizer, i, record)
            scheduler.step()
        return {**record, "params": full_params(model)}

    model, optimizer, scheduler = build()
    record = fresh()
    for i in range(3):
        step(model, optimizer, i, record)
        scheduler.step()
    # DDP: one file, the optimizer state keyed by position; overlap: a DCP folder
    path = os.path.join(out, f"fabric_{mode}")
    fabric.save(path, {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 3})
    record["after"] = fresh()
    for i in (3, 4):
        step(model, optimizer, i, record["after"])
        scheduler.step()
    record["after"]["params"] = full_params(model)
    if mode == "overlap":
        record["resumed"] = resume_from(path)
        record["from_ddp"] = resume_from(os.path.join(out, "fabric_ddp"))
    return record


def assert_plain_loads(state_dict: dict, expected: dict) -> None:
    """`state_dict` (a LitNet's, whole) loads strictly into an unwrapped LitNet, whose `net` then
    holds bitwise `expected`."""
    plain = LitNet(wrap=None)
    plain.load_state_dict(state_dict, strict=True)
    got = plain.net.state_dict()
    assert got.keys() == expected.keys() and [k for k in got if not torch.equal(got[k], expected[k])] == []


def test_trainer_matches_ddp_and_resumes(world2, world1, tmp_path):
    ddp = world2.run(fit, timeout_s=TIMEOUT_S, mode="ddp", out=str(tmp_path / "ddp"), epochs=2)
    ours = world2.run(fit, timeout_s=TIMEOUT_S, mode="overlap", out=str(tmp_path / "ours"), epochs=2)
    for rank in range(2):  # 2 epochs x 2 steps x 2 micro-batches
        assert len(ours[rank]["losses"]) == 8
        assert ours[rank]["losses"] == ddp[rank]["losses"], rank
        assert ours[rank]["sync_flags"] == [False, True] * 4  # accumulation reduces once per step
    ref, full = ddp[0]["params"], ours[0]["params"]
    assert full.keys() == ref.keys()
    assert [k for k in ref if not torch.equal(ref[k], full[k])] == []

    checkpoints = sorted(p.name for p in (tmp_path / "ours").iterdir() if p.name.endswith(".ckpt"))
    assert checkpoints == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt"], checkpoints
    first = tmp_path / "ours" / checkpoints[0]
    assert first.is_dir() and (first / ".metadata").is_file()  # DCP: every rank's shards
    resumed = world2.run(
        fit, timeout_s=TIMEOUT_S, mode="overlap", out=str(tmp_path / "resumed"), epochs=2, resume=str(first)
    )
    for rank in range(2):
        assert resumed[rank]["losses"] == ours[rank]["losses"][4:], rank
    assert [k for k in full if not torch.equal(full[k], resumed[0]["params"][k])] == []

    # exports a plain LightningModule loads: the DCP folder converted by torch's dcp_to_torch_save
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(tmp_path / "ours" / checkpoints[1], tmp_path / "export.pt")
    assert_plain_loads(torch.load(tmp_path / "export.pt", weights_only=True)["state_dict"], full)

    # save_distributed_checkpoint=False: one file, the full model and optimizer state from rank 0;
    # with weights_only=True the model alone, which a plain LightningModule loads
    one_epoch = world2.run(fit, timeout_s=TIMEOUT_S, mode="overlap", out=str(tmp_path / "full"), epochs=1, full=True)
    assert (tmp_path / "full" / "full.ckpt").is_file()
    weights = torch.load(tmp_path / "full" / "weights.ckpt", weights_only=True)
    assert "optimizer_states" not in weights
    assert_plain_loads(weights["state_dict"], one_epoch[0]["params"])
    from_file = world2.run(
        fit,
        timeout_s=TIMEOUT_S,
        mode="overlap",
        out=str(tmp_path / "full"),
        epochs=2,
        resume=str(tmp_path / "full" / "full.ckpt"),
        full=True,
    )
    for rank in range(2):
        assert from_file[rank]["losses"] == ours[rank]["losses"][4:], rank
    assert [k for k in full if not torch.equal(full[k], from_file[0]["params"][k])] == []

    # the checkpoint Lightning's DDP strategy wrote after epoch 1: resumed as DDP's own epoch 2
    ddp_first = tmp_path / "ddp" / checkpoints[0]
    assert ddp_first.is_file()
    from_ddp = world2.run(
        fit, timeout_s=TIMEOUT_S, mode="overlap", out=str(tmp_path / "from_ddp"), epochs=2, resume=str(ddp_first)
    )
    for rank in range(2):
        assert from_ddp[rank]["losses"] == ddp[rank]["losses"][4:], rank
    assert [k for k in ref if not torch.equal(ref[k], from_ddp[0]["params"][k])] == []

    # at another number of ranks: one rank resumes our 2-rank checkpoint (DCP reshards it) as
    # Lightning's DDP on one rank resumes its own
    one_ddp = world1.run(
        fit, timeout_s=TIMEOUT_S, mode="ddp", out=str(tmp_path / "one_ddp"), epochs=2, resume=str(ddp_first)
    )
    one_ours = world1.run(
        fit, timeout_s=TIMEOUT_S, mode="overlap", out=str(tmp_path / "one"), epochs=2, resume=str(first)
    )
    assert len(one_ours[0]["losses"]) == 8 and one_ours[0]["losses"] == one_ddp[0]["losses"]
    want = one_ddp[0]["params"]
    assert [k for k in want if not torch.equal(want[k], one_ours[0]["params"][k])] == []


def test_fabric_matches_ddp_and_checkpoints(world2, tmp_path):
    ddp = world2.run(fabric_run, timeout_s=TIMEOUT_S, mode="ddp", out=str(tmp_path))
    ours = world2.run(fabric_run, timeout_s=TIMEOUT_S, mode="overlap", out=str(tmp_path))
    for rank in range(2):
        assert ours[rank]["losses"] == ddp[rank]["losses"], rank
        assert ours[rank]["lrs"] == ddp[rank]["lrs"] == [1e-2, 5e-3, 2.5e-3], rank
        assert ours[rank]["sync_flags"] == [False, True] * 3
        for source in ("resumed", "from_ddp"):  # our DCP folder, DDP's one file
            resumed, want = ours[rank][source], ours[rank]["after"]
            assert resumed["step"] == 3 and resumed["in_place"] == (True, 3), (rank, source)
            assert (resumed["losses"], resumed["lrs"]) == (want["losses"], want["lrs"]), (rank, source)
        assert ours[rank]["after"]["losses"] == ddp[rank]["after"]["losses"], rank
    want = ddp[0]["after"]["params"]
    for got in (ours[0]["after"]["params"], ours[0]["resumed"]["params"], ours[0]["from_ddp"]["params"]):
        assert got.keys() == want.keys() and [k for k in want if not torch.equal(got[k], want[k])] == []


def test_unwrapped_parameter_and_wrong_device_count_are_refused(world2, tmp_path):
    for error in world2.run(refused, timeout_s=TIMEOUT_S, out=str(tmp_path), what="unwrapped"):
        assert "not inside a module wrapped by overlap.wrap (head.weight, head.bias)" in error, error
    for what in ("trainer_devices", "fabric_devices"):
        strategy = "OverlapStrategy" if what == "trainer_devices" else "OverlapFabricStrategy"
        for error in world2.run(refused, timeout_s=TIMEOUT_S, out=str(tmp_path), what=what):
            assert error.startswith(f"{strategy}: the framework runs 1 process(es), the launched world 2"), error
            assert "devices=<processes per node>" in error, error
