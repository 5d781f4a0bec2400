"""The public functions around a wrapped model, the errors users get, and what the runtime
really issues (collective counts from the c10d calls, phases from profiler labels)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from helpers.models import STRICT_ZERO3, Block, TinyLM, batch, loss_of, tiny_lm
from helpers.probes import counting_reductions, error_of
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

import overlap
from overlap.transport import collectives as comm


def state_dicts(rank: int, world: int) -> dict:
    base = tiny_lm()
    plain = copy.deepcopy(base)
    ours = overlap.wrap(base)
    sharded = ours.state_dict()
    assert set(sharded) == set(plain.state_dict())
    assert all(isinstance(v, DTensor) for v in sharded.values())
    full = overlap.full_state_dict(ours, rank0_only=True)
    if rank == 0:
        fresh = TinyLM()
        fresh.load_state_dict(full)  # the unwrapped model accepts it, strict
        for k, v in plain.state_dict().items():
            assert torch.equal(full[k], v), k
    else:
        assert full == {}
    # load a different full state dict and read it back
    other = tiny_lm(seed=7).state_dict()
    overlap.load_full_state_dict(ours, other)
    back = overlap.full_state_dict(ours, rank0_only=False)
    assert all(torch.equal(back[k], other[k]) for k in other)
    # and the model computes with the loaded weights
    x = batch(ours, rank, 0)
    with torch.no_grad():
        expected = tiny_lm(seed=7)(x)
        got = ours(x)
    assert torch.equal(expected, got)
    return {}


def test_state_dicts(world2):
    world2.run(state_dicts)


def collectives_and_labels(rank: int, world: int, config: dict) -> dict:
    calls: list[str] = []  # the backend collectives issued, by kind
    ag, rs, a2a, p2p = comm._all_gather, comm._reduce_scatter, comm._all_to_all, comm._p2p_exchange

    def count_ag(*a, **k):
        calls.append("all_gather")
        return ag(*a, **k)

    def count_rs(*a, **k):
        calls.append("reduce_scatter")
        return rs(*a, **k)

    def count_a2a(*a, **k):  # gradients on gloo (reduce_scatter_impl="auto"), small gathers too
        calls.append("all_to_all")
        return a2a(*a, **k)

    def count_p2p(*a, **k):  # gloo's all-to-all: point to point, receives first
        calls.append("all_to_all")
        return p2p(*a, **k)

    comm._all_gather, comm._reduce_scatter, comm._all_to_all = count_ag, count_rs, count_a2a
    comm._p2p_exchange = count_p2p
    model = overlap.wrap(tiny_lm(layers=4), shared_memory="off", **config)  # gloo's collectives counted
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    per_step = []
    for step in range(3):
        calls.clear()
        if step == 2:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                loss_of(model(batch(model, rank, step))).backward()
            labels = [e.name for e in prof.events() if e.name.startswith("overlap::")]
        else:
            loss_of(model(batch(model, rank, step))).backward()
        opt.step()
        opt.zero_grad()
        per_step.append(list(calls))
    stats = overlap.step_stats(model)
    comm._all_gather, comm._reduce_scatter, comm._all_to_all, comm._p2p_exchange = ag, rs, a2a, p2p
    return {"calls": per_step, "labels": labels, "stats": stats}


NATIVE = {"all_gather_impl": "native", **STRICT_ZERO3}


@pytest.mark.parametrize(
    "config,gathers,reduces,issued",
    [
        # root unit (embed, final norm, head) + 4 blocks; the root stays gathered all step,
        # the last block is kept for backward: 1 + 4 forward, 3 backward
        (NATIVE, 8, 5, {"all_gather": 8, "all_to_all": 5}),
        ({**NATIVE, "reshard_after_forward": False}, 5, 5, {"all_gather": 5, "all_to_all": 5}),  # ZeRO-2
        ({**NATIVE, "reduce_scatter_bucket_bytes": 10**9}, 8, 1, {"all_gather": 8, "all_to_all": 1}),
        ({**NATIVE, "reduce_scatter_impl": "native"}, 8, 5, {"all_gather": 8, "reduce_scatter": 5}),
        # the default on gloo ([Note: fused exchange]): every collective an all-to-all, and two of
        # the three backward gathers (those issued right after a reduction) ride in it: 13 -> 11
        (STRICT_ZERO3, 8, 5, {"all_to_all": 11}),
        ({"reduce_scatter_bucket_bytes": 10**9, **STRICT_ZERO3}, 8, 1, {"all_to_all": 9}),  # no reduction to ride in
        (
            {"reduce_scatter_impl": "native", **STRICT_ZERO3},
            8,
            5,
            {"all_to_all": 8, "reduce_scatter": 5},
        ),  # nothing fused
        # the defaults: the 4 small blocks are kept from forward to backward, no backward gather
        ({}, 5, 5, {"all_to_all": 10}),
        ({"keep_for_backward_bytes": 1}, 8, 5, {"all_to_all": 11}),  # as 0: the last unit always
    ],
)
def test_collective_count_and_order(world2, config, gathers, reduces, issued):
    results = world2.run(collectives_and_labels, config=config)
    for rank, r in enumerate(results):
        steady = r["calls"][1:]
        for calls in steady:
            assert {kind: calls.count(kind) for kind in set(calls)} == issued, (rank, calls)
        assert steady[0] == steady[1], "the collective sequence changed between steps"
        stats = r["stats"]
        assert (stats.num_allgathers, stats.num_reduce_scatters) == (gathers, reduces)
        phases = {label.split(" ")[0] for label in r["labels"]}
        assert {
            "overlap::gather",
            "overlap::wait_gather",
            "overlap::free",
            "overlap::reduce",
            "overlap::wait_reduce",
        } <= phases, phases
    assert results[0]["calls"] == results[1]["calls"]


def memory_and_eval(rank: int, world: int) -> dict:
    model = overlap.wrap(tiny_lm(), reshard_after_forward=False)
    state = model._overlap_state
    with torch.no_grad():
        model(batch(model, rank, 0))
    held = [u.unsharded_flat.untyped_storage().nbytes() for u in state.units]
    assert held == [0] * len(held), f"eval forward leaked unsharded buffers: {held}"
    assert all(isinstance(p, DTensor) for p in model.parameters())
    # a unit freed after forward holds no bytes while others compute
    model2 = overlap.wrap(tiny_lm())
    seen = []
    model2.blocks[2].register_forward_pre_hook(
        lambda m, a: seen.append([u.unsharded_flat.untyped_storage().nbytes() for u in model2._overlap_state.units])
    )
    loss_of(model2(batch(model2, rank, 0))).backward()
    # units: 0 root, 1..4 blocks; while block 2 (unit 3) starts, block 0 (unit 1) was freed
    assert seen[0][1] == 0 and seen[0][3] > 0, seen
    local = sum(p.to_local().numel() for p in model2.parameters())
    full = sum(p.numel() for p in tiny_lm().parameters())
    assert local <= full // world + 64, (local, full)
    return {}


def test_memory_is_released(world2):
    world2.run(memory_and_eval)


def no_sync_matches_ddp(rank: int, world: int) -> dict:
    base = tiny_lm()
    ref = DDP(copy.deepcopy(base))
    ours = overlap.wrap(base)
    with counting_reductions() as calls:
        for micro in range(3):
            x = batch(base, rank, micro)
            if micro < 2:
                with ref.no_sync():
                    loss_of(ref(x)).backward()
                with overlap.no_sync(ours):
                    loss_of(ours(x)).backward()
                assert not calls, "no_sync issued a reduce-scatter"
            else:
                loss_of(ref(x)).backward()
                loss_of(ours(x)).backward()
                assert calls, "the synced micro-batch reduced nothing: the counter sees no reduction"
    named = dict(ref.module.named_parameters())
    for name, p in ours.named_parameters():
        local = p.grad.to_local()
        rows = -(-p.shape[0] // world)
        torch.testing.assert_close(
            local, named[name].grad[rank * rows : rank * rows + local.shape[0]], rtol=1e-6, atol=1e-7
        )
    return {}


def test_no_sync_accumulates_like_ddp(world2):
    world2.run(no_sync_matches_ddp)


class RankDependent(nn.Module):
    """Runs its blocks in a rank-dependent order: the collectives would pair wrong units."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Block(8, 8) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        order = [0, 1, 2] if dist.get_rank() == 0 else [0, 2, 1]
        for i in order:
            x = self.blocks[i](x)
        return x


