"""The non-finite codec error is collective ([Note: collective finite check] in
overlap/compression/finite.py): a NaN gradient (or parameter) on ONE rank makes EVERY rank raise the
same ValueError at the same step, so that a training loop that catches it and skips the step keeps
every rank in step, instead of one rank raising alone and the others waiting in the next collective.

Each world run has a deadline (the harness names a rank that misses it), and every collective in
the ranks has the process group's timeout; a rank that did not raise would block in the
`clip_grad_norm_` all-reduce right after backward, and the deadline names it."""

from __future__ import annotations

import torch
import torch.distributed as dist
from helpers.models import batch, loss_of, tiny_lm
from torch.distributed.device_mesh import init_device_mesh

import overlap

DEADLINE_S = 150.0  # a loaded two-core machine; a hang fails here, naming the rank


def train_with_a_bad_rank(
    rank: int, world: int, config: dict, bad_rank: int, bad_step: int, what: str = "grad", steps: int = 4,
    hsdp: bool = False,
) -> dict:  # fmt: skip
    """Train `steps` SGD steps; at `bad_step`, rank `bad_rank` alone gets a NaN loss (every
    gradient it sends is NaN) or, with what="param", a NaN in its parameter shard before the
    forward (every rank decodes it from the gathers). Catch what backward raises and skip that
    step, as a user would. Returns each caught error as (step, type, message)."""
    base = tiny_lm(dim=32, hidden=64)
    group = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")) if hsdp else None
    model = overlap.wrap(base, group=group, **config)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    caught = []
    for step in range(steps):
        bad = rank == bad_rank and step == bad_step
        if bad and what == "param":
            with torch.no_grad():
                next(p for p in model.parameters() if p.to_local().numel()).to_local().view(-1)[0] = float("nan")
        loss = loss_of(model(batch(base, rank, step)))
        if bad and what == "grad":
            loss = loss * float("nan")
        try:
            loss.backward()
        except Exception as exc:
            caught.append((step, type(exc).__name__, str(exc)))
            opt.zero_grad(set_to_none=True)
            if what == "param":  # a user would restore the parameter (here: from its peers' copy)
                with torch.no_grad():
                    for p in model.parameters():
                        p.to_local().nan_to_num_(0.0)
            dist.barrier()
            continue
        overlap.clip_grad_norm_(model, 1.0)  # a collective: a rank that did not raise waits here
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"caught": caught}


def _check_every_rank_raised_alike(results: list[dict], bad_step: int, config: dict) -> None:
    """Every rank caught the same error (word for word) at `bad_step`, and only then: the steps
    after it are clean, error feedback too (a non-finite block leaves a zero residual, [Note:
    error feedback residual]; a NaN kept there would raise again at every later step)."""
    caught = [r["caught"] for r in results]
    assert all(c == caught[0] for c in caught), (config, caught)
    assert [step for step, _, _ in caught[0]] == [bad_step], (config, caught)
    assert "Inf or NaN" in caught[0][0][2], (config, caught)


def test_nan_gradient_on_one_rank_raises_on_every_rank(world2):
    """Two ranks: rank 1's gradients are NaN at step 1; its peer receives only decoded NaN,
    never counts a bad block itself, and still raises, the same message, at the same step."""
    for config in (
        {"grad_compression": "int8"},
        {"grad_compression": "int4", "error_feedback": True},
        {"grad_compression": "int8", "error_feedback": True, "error_feedback_dtype": torch.int8},
    ):
        results = world2.run(train_with_a_bad_rank, timeout_s=DEADLINE_S, config=config, bad_rank=1, bad_step=1)
        _check_every_rank_raised_alike(results, 1, config)
        assert "counted over every rank" in results[0]["caught"][0][2]


def test_nan_parameter_on_one_rank_raises_on_every_rank(world2):
    """int8 parameter all-gathers: the NaN block is counted where every rank decodes it."""
    config = {"param_compression": "int8"}
    results = world2.run(train_with_a_bad_rank, timeout_s=DEADLINE_S, config=config, bad_rank=0, bad_step=2,
                         what="param")  # fmt: skip
    _check_every_rank_raised_alike(results, 2, config)


