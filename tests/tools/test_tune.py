"""`overlap tune`: successive-halving arithmetic, pruning, the cache key, and on 2 gloo ranks: one
decision on every rank under skewed timings, cache hits that measure nothing, parity of the tuned
config with DDP, the JSON that OverlapConfig.load reads."""

from __future__ import annotations

import copy
import dataclasses
import json
import random
import time

import pytest
import torch
import torch.distributed as dist
from helpers.models import batch, loss_of, tiny_lm
from torch.nn.parallel import DistributedDataParallel as DDP

import overlap
from overlap import OverlapConfig
from overlap.tools.tune import Codec, TuneConfig, TuneResult, TuneSpace, halving_schedule, score, survivors, tune
from overlap.tools.tune.cache import TuneKey, model_signature
from overlap.tools.tune.halving import HalvingRound, first_round_steps_for, schedule_steps
from overlap.tools.tune.predict import PlannedCandidate, num_to_keep, prune

# A small space over tiny_lm (4 blocks of 1,572 elements): 2 granularities x 2 depths x 2 buckets.
SPACE = TuneSpace(min_unit_numel=(0, 3000), prefetch_depth=(1, 2), reduce_scatter_bucket_bytes=(0, 12_000))
FAST = {"cache": "off", "progress": False, "profile_steps": 1, "warmup_steps": 1}


# ----------------------------------------------------------------------- pure: halving, pruning


def test_halving_schedule_by_hand():
    assert halving_schedule(8, 1) == (HalvingRound(8, 1, 4), HalvingRound(4, 2, 2), HalvingRound(2, 4, 1))
    # ceil(5/2) = 3 survive, then ceil(3/2) = 2: the last round always compares two
    assert halving_schedule(5, 2) == (HalvingRound(5, 2, 3), HalvingRound(3, 4, 2), HalvingRound(2, 8, 1))
    assert halving_schedule(2, 3) == (HalvingRound(2, 3, 1),)
    assert halving_schedule(1, 5) == ()  # nothing to decide
    assert schedule_steps(halving_schedule(8, 1)) == 8 + 8 + 8
    assert schedule_steps(halving_schedule(5, 2)) == 10 + 12 + 16
    # budget: 8 candidates cost 24 steps per first-round step
    assert first_round_steps_for(8, 50) == 2
    assert first_round_steps_for(8, 10) == 1  # at least one step
    assert first_round_steps_for(1, 10) == 1
    for bad in [(0, 1), (3, 0)]:
        with pytest.raises(ValueError):
            halving_schedule(*bad)


def test_score_and_survivors_by_hand():
    # 2 ranks x 3 steps: slowest rank per step = [2, 5, 4], median 4
    assert score([[1.0, 5.0, 3.0], [2.0, 1.0, 4.0]]) == 4.0
    assert score([[7.0]]) == 7.0
    assert survivors([3.0, 1.0, 2.0, 1.0], 2) == [1, 3]  # tie -> earlier position first
    assert survivors([3.0, 1.0, 2.0], 3) == [1, 2, 0]
    with pytest.raises(ValueError):
        score([[1.0, 2.0], [1.0]])
    with pytest.raises(ValueError):
        survivors([1.0], 2)


def test_space_grid_codecs_and_validation():
    assert SPACE.size == 8 == len(SPACE.candidates(OverlapConfig()))
    first, last = SPACE.candidates(OverlapConfig())[0], SPACE.candidates(OverlapConfig())[-1]
    assert (first.min_unit_numel, first.prefetch_depth, first.reduce_scatter_bucket_bytes) == (0, 1, 0)
    assert (last.min_unit_numel, last.prefetch_depth, last.reduce_scatter_bucket_bytes) == (3000, 2, 12_000)
    assert Codec.parse("none") == Codec(None, None, False)
    assert Codec.parse("int8+ef") == Codec("int8", "int8", True)
    assert Codec.parse("fp8/int4+ef") == Codec("fp8", "int4", True)
    assert Codec.parse("none/bf16") == Codec(None, "bf16", False)
    assert str(Codec.parse("fp8/int4+ef")) == "fp8/int4+ef"
    for bad in ["int4", "fp8", "none+ef", "int8+x"]:  # int4 weights, fp8 grads, EF without codec
        with pytest.raises(ValueError):
            Codec.parse(bad)
    with pytest.raises(ValueError):
        TuneSpace(prefetch_depth=())
    with pytest.raises(ValueError):
        TuneSpace(prefetch_depth=(1, 1))
    with pytest.raises(ValueError):
        TuneSpace(prefetch_depth=(-1,))  # OverlapConfig names it
    lossy = TuneSpace(codecs=("none", "int8+ef"))
    assert not lossy.lossless and TuneSpace.from_dict(lossy.to_dict()) == lossy
    with pytest.raises(ValueError, match="allow_compression"):
        TuneConfig(space=lossy)
    TuneConfig(space=lossy, allow_compression=True)
    with pytest.raises(ValueError):
        TuneConfig(keep_fraction=0.0)
    with pytest.raises(TypeError):
        TuneConfig().replace(keep_fraction_typo=0.5)


