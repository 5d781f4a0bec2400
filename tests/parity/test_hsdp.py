"""Hybrid sharding (HSDP): a 2-D mesh (replicate x shard) trains as DDP over every rank.

World size 4 as 2 replicas x 2 shards on gloo: all-gathers and reduce-scatters run inside each
shard pair, reduced shards are all-reduced across the replica pair. The sums run in another order
than DDP's four-way all-reduce, so results agree to rounding (SGD, as in test_parity's world-4
tests: Adam would amplify rounding of near-zero gradients).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from helpers.models import STRICT_ZERO3, backward_both, batch, loss_of, step_both, tiny_lm
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.nn.parallel import DistributedDataParallel as DDP

import overlap

TOL = 1e-6


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return (a.float() - b.float()).abs().max().item() / max(a.abs().max().item(), 1e-12)


def _rows(full: torch.Tensor, local: torch.Tensor, shard_rank: int, num_shards: int) -> torch.Tensor:
    rows = -(-full.shape[0] // num_shards)
    return full[shard_rank * rows : shard_rank * rows + local.shape[0]]


def _steps_vs_ddp(
    rank: int, base, ours, steps: int, shard_rank: int, num_shards: int, check_param, on_step=None
) -> dict:
    """Train `ours` and DDP on the same batches with SGD; the worst relative differences of
    loss, gradient shards and parameter shards over all steps. `check_param(name, p)` asserts
    each sharded parameter's layout; `on_step()` runs before each step."""
    ref = DDP(copy.deepcopy(base))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    opt = torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9)
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    named_ref = dict(ref.module.named_parameters())
    for step in range(steps):
        if on_step is not None:
            on_step()
        x = batch(base, rank, step)
        ref_loss, loss = backward_both(ref, ours, x)
        worst["loss"] = max(worst["loss"], _rel(ref_loss.detach(), loss.detach()))
        for name, p in ours.named_parameters():
            check_param(name, p)
            g = p.grad.to_local()
            worst["grad"] = max(worst["grad"], _rel(_rows(named_ref[name].grad, g, shard_rank, num_shards), g))
        step_both(ref_opt, opt)
        for name, p in ours.named_parameters():
            local = p.detach().to_local()
            worst["param"] = max(
                worst["param"], _rel(_rows(named_ref[name].detach(), local, shard_rank, num_shards), local)
            )
    return {**worst, "ref": ref}


def hsdp_vs_ddp(rank: int, world: int, config: dict, steps: int = 3) -> dict:
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    shard_rank = mesh.get_local_rank(1)
    base = tiny_lm()
    ours = overlap.wrap(copy.deepcopy(base), group=mesh, **config)

    def check_param(name: str, p: torch.Tensor) -> None:
        assert isinstance(p, DTensor) and p.placements == (Replicate(), Shard(0)), (name, p.placements)
        assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements, name

    worst = _steps_vs_ddp(rank, base, ours, steps, shard_rank, 2, check_param)
    ref = worst.pop("ref")
    full = overlap.full_state_dict(ours, rank0_only=False)
    plain = ref.module.state_dict()
    worst["full_state"] = max(_rel(plain[k], v) for k, v in full.items())
    stats = overlap.step_stats(ours)
    return {**worst, "counts": (stats.num_reduce_scatters, stats.num_allreduces)}


@pytest.mark.parametrize(
    "config",
    [
        pytest.param({}, id="default"),
        pytest.param({"prefetch_depth": 2, "reduce_scatter_bucket_bytes": 6000}, id="bucketed"),
        pytest.param({"reshard_after_forward": False}, id="zero2"),
        pytest.param({"reduce_scatter_impl": "native"}, id="native-reduce-scatter"),
    ],
)
def test_hsdp_2x2_matches_ddp(world4, config):
    results = world4.run(hsdp_vs_ddp, config=config)
    for rank, r in enumerate(results):
        assert all(r[k] <= TOL for k in ("loss", "grad", "param", "full_state")), (rank, r)
        num_reduce_scatters, num_allreduces = r["counts"]
        assert num_allreduces == num_reduce_scatters > 0, (rank, r)  # one all-reduce per bucket