def order_mismatch(rank: int, world: int) -> str:
    model = overlap.wrap(RankDependent())
    return error_of(model, torch.randn(2, 8))


def test_order_mismatch_raises_on_every_rank(world2):
    messages = world2.run(order_mismatch)
    assert all("order of units differs across ranks" in m for m in messages), messages


def model_mismatch(rank: int, world: int) -> str:
    return error_of(overlap.wrap, tiny_lm(hidden=30 if rank == 0 else 31))


def test_model_mismatch_raises_on_every_rank(world2):
    messages = world2.run(model_mismatch, timeout_s=180)
    assert all("differs across ranks" in m for m in messages), messages


class Scalar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.0))


class IntParam(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.arange(6).view(2, 3), requires_grad=False)


def bad_inputs(rank: int, world: int) -> dict:
    errors = {}
    model = overlap.wrap(tiny_lm())
    for name, fn in {
        "twice": lambda: overlap.wrap(model),
        "scalar": lambda: overlap.wrap(Scalar()),
        "not a module": lambda: overlap.wrap(lambda x: x),
        "unknown field": lambda: overlap.wrap(tiny_lm(), prefetch_dpth=2),
        "bad depth": lambda: overlap.wrap(tiny_lm(), prefetch_depth=-1),
        "codec": lambda: overlap.wrap(tiny_lm(), grad_compression="int2"),
        "int param": lambda: overlap.wrap(IntParam()),
    }.items():
        try:
            fn()
            errors[name] = None
        except (ValueError, TypeError) as e:
            errors[name] = f"{type(e).__name__}: {e}"
    return errors