def _planned(index: int, step_s: float, sig: object = None, peak: int = 0) -> PlannedCandidate:
    return PlannedCandidate(index, step_s, peak, index if sig is None else sig)


def test_prune_keeps_fastest_distinct_each_codec_and_the_base():
    planned = [_planned(3, 1.0), _planned(1, 1.0, sig=3), _planned(0, 2.0), _planned(2, 3.0), _planned(4, 4.0)]
    codec = {0: "none", 1: "none", 2: "int8", 3: "none", 4: "none"}
    feats = {i: (i,) for i in range(5)}
    args = {"stratum": codec.__getitem__, "features": feats.__getitem__}
    # 1 is a twin of 3 (same schedule signature): dropped; 2 is the best int8: kept; 4: the base
    assert prune(planned, 2, must_keep=4, **args) == [3, 0, 2, 4]
    assert prune(planned, 2, must_keep=1, **args) == [3, 0, 2]  # its twin stands in for it
    capped = [_planned(0, 1.0, peak=10), _planned(1, 2.0, peak=5)]
    one = {"stratum": lambda i: "none", "features": lambda i: (i,)}
    assert prune(capped, 1, max_unsharded_bytes=6, **one) == [1]
    with pytest.raises(ValueError):
        prune(capped, 1, max_unsharded_bytes=1, **one)
    assert num_to_keep(27, 0.25, 8) == 7 and num_to_keep(27, 1.0, 8) == 8 and num_to_keep(3, 0.1, None) == 2


def test_prune_spreads_picks_over_tied_predictions():
    # four candidates predicted alike (within the tie tolerance), features (depth, bucket):
    # after the first (fastest), the one differing in both fields comes next, not the neighbour
    feats = {0: (1, 0), 1: (1, 9), 2: (2, 0), 3: (2, 9), 4: (4, 0)}
    planned = [_planned(0, 1.000), _planned(1, 1.001), _planned(2, 1.002), _planned(3, 1.003), _planned(4, 2.0)]
    kept = prune(planned, 2, stratum=lambda i: "none", features=feats.__getitem__)
    assert kept == [0, 3]
    # a clearly faster candidate wins over spread
    planned = [_planned(0, 1.0), _planned(1, 1.001), _planned(3, 1.5)]
    assert prune(planned, 2, stratum=lambda i: "none", features=feats.__getitem__) == [0, 1]


def test_key_changes_with_every_field():
    a, b = tiny_lm(), tiny_lm(dim=26)
    assert model_signature(a) == model_signature(tiny_lm(seed=1))  # values are not the signature
    assert model_signature(a) != model_signature(b)
    fields = {
        "model": model_signature(a), "world_size": 2, "backend": "gloo", "device": "cpu",
        "dtypes": ("torch.float32",), "link": None, "space": SPACE.to_dict(),
        "base": {"prefetch_depth": 1}, "extra": {"batch": 4},
    }  # fmt: skip
    digest = TuneKey(**fields).digest
    assert TuneKey(**fields).digest == digest
    for name, value in [
        ("model", model_signature(b)), ("world_size", 4), ("backend", "nccl"), ("dtypes", ("torch.bfloat16",)),
        ("link", "1gbit"), ("space", TuneSpace().to_dict()), ("base", {"prefetch_depth": 2}), ("extra", {"batch": 8}),
    ]:  # fmt: skip
        assert TuneKey(**{**fields, name: value}).digest != digest, name


# ----------------------------------------------------------------------- on 2 ranks


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    loss_of(model(x)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05)


