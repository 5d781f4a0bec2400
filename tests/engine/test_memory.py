"""Memory accounting (`overlap.memory_stats`) and the bounds it must show.

The ideal ZeRO-3 state of a rank is its parameter and gradient shards. On top of it the library
may hold: the prefetch budget of unsharded units (plus the root unit, gathered for the whole step,
and the unit whose gradients are being produced), at most K reduce-scatter inputs
([Note: reduce buffers]), the reduced shards until the end of backward (1/N of the model, they
become the gradient shards), and the buffers of the gathers in flight (`Runtime.gather_nbytes`:
through all-to-all on gloo, send copies and a receive buffer with slack). The accounted peak must stay inside
that, step after step, for several configs.
"""

from __future__ import annotations

import pytest
import torch
from helpers.models import STRICT_ZERO3, batch, encoder_stack, loss_of


def _train(rank: int, world: int, config: dict, steps: int = 3) -> dict:
    import overlap
    from overlap.engine.state import state_of

    torch.manual_seed(0)
    model = overlap.wrap(encoder_stack(layers=6, dim=32), **config)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    peaks = []
    for step in range(steps):
        loss_of(model(batch(model, rank, step))).backward()
        opt.step()
        opt.zero_grad()
        peaks.append(overlap.memory_stats(model))
    state = state_of(model)
    runtime = state.runtime
    units = [u.unsharded_nbytes for u in state.units]
    root = state.root_unit
    body = [b for i, b in enumerate(units) if i != root]
    stats = peaks[-1]
    schedule = state.schedule
    kept = schedule.kept_units()  # [Note: units kept for backward]: beyond the last unit
    kept_extra = sum(units[u] for u in kept) - (units[schedule.forward_order[-1]] if kept else 0)
    return {
        "kept_extra": kept_extra,
        "num_kept": len(kept),
        "peak_total": max(p.peak_total_bytes for p in peaks[1:]),
        "peak": stats.peak,
        "now": stats.bytes,
        "unit_max": max(body),
        "root": units[root] if root is not None else 0,
        "shards": sum(u.shard.numel() * u.shard.element_size() for u in state.units),
        "bucket_input_max": _bucket_input_max(state, config),
        "gather_max": max(runtime.gather_nbytes(i) for i in range(len(state.units))),
        "reduce_inputs_gone": runtime.memory.bytes["reduce_inputs"] == 0,
    }


def _bucket_input_max(state, config: dict) -> int:
    """The largest reduce-scatter input one bucket can allocate (gradients of its units, rank-major,
    plus the all-to-all receive buffer of the same size on gloo, with its slack for each peer:
    [Note: receive slack] in transport/collectives.py)."""
    bucket_bytes = config.get("reduce_scatter_bucket_bytes", 0)
    grads = [u.layout.grad_shard_numel * u.layout.world_size * 4 for u in state.units]
    largest = max(grads) if bucket_bytes == 0 else min(sum(grads), bucket_bytes + max(grads))
    slack = (state.runtime.world_size - 1) * state.runtime.receive_floor_bytes
    return 2 * (largest + 4096) + slack  # input + receive buffer; the used-flag columns are a few bytes


CONFIGS = {
    "default": {},
    "strict_zero3": STRICT_ZERO3,
    "keep_three": {"keep_for_backward_bytes": 3 * 35_200},  # units of 35,200 bytes (padded)
    "prefetch2": {"prefetch_depth": 2, **STRICT_ZERO3},
    "bucketed": {"reduce_scatter_bucket_bytes": 40_000},
    "two_inputs": {"max_reduce_inputs": 2},
    "int8_ef": {"grad_compression": "int8", "error_feedback": True},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_accounted_peak_within_budget(world2, name):
    config = CONFIGS[name]
    for r in world2.run(_train, config=config, timeout_s=240):
        depth = config.get("prefetch_depth", 1)
        k = config.get("max_reduce_inputs", 1)
        ideal = 2 * r["shards"]  # parameter shards + gradient shards
        # prefetch budget, root kept all step, units kept from forward to backward
        budget = (depth + 1) * r["unit_max"] + r["root"] + r["kept_extra"]
        if config.get("keep_for_backward_bytes") == 0:
            assert r["kept_extra"] == 0 and r["num_kept"] == 1, r
        if name == "keep_three":
            assert r["num_kept"] == 3, r
        # gathers in flight: the prefetched ones and, in backward, the next unit's
        gathers = (depth + 1) * r["gather_max"]
        bound = ideal + budget + k * r["bucket_input_max"] + gathers + r["peak"]["residuals"]
        assert r["peak_total"] <= bound, (name, r)
        assert r["peak"]["gather_buffers"] <= gathers, (name, r)
        assert r["peak"]["reduce_inputs"] <= k * r["bucket_input_max"], (name, r)
        assert r["peak"]["unsharded"] <= budget + r["unit_max"], (name, r)
        assert r["reduce_inputs_gone"] and r["now"]["unsharded"] == 0 and r["now"]["gather_buffers"] == 0, r
        assert r["now"]["sharded_params"] == r["shards"]


def test_reduce_inputs_bounded_by_k(world2):
    """The bound is real: allowing every bucket's input to live (K = number of units) holds
    several times more reduce-scatter input at once than K = 1."""
    one = world2.run(_train, config={}, timeout_s=240)[0]
    many = world2.run(_train, config={"max_reduce_inputs": 64}, timeout_s=240)[0]
    assert many["peak"]["reduce_inputs"] >= 3 * one["peak"]["reduce_inputs"], (one["peak"], many["peak"])


def test_memory_stats_table_and_reset(world2):
    results = world2.run(_table, timeout_s=120)
    for table, after_reset, before in results:
        assert "reduce_inputs" in table and "total" in table
        assert after_reset <= before


def _table(rank: int, world: int) -> tuple[str, int, int]:
    import overlap

    model = overlap.wrap(encoder_stack())
    loss_of(model(batch(model, rank, 0))).backward()
    stats = overlap.memory_stats(model, reset_peak=True)
    after = overlap.memory_stats(model)
    return stats.table(), after.peak_total_bytes, stats.peak_total_bytes