def hsdp_int8_grads(rank: int, world: int) -> float:
    """int8 gradients inside the shard group, exact all-reduce across replicas: close to DDP."""
    mesh = init_device_mesh("cpu", (2, world // 2))
    base = tiny_lm()
    ref = DDP(copy.deepcopy(base))
    ours = overlap.wrap(base, group=mesh, grad_compression="int8", error_feedback=True)
    x = batch(base, rank, 0)
    loss_of(ref(x)).backward()
    loss_of(ours(x)).backward()
    shard_rank = mesh.get_local_rank(1)
    named_ref = dict(ref.module.named_parameters())
    worst = 0.0
    for name, p in ours.named_parameters():
        g = p.grad.to_local()
        worst = max(worst, _rel(_rows(named_ref[name].grad, g, shard_rank, 2), g))
    return worst


def test_hsdp_with_compressed_gradients(world4):
    results = world4.run(hsdp_int8_grads)
    assert all(0 < r < 0.05 for r in results), results


def replicas_agree(rank: int, world: int) -> bool:
    """After training, both replicas of each shard hold the same bytes (the all-reduce ran)."""
    mesh = init_device_mesh("cpu", (2, world // 2))
    base = tiny_lm()
    ours = overlap.wrap(base, group=mesh, prefetch_depth=2)
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    for step in range(2):
        loss_of(ours(batch(base, rank, step))).backward()  # different data on every rank
        opt.step()
        opt.zero_grad()
    flat = torch.cat([p.detach().to_local().reshape(-1) for p in ours.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(gathered, flat, group=mesh.get_group(0))
    return bool(torch.equal(gathered[0], gathered[1]))


def test_replicas_stay_identical(world4):
    assert all(world4.run(replicas_agree))


def bad_mesh(rank: int, world: int) -> str:
    mesh = init_device_mesh("cpu", (1, 2, 2))
    try:
        overlap.wrap(tiny_lm(), group=mesh)
    except ValueError as e:
        return str(e)
    return ""


def test_three_dim_mesh_is_refused(world4):
    for message in world4.run(bad_mesh):
        assert "2-D mesh (replicate, shard)" in message


def hpz_vs_ddp(rank: int, world: int, config: dict, steps: int = 3) -> dict:
    """hybrid_mode="secondary": sharded over all 4 ranks; backward gathers inside each pair."""
    from overlap.transport import coded
    from overlap.transport import collectives as comm

    mesh = init_device_mesh("cpu", (2, world // 2))
    base = tiny_lm()
    ours = overlap.wrap(copy.deepcopy(base), group=mesh, hybrid_mode="secondary", **config)
    sizes: list[int] = []  # group size of every all-gather of the last step
    # every all-gather, native or through all-to-all, compressed or not, secondary ones too
    owners = {"all_gather_flat": comm, "all_gather_encoded": coded}
    originals = {name: getattr(module, name) for name, module in owners.items()}

    def counting(name):
        def gather(*args, **kwargs):
            group = args[1] if name == "all_gather_flat" else args[2]
            sizes.append(dist.get_world_size(group))
            return originals[name](*args, **kwargs)

        return gather

    def check_param(name: str, p: torch.Tensor) -> None:
        assert p.placements == (Shard(0),) and p.device_mesh.size() == world, name

    for name, module in owners.items():
        setattr(module, name, counting(name))
    try:
        worst = _steps_vs_ddp(rank, base, ours, steps, rank, world, check_param, on_step=sizes.clear)
    finally:
        for name, fn in originals.items():
            setattr(owners[name], name, fn)
    del worst["ref"]
    secondary_peak = overlap.memory_stats(ours).peak["secondary"]  # of the last step
    held = [u.secondary is not None for u in ours._overlap_state.units]
    with torch.no_grad():
        ours(batch(base, rank, 0))  # a no_grad forward keeps no secondary copy
    held_after_eval = [u.secondary is not None for u in ours._overlap_state.units]
    return {**worst, "sizes": sizes, "held": held, "held_after_eval": held_after_eval, "secondary_peak": secondary_peak}


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(STRICT_ZERO3, id="strict-zero3"),
        pytest.param({"prefetch_depth": 2, "reduce_scatter_bucket_bytes": 6000, **STRICT_ZERO3}, id="bucketed"),
        pytest.param({"param_compression": "bf16", **STRICT_ZERO3}, id="bf16-weights"),
        pytest.param({}, id="default"),  # every block kept for backward: no backward gather
    ],
)
def test_hpz_secondary_copy_matches_ddp(world4, config):
    results = world4.run(hpz_vs_ddp, config=config)
    for rank, r in enumerate(results):
        tol = 5e-2 if "param_compression" in config else TOL  # bf16 weights vs fp32 DDP
        assert all(r[k] <= tol for k in ("loss", "grad", "param")), (rank, r)
        sizes = [s for s in r["sizes"] if s > 1]
        if config.get("keep_for_backward_bytes") == 0:
            # the order check of the first step is over; forward gathers span all 4 ranks, the
            # backward ones (every unit but the last of forward, which stays gathered) span 2
            assert sizes.count(4) >= 3 and sizes.count(2) >= 2, (rank, sizes)
            assert r["secondary_peak"] > 0, r
        else:  # kept units are neither gathered for backward nor copied for it
            assert sizes.count(4) >= 3 and sizes.count(2) == 0, (rank, sizes)
            assert r["secondary_peak"] == 0, r
        assert not any(r["held"]) and not any(r["held_after_eval"]), (rank, r)


def hpz_backward_reads_the_secondary(rank: int, world: int) -> bool:
    """Corrupting the primary shards after forward must not change the gradients: backward
    gathers come from the secondary copies taken in forward."""
    mesh = init_device_mesh("cpu", (2, world // 2))
    base = tiny_lm()
    clean = overlap.wrap(copy.deepcopy(base), group=mesh, hybrid_mode="secondary")
    poked = overlap.wrap(copy.deepcopy(base), group=mesh, hybrid_mode="secondary")
    x = batch(base, rank, 0)
    loss_of(clean(x)).backward()
    out = loss_of(poked(x))
    with torch.no_grad():
        for unit in poked._overlap_state.units:
            unit.shard.add_(1.0)
    out.backward()
    return all(
        torch.equal(a.grad.to_local(), b.grad.to_local()) for a, b in zip(clean.parameters(), poked.parameters())
    )


def test_hpz_backward_gathers_from_the_secondary_copy(world4):
    assert all(world4.run(hpz_backward_reads_the_secondary))


def hsdp_issue_order(rank: int, world: int) -> list[str]:
    """The collectives of one HSDP backward, in issue order (rs = reduce-scatter, ar = all-reduce)."""
    from overlap.transport import collectives as comm

    mesh = init_device_mesh("cpu", (2, world // 2))
    base = tiny_lm()
    ours = overlap.wrap(base, group=mesh)
    loss_of(ours(batch(base, rank, 0))).backward()  # first step: order checks
    events: list[str] = []
    # a reduction is a reduce-scatter, or one carrying a gather ([Note: fused exchange])
    logged = {"reduce_scatter_flat": "rs", "reduce_scatter_and_gather": "rs", "all_reduce_flat": "ar"}
    originals = {name: getattr(comm, name) for name in logged}
    for name, fn in originals.items():
        setattr(comm, name, lambda *a, _fn=fn, _what=logged[name], **k: (events.append(_what), _fn(*a, **k))[1])
    try:
        loss_of(ours(batch(base, rank, 1))).backward()
    finally:
        for name, fn in originals.items():
            setattr(comm, name, fn)
    return events


def test_hsdp_all_reduces_overlap_backward(world4):
    """Each bucket's all-reduce goes out while backward still runs, not all at the end: when
    the next bucket releases the previous one's reduce-scatter input ([Note: reduce buffers],
    one input alive by default), its reduced shard goes on to the replicas: rs ar rs ar ... rs ar."""
    for events in world4.run(hsdp_issue_order):
        n = events.count("rs")
        assert n >= 3 and events.count("ar") == n, events
        assert events == ["rs", "ar"] * n, events


def hsdp_checkpoint_reshards(rank: int, world: int, root: str) -> dict:
    """Saved under HSDP 2x2, loaded by plain sharding over 4 ranks and by hpZ: same model,
    same optimizer state, same next loss."""
    mesh = init_device_mesh("cpu", (2, world // 2))
    base = tiny_lm()
    hsdp = overlap.wrap(copy.deepcopy(base), group=mesh)
    opt = torch.optim.AdamW(hsdp.parameters(), lr=1e-2)
    for step in range(2):
        loss_of(hsdp(batch(base, rank, step))).backward()
        opt.step()
        opt.zero_grad()
    path = overlap.checkpoint.save(root, hsdp, opt, step=2)
    expected = overlap.full_state_dict(hsdp, rank0_only=False)
    next_loss = loss_of(hsdp(batch(base, rank, 2))).item()
    out = {}
    for name, kwargs in (("flat", {}), ("hpz", {"group": mesh, "hybrid_mode": "secondary"})):
        other = overlap.wrap(copy.deepcopy(base), **kwargs)
        other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
        overlap.checkpoint.load(path, other, other_opt)
        got = overlap.full_state_dict(other, rank0_only=False)
        out[name] = (
            all(torch.equal(expected[k], got[k]) for k in expected),
            loss_of(other(batch(base, rank, 2))).item() == next_loss,
            sum(len(s) for s in other_opt.state.values()) > 0,
        )
    return out


def test_hsdp_checkpoint_loads_under_other_layouts(world4, tmp_path):
    for rank, r in enumerate(world4.run(hsdp_checkpoint_reshards, root=str(tmp_path))):
        assert r["flat"] == (True, True, True) and r["hpz"] == (True, True, True), (rank, r)
