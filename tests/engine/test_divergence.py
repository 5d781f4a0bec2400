"""Ranks that run different phases are caught, not hung ([Note: collective fingerprints]).

Every all-gather (uncompressed, or compressed: the tag ends each rank's byte row) carries each
rank's (step, phase, unit, trainable signature); a
rank that evaluates alone, skips a unit, or froze other parameters makes every rank raise in the
same collective, naming what each rank ran. No collective is added per step.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from helpers.harness import World
from helpers.models import STRICT_ZERO3, batch, encoder_stack, loss_of


class Skippy(nn.Module):
    """Equal blocks; `forward(x, skip)` leaves block `skip` out (a data-dependent branch)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    def forward(self, x: torch.Tensor, skip: int | None = None) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if i != skip:
                x = torch.tanh(block(x))
        return x


def _train_step(model: nn.Module, x: torch.Tensor, **kwargs) -> None:
    loss_of(model(x, **kwargs) if kwargs else model(x)).backward()


def eval_on_rank0_only(rank: int, world: int, config: dict | None = None) -> str:
    import overlap

    model = overlap.wrap(encoder_stack(layers=3, dim=16), collective_timeout_s=60, **(config or {}))
    _train_step(model, batch(model, rank, 0))
    try:
        if rank == 0:
            with torch.no_grad():
                model(batch(model, rank, 1))  # the classic: `if rank == 0: evaluate()`
        _train_step(model, batch(model, rank, 2))
    except overlap.CollectiveMismatchError as e:
        return str(e)
    return "no error"


def skip_a_unit_on_one_rank(rank: int, world: int, config: dict, skip_on: tuple[int, ...] = (1,)) -> str:
    import overlap

    model = overlap.wrap(Skippy(), collective_timeout_s=30, **config)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
    _train_step(model, x)
    try:
        _train_step(model, x, skip=1 if rank in skip_on else None)
        _train_step(model, x)  # kept units: the next step's first all-gather names it
    except (overlap.CollectiveMismatchError, overlap.comm.CollectiveError) as e:
        return str(e)
    return "no error"


def freeze_on_one_rank(rank: int, world: int) -> str:
    import overlap

    model = overlap.wrap(encoder_stack(layers=3, dim=16), collective_timeout_s=60)
    _train_step(model, batch(model, rank, 0))
    if rank == 1:
        for p in model[1].self_attn.parameters():
            p.requires_grad_(False)
    try:
        _train_step(model, batch(model, rank, 1))
    except overlap.CollectiveMismatchError as e:
        return str(e)
    return "no error"


def same_phases_agree(rank: int, world: int, config: dict | None = None) -> int:
    """Evaluation on every rank, gradient accumulation, several steps: no false alarm, and the
    number of collectives per step is what it was without tags."""
    import overlap

    model = overlap.wrap(encoder_stack(layers=3, dim=16), **(config or {}))
    for step in range(3):
        with torch.no_grad():
            model(batch(model, rank, 10 + step))
        with overlap.no_sync(model):
            _train_step(model, batch(model, rank, step))
        _train_step(model, batch(model, rank, 20 + step))
    return overlap.step_stats(model).num_allgathers


@pytest.fixture
def world2():
    """A fresh world per test: a divergence leaves collectives in flight on the default group."""
    w = World(2)
    yield w
    w.close()


@pytest.mark.parametrize(
    "fn,phrases",
    [(eval_on_rank0_only, ("forward (no grad)", "rank 0:", "rank 1:")), (freeze_on_one_rank, ("signature",))],
    ids=["eval_on_rank0", "freeze_on_one_rank"],
)
def test_divergence_raises_on_every_rank(world2, fn, phrases):
    _assert_diverged(world2.run(fn, timeout_s=240), phrases)


def _assert_diverged(messages: list[str], phrases: tuple[str, ...]) -> None:
    for rank, message in enumerate(messages):
        assert message.startswith(f"overlap: rank {rank}: the ranks' collectives diverged"), message
        for phrase in phrases:
            assert phrase in message, (phrase, message)


@pytest.mark.parametrize(
    "config", [{"param_compression": "int8"}, {"param_compression": "bf16", "grad_compression": "int8"}]
)
def test_compressed_gathers_carry_the_tag(world2, config):
    """The tag rides at the end of each rank's encoded bytes: the same divergence is caught."""
    messages = world2.run(eval_on_rank0_only, config=config, timeout_s=240)
    _assert_diverged(messages, ("forward (no grad)", "rank 0:", "rank 1:"))