def test_bad_inputs_raise_clear_errors(world2):
    for rank, errors in enumerate(world2.run(bad_inputs)):
        assert all(errors.values()), (rank, errors)
        assert "already wrapped" in errors["twice"]
        assert "'scale'" in errors["scalar"]
        assert "prefetch_dpth" in errors["unknown field"]
        assert "'table'" in errors["int param"]


def test_config_roundtrip(tmp_path):
    config = overlap.OverlapConfig(prefetch_depth=3, param_dtype="bfloat16")
    assert config.param_dtype is torch.bfloat16
    config.save(tmp_path / "c.json")
    assert overlap.OverlapConfig.load(tmp_path / "c.json") == config
    with pytest.raises(ValueError, match="reduce_scatter_bucket_bytes"):
        overlap.OverlapConfig(reduce_scatter_bucket_bytes=-1)


def dead_peer_times_out(rank: int, world: int) -> tuple[str, float]:
    """Rank 1 stops taking part after wrap; rank 0's first gather wait must raise, not hang.
    Rank 1 stays away until rank 0 is done (at most STUCK_S), so the bound below holds on a
    loaded machine: a wait ended by the 2 s timeout, not by rank 1 coming back."""
    import time
    from datetime import timedelta

    store = dist.distributed_c10d._get_default_store()
    model = overlap.wrap(tiny_lm(), collective_timeout_s=2.0)
    if rank == 1:
        store.wait(["dead_peer_done"], timedelta(seconds=STUCK_S))  # a stuck rank
        return "stuck", 0.0
    t0 = time.monotonic()
    try:
        model(batch(model, rank, 0))
        what = "no error"
    except Exception as e:  # gloo raises RuntimeError on timeout
        what = f"raised {type(e).__name__}: {e}"
    seconds = time.monotonic() - t0
    store.set("dead_peer_done", "1")
    return what, seconds


STUCK_S = 90


def test_stuck_peer_raises_within_the_collective_timeout(world2):
    (what, seconds), (rank1, _) = world2.run(dead_peer_times_out, timeout_s=180)
    # at least the timeout; far less than rank 1's absence (load may add seconds, not a minute)
    assert what.startswith("raised") and 1.5 < seconds < STUCK_S / 3, (what, seconds)
    assert rank1 == "stuck"