def skewed_decision(rank: int, world: int, real: bool) -> dict:
    """Fake timings: rank 0 alone would choose the first candidate, rank 1 alone the last. Or (real)
    measured trials with random sleeps, different on each rank, inside every step."""
    grid = SPACE.candidates(OverlapConfig())
    x = batch(tiny_lm(), rank, 0)
    alone: dict[int, list[float]] = {}

    def fake_trial(config: OverlapConfig, num_steps: int) -> list[float]:
        i = grid.index(config)
        if rank == 0:
            t = 1.0 + 0.1 * i
        else:
            t = 1.0 + 0.1 * (len(grid) - 1 - i) + 0.05
        alone.setdefault(i, []).append(t)
        return [t] * num_steps

    rng = random.Random(100 + rank)

    def delayed_step(model, opt) -> None:
        time.sleep(rng.uniform(0, 0.01))
        _step(model, opt, x)

    # real trials: 3 candidates (rounds of 3 x 1 and 2 x 2 steps) keep the test short
    space = TuneSpace(prefetch_depth=(0, 1, 2)) if real else SPACE
    result = tune(
        tiny_lm, delayed_step if real else lambda m, o: _step(m, o, x),
        config=TuneConfig(space=space, keep_fraction=1.0, max_candidates=None, **FAST),
        optimizer_fn=_sgd, trial=None if real else fake_trial,
    )  # fmt: skip
    own_pick = min(alone, key=lambda i: alone[i][-1]) if alone else None
    return {
        "winner": result.winner,
        "rounds": [(r.candidates, r.survivors, r.step_ms) for r in result.rounds],
        "own_pick": own_pick,
    }


def test_decision_identical_on_all_ranks_under_skewed_timings(world2):
    r0, r1 = world2.run(skewed_decision, real=False)
    measured = sorted(r0["rounds"][0][0])
    # the ranks alone would disagree: rank 0 on the first candidate, rank 1 on the last ...
    assert r0["own_pick"] == measured[0] and r1["own_pick"] == measured[-1]
    # ... but both act on rank 0's decision
    assert r0["winner"] == r1["winner"] and r0["rounds"] == r1["rounds"]
    # rank 0's rule on everyone's timings: the slowest rank's time of candidate i is
    # max(1 + 0.1 i, 1.75 - 0.1 i): 1.45 at i = 3, 1.4 at i = 4, 1.5 at i = 5: candidate 4 wins
    assert 4 in measured and r0["winner"] == 4
    assert r0["rounds"][0][2][r0["rounds"][0][0].index(4)] == pytest.approx(1400.0)
    real = world2.run(skewed_decision, real=True)
    assert real[0]["winner"] == real[1]["winner"] and real[0]["rounds"] == real[1]["rounds"]
    assert [len(r[0]) for r in real[0]["rounds"]] == [3, 2]


def cached_tunes(rank: int, world: int, cache_dir: str) -> dict:
    x = batch(tiny_lm(), rank, 0)
    steps = {"n": 0}

    def counted_step(model, opt) -> None:
        steps["n"] += 1
        _step(model, opt, x)

    def run(space: TuneSpace, **kw) -> tuple[TuneResult, int]:
        steps["n"] = 0
        opts = {**FAST, "cache": "use", "cache_dir": cache_dir, **kw}
        result = tune(tiny_lm, counted_step, config=TuneConfig(space=space, **opts), optimizer_fn=_sgd)
        return result, steps["n"]

    small = TuneSpace(prefetch_depth=(1, 2))
    first, n_first = run(small)
    again, n_again = run(small)
    other_space, n_space = run(TuneSpace(prefetch_depth=(1, 3)))
    other_extra, n_extra = run(small, key_extra={"batch": 8})
    refreshed, n_refresh = run(small, cache="refresh")
    return {
        "first": (first.cached, n_first, first.key),
        "again": (again.cached, n_again, again.key, again.config == first.config, again.winner == first.winner),
        "space": (other_space.cached, n_space, other_space.key),
        "extra": (other_extra.cached, n_extra, other_extra.key),
        "refresh": (refreshed.cached, n_refresh),
    }


def test_cache_hit_skips_measuring_and_a_key_change_retunes(world2, tmp_path):
    for r in world2.run(cached_tunes, cache_dir=str(tmp_path)):
        cached, n, key = r["first"]
        assert not cached and n > 0
        assert r["again"][:2] == (True, 0) and r["again"][2] == key and all(r["again"][3:])
        for what in ("space", "extra"):
            assert not r[what][0] and r[what][1] > 0 and r[what][2] != key, what
        assert r["refresh"][0] is False and r["refresh"][1] > 0
    assert len(list(tmp_path.glob("*.json"))) == 3