@pytest.mark.parametrize("config", [STRICT_ZERO3, {}], ids=["strict-zero3", "kept-units"])
def test_skipped_unit_raises_on_every_rank(world2, config):
    """A rank that skips a unit leaves its prefetched copy unused and issues its backward
    collectives in another order. Where the paired collectives are both all-gathers the tags
    name both sides; where a rank's all-gather meets the other's reduce-scatter, the collective
    fails within `collective_timeout_s` on every rank, naming its unit. Either way: no hang.
    With every unit kept for backward (the default on this small model), the backward is
    reductions only: the next step's first all-gather raises, naming the signature
    ([Note: reduction trail] in fingerprint.py)."""
    messages = world2.run(skip_a_unit_on_one_rank, config=config, timeout_s=240)
    for rank, message in enumerate(messages):
        assert message.startswith(f"overlap: rank {rank}: the "), message
        assert "diverged" in message or "collective_timeout_s=30" in message, message
        if config == {}:
            assert "diverged" in message and "step 3 forward" in message, message


def test_same_skip_on_every_rank_raises_nothing(world2):
    """Layer drop under one seed: every rank skips the same unit, so every rank reduces in the
    same order, and the reduction trail agrees: no false alarm."""
    assert world2.run(skip_a_unit_on_one_rank, config={}, skip_on=(0, 1), timeout_s=240) == ["no error"] * 2


@pytest.mark.parametrize("config", [{}, {"param_compression": "int8"}], ids=["plain", "int8_weights"])
def test_no_false_alarm_and_no_extra_collective(world2, config):
    gathers = world2.run(same_phases_agree, config=config, timeout_s=240)
    assert gathers[0] == gathers[1] > 0


# What the last step left unread is read by checkpoint.save and
# full_state_dict, on every rank ([Note: final checks] in engine/late_checks.py).


def _export(model: nn.Module, where: str, root: str) -> None:
    import overlap

    if where == "save":
        overlap.checkpoint.save(root, model, step=2)
    else:
        overlap.full_state_dict(model)


def skip_in_the_final_step(rank: int, world: int, where: str, root: str, skip_on: tuple[int, ...]) -> str:
    """Every unit kept for backward: the final step's backward is reductions only, so nothing
    but the reduction trail can see that one rank skipped a unit ([Note: reduction trail])."""
    import overlap

    model = overlap.wrap(Skippy(), collective_timeout_s=30)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
    _train_step(model, x)
    _train_step(model, x, skip=1 if rank in skip_on else None)  # the final step
    try:
        _export(model, where, f"{root}/rank{rank}" if where == "export" else root)
    except overlap.CollectiveMismatchError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("where", ["save", "export"])
def test_final_step_divergence_raises_at_save_on_every_rank(world2, tmp_path, where):
    messages = world2.run(skip_in_the_final_step, where=where, root=str(tmp_path), skip_on=(1,), timeout_s=240)
    caller = "overlap.checkpoint.save" if where == "save" else "overlap.full_state_dict"
    for rank, message in enumerate(messages):
        assert message.startswith(f"overlap: rank {rank}: {caller}: the ranks reduced the gradients"), message
        assert "reduction trails by rank" in message, message
    assert not list(tmp_path.iterdir()), "nothing is written once the ranks diverged"


def test_final_step_same_skip_saves(world2, tmp_path):
    assert (
        world2.run(skip_in_the_final_step, where="save", root=str(tmp_path), skip_on=(0, 1), timeout_s=240)
        == ["no error"] * 2
    )
    assert [p.name for p in tmp_path.iterdir()] == ["step_000002"]


class _StreamStandIn:
    pass


class _EventNeverDone:
    """Stands in for a CUDA event whose copy the device has not reached: only a wait reads it."""

    def record(self, stream: object) -> None:
        pass

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        pass