def test_nan_gradient_at_four_ranks_and_under_hsdp(world4):
    """Four ranks: a middle rank (its own row travels to itself) and an end rank (its own row
    stays home); then a 2 x 2 HSDP mesh, where the count reaches the other replica through the
    all-reduce of the reduced shard."""
    config = {"grad_compression": "int8"}
    for bad_rank in (1, 3):
        results = world4.run(train_with_a_bad_rank, timeout_s=DEADLINE_S, config=config, bad_rank=bad_rank,
                             bad_step=1, steps=3)  # fmt: skip
        _check_every_rank_raised_alike(results, 1, config)
    results = world4.run(train_with_a_bad_rank, timeout_s=DEADLINE_S, config=config, bad_rank=2, bad_step=1,
                         steps=3, hsdp=True)  # fmt: skip
    _check_every_rank_raised_alike(results, 1, {**config, "hsdp": True})


def encoded_reduce_scatter_paths(rank: int, world: int) -> dict:
    """`reduce_scatter_encoded` on both layouts of what it receives: evenly spaced rows (a view)
    and, with receive slack larger than a row (gloo), rows copied together. Rank 1 sends one NaN
    block to each peer. Returns the two results and their count elements."""
    import torch.distributed as dist

    from overlap.compression import Int8Codec
    from overlap.transport import coded
    from overlap.transport import collectives as comm

    numel = 64 * 6
    grads = torch.randn(world, numel, generator=torch.Generator().manual_seed(rank))
    if rank == 1:
        grads[:, 70] = float("nan")  # block 1 of every row
    tail = torch.ones(world, 3)
    outs, layouts = [], []
    peer_rows = coded._peer_rows

    def recorded(buf: torch.Tensor, *args: object) -> torch.Tensor:
        rows = peer_rows(buf, *args)  # type: ignore[arg-type]
        layouts.append("view" if rows.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr() else "copy")
        return rows

    coded._peer_rows = recorded
    try:
        for slack in (None, comm.RecvSlack(rank, 1 << 16)):
            out = comm.wait(
                coded.reduce_scatter_encoded(grads, tail, dist.group.WORLD, world, Int8Codec(64), None, slack)
            )
            outs.append(out)
    finally:
        coded._peer_rows = peer_rows
    return {"outs": outs, "layouts": layouts}


def test_encoded_reduce_scatter_sums_the_counts_on_either_receive_layout(world2, world4):
    """[Note: collective finite check] at the collective: the reduced shard ends in the sum of
    every rank's count (rank 1 encoded one NaN block per peer row: world size - 1), after the
    tail summed exactly; with receive slack larger than a row (at four ranks the rows are then
    copied together) the result is bitwise the same as with evenly spaced rows (a view)."""
    for world in (world2, world4):
        for rank, r in enumerate(world.run(encoded_reduce_scatter_paths, timeout_s=DEADLINE_S)):
            _check_paths(rank, world.world_size, *r["outs"])
            assert r["layouts"] == ["view", "view" if world.world_size == 2 else "copy"], (rank, r["layouts"])


def _check_paths(rank: int, world_size: int, plain: torch.Tensor, slack: torch.Tensor) -> None:
    numel = 64 * 6
    assert plain.shape == (numel + 3 + 1,)
    assert torch.equal(plain[numel : numel + 3], torch.full((3,), float(world_size))), plain[numel:]
    assert plain[-1].item() == world_size - 1, (rank, plain[-1])  # every rank receives the same count
    nan = plain.isnan()
    assert torch.equal(nan, slack.isnan()) and torch.equal(plain[~nan], slack[~nan]), rank
    # the others decode rank 1's NaN block: NaN across it; rank 1 adds its own row exactly: one NaN
    expected = torch.zeros(numel + 4, dtype=torch.bool)
    expected[64:128] = rank != 1
    expected[70] = True
    assert torch.equal(nan, expected), (rank, nan.nonzero().flatten().tolist())