def errors_on_all_ranks(rank: int, world: int) -> list[str]:
    """A bad option on one rank, and a decision rank 0 cannot make: every rank raises."""
    x = batch(tiny_lm(), rank, 0)
    messages = []
    for opts in ({"key_extra": {"rank": rank}}, {"max_unsharded_bytes": 1}):
        try:
            tune(tiny_lm, lambda m, o: _step(m, o, x), config=TuneConfig(**{**FAST, **opts}))
        except ValueError as e:
            messages.append(str(e))
    return messages


def test_errors_reach_every_rank(world2):
    for messages in world2.run(errors_on_all_ranks, timeout_s=180):
        assert len(messages) == 2, messages
        assert "ranks disagree" in messages[0] and "max_unsharded_bytes" in messages[1]


def tuned_vs_ddp(rank: int, world: int, out: str, steps: int = 3) -> dict:
    """Tune for real, then train the tuned config against DDP: bitwise equal every step. Every
    other config of the space too, so the check does not hinge on which one won."""
    x0 = batch(tiny_lm(), rank, 0)
    result = tune(
        tiny_lm, lambda m, o: _step(m, o, x0), config=TuneConfig(space=SPACE, keep_fraction=0.25, **FAST),
        optimizer_fn=_sgd, out=out,
    )  # fmt: skip
    bitwise = {}
    for label, config in [("tuned", result.config), *enumerate(SPACE.candidates(OverlapConfig()))]:
        base = tiny_lm()
        ref = DDP(copy.deepcopy(base))
        ours = overlap.wrap(base, config=config)
        ref_opt, opt = (torch.optim.AdamW(ref.parameters(), lr=1e-2), torch.optim.AdamW(ours.parameters(), lr=1e-2))
        same = True
        for step in range(steps):
            x = batch(base, rank, step)
            ref_loss, loss = loss_of(ref(x)), loss_of(ours(x))
            ref_loss.backward()
            loss.backward()
            ref_opt.step()
            opt.step()
            ref_opt.zero_grad()
            opt.zero_grad()
            same &= bool(torch.equal(loss, ref_loss))
            named_ref = dict(ref.module.named_parameters())
            for name, p in ours.named_parameters():
                local = p.to_local()
                rows = -(-named_ref[name].shape[0] // world)
                full = named_ref[name].detach()[rank * rows : rank * rows + local.shape[0]]
                same &= bool(torch.equal(full, local))
        bitwise[label] = same
    dist.barrier()
    loaded = OverlapConfig.load(out)
    stored = TuneResult.from_json(json.loads(json.dumps(result.to_json())), OverlapConfig())
    return {
        "bitwise": bitwise,
        "loaded_equal": loaded == result.config,
        "json_equal": stored == result,
        "winner": result.winner,
        "measured": len(result.candidates),
    }


def test_tuned_config_trains_like_ddp_and_json_round_trips(world2, tmp_path):
    out = tmp_path / "tuned.json"
    r0, r1 = world2.run(tuned_vs_ddp, out=str(out))
    for rank, r in enumerate((r0, r1)):
        assert all(r["bitwise"].values()), (rank, r["bitwise"])
        assert r["loaded_equal"] and r["json_equal"], (rank, r)
    assert r0["winner"] == r1["winner"] and r0["measured"] >= 2
    assert set(json.loads(out.read_text())) == set(OverlapConfig().to_dict())


def command_on_ranks(rank: int, world: int, out: str) -> dict:
    from overlap.tools.bench.step import StepBenchConfig
    from overlap.tools.tune.command import TuneCommand, tune_rank

    workload = StepBenchConfig(layers=2, dim=16, heads=2, ff=24, batch=2, seq=8)
    cmd = TuneCommand(
        workload=workload, search=TuneConfig(**FAST), out=out,
        space_overrides={"min_unit_numel": (0,), "prefetch_depth": (1, 2), "reduce_scatter_bucket_bytes": (0,),
                         "max_reduce_inputs": (1,)},
    )  # fmt: skip
    result = tune_rank(rank, world, cmd)
    return {"is_result": isinstance(result, TuneResult), "grid": None if result is None else len(result.grid)}


def test_command_tunes_the_bench_workload(world2, tmp_path):
    out = tmp_path / "w1.json"
    r0, r1 = world2.run(command_on_ranks, out=str(out))
    assert r0["is_result"] and not r1["is_result"]
    assert r0["grid"] == 2
    assert OverlapConfig.load(out).prefetch_depth in (1, 2)


def test_cli_lists_tune_and_parses_its_flags():
    from overlap.tools.cli import COMMANDS, build_parser
    from overlap.tools.tune.command import command_from_args

    assert COMMANDS["tune"][0] == "overlap.tools.tune.command"
    args = build_parser("tune").parse_args(
        ["tune", "--model", "gpt", "--nproc", "2", "--budget", "30", "--prefetch-depth", "1,2",
         "--bucket-bytes", "0,25e6", "--max-inflight-bytes", "none,5e7", "--out", "x.json"]
    )  # fmt: skip
    cmd = command_from_args(args)
    assert cmd.workload.model == "gpt" and cmd.nproc == 2 and cmd.search.total_steps == 30
    assert cmd.space_overrides == {
        "prefetch_depth": (1, 2),
        "reduce_scatter_bucket_bytes": (0, 25_000_000),
        "max_inflight_allgather_bytes": (None, 50_000_000),
    }
    lossy = build_parser("tune").parse_args(["tune", "--codecs", "none,int8+ef"])
    with pytest.raises(ValueError, match="allow-compression"):
        command_from_args(lossy)


def test_calibration_file_reaches_the_pruning(tmp_path):
    """`overlap tune --calibration FILE` loads the file into TuneConfig; the planner then prunes
    with it on this world's ranks (the one model of overlap/step_model/calibration.py)."""
    from overlap.step_model.calibration import default_world_calibration
    from overlap.tools.cli import build_parser
    from overlap.tools.tune.command import command_from_args
    from overlap.tools.tune.predict import calibration_for
    from overlap.tools.worlds.link import LinkSpec

    cal = default_world_calibration(2, "gloo", LinkSpec.parse("1gbit"))
    path = cal.save(tmp_path / "cal.json")
    cmd = command_from_args(build_parser("tune").parse_args(["tune", "--calibration", str(path)]))
    assert cmd.search.calibration == cal
    used, topo = calibration_for(4, "gloo", None, cmd.search.calibration)
    assert used == cal and topo.num_ranks == 4 and topo.link() == cal.gather_link
    default, _ = calibration_for(2, "gloo", "1gbit", None)
    assert default == cal
    with pytest.raises(ValueError, match="no such file"):
        command_from_args(build_parser("tune").parse_args(["tune", "--calibration", str(tmp_path / "no.json")]))


def test_profile_measures_backward_and_prunes_with_it():
    """The tune profile times the whole backward (output gradient to last accumulation); the
    planner charges each unit that multiple of its forward instead of assuming 2x."""
    from overlap.tools.tune.predict import BACKWARD_FACTOR, profile_model

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(3)])
    x = torch.randn(32, 64)

    def step(m, opt):
        m(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    profile = profile_model(model, step, lambda p: torch.optim.SGD(p, lr=0.1), "auto", num_steps=2)
    assert profile.backward_s is not None and profile.backward_s > 0
    assert profile.backward_factor == pytest.approx(profile.backward_s / profile.forward_s)
    assert not any(p.grad is not None for p in model.parameters())  # hooks gone, state clean
    assert len(model._forward_hooks) == 0
    unmeasured = dataclasses.replace(profile, backward_s=None)
    assert unmeasured.backward_factor == BACKWARD_FACTOR


def test_reduce_inputs_are_searched():
    """autotune found max_reduce_inputs=2 13% faster behind 1 Gbit (RESULTS.md, "Self-tuning"):
    the trial tuner searches it too, by default and from the command line."""
    from overlap.tools.cli import build_parser
    from overlap.tools.tune.command import command_from_args
    from overlap.tools.tune.space import default_space, describe

    space = TuneSpace(prefetch_depth=(1,), max_reduce_inputs=(1, 2))
    configs = space.candidates(OverlapConfig())
    assert space.size == 2 and [c.max_reduce_inputs for c in configs] == [1, 2]
    assert "inputs2" in describe(configs[1]) and "inputs" not in describe(configs[0])
    assert TuneSpace.from_dict(space.to_dict()) == space
    assert default_space(tiny_lm()).max_reduce_inputs == (1, 2)
    args = build_parser("tune").parse_args(["tune", "--max-reduce-inputs", "1,3"])
    assert command_from_args(args).space_overrides["max_reduce_inputs"] == (1, 3)