def deferred_tags_at_save(rank: int, world: int, root: str, freeze: bool, config: dict) -> str:
    """The CUDA executor's tag check (`StreamExecutor.check_tag`) on the CPU, set on the
    transport through its injection hook: every gather's tags go through
    `FingerprintCheck.defer` with events that never complete unless waited for (the host ran
    ahead of the device), so only `check_pending(wait=True)` can see the final step's tags.
    `freeze`: rank 1 freezes a block's attention before the final step (its tags' signature
    differs, the collectives' sizes do not)."""
    import overlap
    from overlap.transport import fingerprint
    from overlap.transport.host import HostExecutor
    from overlap.transport.streams import StreamExecutor

    class DeferredTagsExecutor(HostExecutor):
        check_tag = StreamExecutor.check_tag  # host waits, CUDA's deferred tag check

    saved = fingerprint._current_stream, torch.cuda.Event
    stream = _StreamStandIn()
    fingerprint._current_stream = lambda device: stream
    torch.cuda.Event = _EventNeverDone
    try:
        # the backend's collectives, as on CUDA (shared memory finds the frozen rank's other
        # reduction size at once: test_shm.py)
        model = overlap.wrap(encoder_stack(layers=3, dim=16), collective_timeout_s=60, shared_memory="off", **config)
        transport = model._overlap_state.runtime.transport
        old = transport.executor
        transport.set_executor(
            DeferredTagsExecutor(old.rank, old.world_size, old.device, old.timer, old.timeout, old.replicated)
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        _train_step(model, batch(model, rank, 0))
        opt.step()
        if freeze and rank == 1:
            for p in model[1].self_attn.parameters():
                p.requires_grad_(False)
        _train_step(model, batch(model, rank, 1))  # the final step: no error during it
        fingerprints = model._overlap_state.runtime.fingerprints
        assert fingerprints.num_unread > 0, "the final step's tags are still in flight"
        try:
            overlap.checkpoint.save(root, model, opt, step=2)
        except overlap.CollectiveMismatchError as e:
            return str(e)
        return "no error"
    finally:
        fingerprint._current_stream, torch.cuda.Event = saved


@pytest.mark.parametrize("config", [{}, {"param_compression": "int8"}], ids=["plain", "int8_weights"])
def test_final_step_deferred_tags_raise_at_save_on_every_rank(world2, tmp_path, config):
    messages = world2.run(deferred_tags_at_save, root=str(tmp_path / "bad"), freeze=True, config=config, timeout_s=240)
    _assert_diverged(messages, ("signature", "compared after its step", "found by overlap.checkpoint.save"))
    assert not (tmp_path / "bad").exists()
    good = world2.run(deferred_tags_at_save, root=str(tmp_path / "good"), freeze=False, config=config, timeout_s=240)
    assert good == ["no error"] * 2
    assert [p.name for p in (tmp_path / "good").iterdir()] == ["step_000002"]


def nonfinite_in_the_final_step(rank: int, world: int, root: str) -> str:
    """int8 gradients; rank 1's final-step gradients are NaN. The codec's in-step check stands in
    for CUDA's, which reads a step late (the final step's counts are read only with wait=True)."""
    import overlap

    model = overlap.wrap(encoder_stack(layers=3, dim=16), collective_timeout_s=60, grad_compression="int8")
    codec = model._overlap_state.runtime.grad_codec
    check = codec.raise_if_nonfinite
    codec.raise_if_nonfinite = lambda *, wait=False: check(wait=True) if wait else None
    _train_step(model, batch(model, rank, 0))
    loss = loss_of(model(batch(model, rank, 1)))
    (loss * (float("nan") if rank == 1 else 1.0)).backward()  # the final step
    try:
        overlap.checkpoint.save(root, model, step=2)
    except ValueError as e:
        return str(e)
    return "no error"


def test_final_step_nonfinite_raises_at_save_on_every_rank(world2, tmp_path):
    messages = world2.run(nonfinite_in_the_final_step, root=str(tmp_path), timeout_s=240)
    # the count crosses ranks with the gradients ([Note: collective finite check]): every rank
    # raises the codec's own error, the same blocks counted
    for rank, message in enumerate(messages):
        assert message.startswith(f"overlap: rank {rank}: overlap.checkpoint.save: overlap.compression."), message
        assert "Inf or NaN" in message and "counted over every rank" in message, message
    assert (
        messages[0].split("checkpoint.save: ")[1].split(" (this rank")[0]
        == messages[1].split("checkpoint.save: ")[1].split(" (this rank")[0]
    )
    assert not list(tmp_path.iterdir())
