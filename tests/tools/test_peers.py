"""The peer contenders (overlap/bench/peers.py): every one builds and trains on 2 gloo ranks, the
exact ones (DeepSpeed ZeRO-3) match DDP's losses, the lossy ones (bf16/fp16 hooks, PowerSGD, a
bf16 FSDP2 reduce) stay close; their state accounting; a missing package skips a contender with
one line instead of crashing a benchmark.

Tolerances, from runs on this 2-core CPU machine (tiny GPT and W1, lr 1e-2, clipping at 1.0, a
LambdaLR schedule, 4 steps; relative difference of the loss from DDP's on each rank, two runs):
  deepspeed, deepspeed-tuned     <= 1.2e-7 observed (reduction order)          -> asserted 1e-5
  ddp-bf16, fsdp2-bf16reduce     <= 2.3e-5 observed                            -> asserted 1e-3
  ddp-fp16 (GPT)                 <= 2.5e-6 observed (W1's tiny gradients lose up to 5.8e-3 in
                                 fp16; W1 is checked for DeepSpeed only)       -> asserted 1e-3
  ddp-powersgd1/4                steps 0-2 exact (torch all-reduces uncompressed before
                                 start_powerSGD_iter = 2), step 3 3.3e-4..2.7e-3 -> asserted < 0.1
  overlap int8 + error feedback  <= 1.4e-3 observed                            -> asserted 1e-2
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.harness import DEEPSPEED_BUILD_S

from overlap.tools.bench import peers
from overlap.tools.bench.step import StepBenchConfig, bench_step, build_model, compute_loss, make_batch, shard_units

pytestmark = pytest.mark.slow  # spawns worlds or runs a command end to end: `-m 'not slow'` leaves it out

STEPS = 4
EXACT_RTOL = 1e-5
LOSSY_RTOL = 1e-3
INT8_RTOL = 1e-2
POWERSGD_RTOL = 0.1
TINY = StepBenchConfig(model="gpt", layers=2, dim=32, heads=2, seq=16, batch=2)
W1_TINY = StepBenchConfig(model="w1", layers=2, dim=32, heads=2, ff=64, seq=16, batch=2)
REPO = Path(__file__).resolve().parents[2]


def setup(cfg: StepBenchConfig) -> peers.TrainSetup:
    return peers.TrainSetup(
        make_optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
        units_of=shard_units,
        micro_batch=cfg.batch,
        hidden_size=cfg.dim,
        max_grad_norm=1.0,
    )


def train_each(rank: int, world_size: int, cfg: StepBenchConfig, names: list[str]) -> dict:
    """Every contender of `names` from the same initial weights, STEPS steps on this rank's
    batch with a decaying LR schedule on the trainer's optimizer; losses and accounting."""
    batch = make_batch(cfg, rank)
    out = {}
    for name in names:
        t = peers.build_trainer(name, build_model(cfg), setup(cfg))
        sched = torch.optim.lr_scheduler.LambdaLR(t.optimizer, lambda s: 1.0 / (1 + s))
        losses, state = [], 0
        for i in range(STEPS):
            loss = compute_loss(t.model, batch)
            t.backward(loss)
            t.step()
            if i == STEPS - 1:
                state = t.state_bytes()
            t.zero_grad()
            sched.step()
            losses.append(loss.item())
        out[name] = {"losses": losses, "state": state, "lossy": t.lossy, "settings": t.settings}
    return out


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.timeout(DEEPSPEED_BUILD_S + 300)
def test_every_peer_trains_close_to_ddp(world2, deepspeed_op: float) -> None:
    names = ["ddp", *peers.PEERS, "overlap", "overlap[grad_compression=int8,error_feedback=True]"]
    for rank_result in world2.run(train_each, cfg=TINY, names=names, timeout_s=240):
        ref = rank_result["ddp"]["losses"]
        for name, r in rank_result.items():
            losses = r["losses"]
            assert all(map(torch.isfinite, torch.tensor(losses))), (name, losses)
            diffs = [rel(a, b) for a, b in zip(losses, ref, strict=True)]
            if name in peers.POWERSGD_RANKS:
                assert max(diffs[:3]) <= EXACT_RTOL, (name, diffs)  # uncompressed until step 2
                assert 0 < diffs[3] < POWERSGD_RTOL, (name, diffs)  # step 2 was compressed
            elif name.startswith("overlap["):  # int8 gradients with error feedback
                assert 0 < max(diffs) <= INT8_RTOL, (name, diffs)
            elif r["lossy"]:
                assert max(diffs) <= LOSSY_RTOL, (name, diffs)
            else:
                assert max(diffs) <= EXACT_RTOL, (name, diffs)
        assert {n for n, r in rank_result.items() if r["lossy"]} == {
            *peers.DDP_HOOK_PEERS, "fsdp2-bf16reduce",
            "overlap[grad_compression=int8,error_feedback=True]",
        }  # fmt: skip
        # accounting: sharded contenders hold about half of DDP's state; PowerSGD adds its
        # error feedback and memories to DDP's; overlap's error feedback adds a full residual
        state = {n: r["state"] for n, r in rank_result.items()}
        assert state["fsdp2-bf16reduce"] < 0.6 * state["ddp"]
        assert state["overlap"] < 0.6 * state["ddp"]
        assert state["overlap[grad_compression=int8,error_feedback=True]"] > state["overlap"]
        for name in peers.POWERSGD_RANKS:
            assert state[name] > state["ddp"], name
        assert state["ddp-bf16"] == state["ddp-fp16"] == state["ddp"]
        # ZeRO-3 partitions (tuned: even the small parameters), plus DeepSpeed's own fp32 copy
        assert state["deepspeed-tuned"] < state["deepspeed"]
        assert 0.5 * state["ddp"] < state["deepspeed-tuned"] < state["ddp"]
        settings = rank_result["deepspeed-tuned"]["settings"]
        assert settings["reduce_bucket_size"] == TINY.dim**2 and settings["overlap_comm"] is True
        assert rank_result["ddp-powersgd4"]["settings"]["matrix_approximation_rank"] == 4


@pytest.mark.timeout(DEEPSPEED_BUILD_S + 300)
def test_deepspeed_matches_ddp_on_w1(world2, deepspeed_op: float) -> None:
    """W1's TransformerEncoderLayer reads its attention's out_proj weight without calling that
    module: ZeRO-3 must still gather it."""
    names = ["ddp", *peers.DEEPSPEED_PEERS]
    for rank_result in world2.run(train_each, cfg=W1_TINY, names=names, timeout_s=240):
        ref = rank_result["ddp"]["losses"]
        for name in peers.DEEPSPEED_PEERS:
            diffs = [rel(a, b) for a, b in zip(rank_result[name]["losses"], ref, strict=True)]
            assert max(diffs) <= EXACT_RTOL, (name, diffs)


def test_deepspeed_configs() -> None:
    s = peers.TrainSetup(
        make_optimizer=torch.optim.AdamW, units_of=shard_units, micro_batch=4, hidden_size=512,
        max_grad_norm=1.0,
    )  # fmt: skip
    default = peers.deepspeed_config("deepspeed", s)
    assert default["zero_optimization"] == {"stage": 3}  # DeepSpeed's own defaults otherwise
    assert default["train_micro_batch_size_per_gpu"] == 4
    assert default["gradient_clipping"] == 1.0
    tuned = peers.deepspeed_config("deepspeed-tuned", s)["zero_optimization"]
    assert tuned == {
        "stage": 3,
        "overlap_comm": True,
        "reduce_bucket_size": 512 * 512,
        "stage3_prefetch_bucket_size": int(0.9 * 512 * 512),
        "stage3_param_persistence_threshold": 5120,
    }
    without_clip = peers.TrainSetup(
        make_optimizer=torch.optim.AdamW, units_of=shard_units, micro_batch=4, hidden_size=512
    )
    assert "gradient_clipping" not in peers.deepspeed_config("deepspeed", without_clip)


def test_setup_and_names_are_validated() -> None:
    with pytest.raises(ValueError, match="powersgd_start_iter"):
        peers.TrainSetup(
            make_optimizer=torch.optim.AdamW, units_of=shard_units, micro_batch=1, hidden_size=8,
            powersgd_start_iter=1,
        )  # fmt: skip
    with pytest.raises(ValueError, match="unknown contender 'zero4'"):
        peers.build_trainer("zero4", torch.nn.Linear(2, 2), setup(TINY))
    assert peers.overlap_spec("overlap") == ""
    assert peers.overlap_spec("overlap[grad_compression=int8]") == "grad_compression=int8"
    assert peers.overlap_spec("ddp-bf16") is None
    assert all(peers.is_known(n) for n in peers.PEERS + peers.BASELINES)
    with pytest.raises(ValueError, match="contenders"):
        StepBenchConfig(contenders=("deepspeed-zero4",))


def test_missing_package_skips_with_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # `import deepspeed` now fails
    lines: list[str] = []
    kept = peers.available(["ddp", "deepspeed", "ddp-bf16", "deepspeed-tuned"], say=lines.append)
    assert kept == ("ddp", "ddp-bf16")
    assert len(lines) == 2 and all("'deepspeed' package is not installed" in ln for ln in lines)
    assert lines[0].startswith("deepspeed: skipped") and "overlap[bench]" in lines[0]
    monkeypatch.setitem(sys.modules, "numpy", None)  # only looked up, never imported here
    assert peers.available(["ddp-powersgd1", "ddp-fp16"], say=lines.append) == ("ddp-fp16",)
    assert lines[-1].startswith("ddp-powersgd1: skipped, the 'numpy' package")


def test_bench_step_runs_without_deepspeed(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The launcher drops the contender before any rank starts: the run goes on without it."""
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    cfg = StepBenchConfig(
        model="gpt", layers=1, dim=32, heads=2, seq=16, batch=2, rounds=1, steps=1,
        contenders=("ddp", "deepspeed"), memory=False,
    )  # fmt: skip
    (report,) = bench_step(cfg)
    assert [r.name for r in report.runs] == ["ddp"]
    out = capsys.readouterr().out
    assert out.count("deepspeed: skipped, the 'deepspeed' package is not installed") == 1
    only_ds = StepBenchConfig(contenders=("deepspeed",), memory=False)
    with pytest.raises(ValueError, match="no contender left"):
        bench_step(only_ds)


# ---------------------------------------------------------------------------------------------
# benchmarks/convergence.py: the same trainers through `overlap demo`'s run, and the frontier


def load_convergence_script():
    name = "benchmarks_convergence"
    if name not in sys.modules:  # dataclasses look their module up while the script loads
        spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks/convergence.py")
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


@pytest.mark.timeout(DEEPSPEED_BUILD_S + 300)
def test_convergence_script(
    tmp_path: Path, deepspeed_op: float, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 3-step run of DDP and DeepSpeed (schedule, clipping, validation through the engine),
    then the report joined with a step benchmark's JSON: table and frontier picture. The script's
    `main` runs in this process, which has its imports already; each contender still trains in
    ranks spawned for it, which import the script by its name from benchmarks/."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    conv = importlib.import_module("convergence")
    tiny = ("--layers", "1", "--dim", "32", "--heads", "2", "--batch-size", "2",
            "--block-size", "16", "--eval-batches", "1")  # fmt: skip
    runs_json = tmp_path / "convergence.json"
    monkeypatch.setattr(sys, "argv", ["convergence.py", "--steps", "3", *tiny, "--contenders", "ddp,deepspeed-tuned",
                                      "--json", str(runs_json)])  # fmt: skip
    conv.main()
    runs = {r["name"]: r for r in json.loads(runs_json.read_text())["runs"]}
    assert list(runs) == ["ddp", "deepspeed-tuned"]
    for key in ("final_loss", "val_loss"):
        assert rel(runs["deepspeed-tuned"][key], runs["ddp"][key]) <= EXACT_RTOL, runs
    assert len(runs["ddp"]["losses"]) == 3 and runs["ddp"]["state_bytes"] > 0
    step_json = tmp_path / "step.json"
    step_json.write_text(json.dumps({"link": "1gbit", "runs": [
        {"name": "ddp", "median_step_ms": 10.0, "spread_ms": [9.0, 11.0],
         "peak_mem_bytes": 2**20, "state_bytes": 100},
        {"name": "deepspeed-tuned", "median_step_ms": 20.0, "spread_ms": [19.0, 21.0],
         "peak_mem_bytes": 2**21, "state_bytes": 60},
        {"name": "ddp-bf16", "median_step_ms": 5.0, "spread_ms": [5.0, 5.0],
         "peak_mem_bytes": 2**20, "state_bytes": 100},  # not in this convergence run
    ]}))  # fmt: skip
    png = tmp_path / "frontier.png"
    seeds = ["--from-json", str(runs_json)] * 2  # the same seed twice: its gaps
    monkeypatch.setattr(
        sys, "argv", ["convergence.py", *seeds, "--step-json", str(step_json), "--frontier-png", str(png)]
    )
    capsys.readouterr()
    conv.main()
    stdout = capsys.readouterr().out
    table = stdout[stdout.index("1gbit: step time") :].splitlines()
    assert table[3].split()[0] == "ddp" and table[3].split()[-1] == "yes"  # fastest: frontier
    assert table[4].split()[0] == "deepspeed-tuned"
    assert "ddp-bf16" not in stdout
    assert png.stat().st_size > 0


def convergence_run(conv: Any, name: str, final: float) -> Any:
    """A one-step ConvergenceRun of convergence.py whose losses are all `final`."""
    return conv.ConvergenceRun(
        name=name, losses=[final], final_loss=final, val_loss=final, median_step_ms=1.0,
        state_bytes=1, peak_rss_bytes=7, lossy=True, settings={},
    )  # fmt: skip


def test_frontier_dominance() -> None:
    conv = load_convergence_script()

    def point(name: str, step_ms: float, loss_gap: float, memory: int):
        return conv.FrontierPoint(
            name=name, step_ms=step_ms, spread_ms=(step_ms, step_ms), loss_gap=loss_gap,
            gap_range=(loss_gap, loss_gap), val_gap=loss_gap, memory_bytes=memory, state_bytes=memory,
        )  # fmt: skip

    fast = point("fast", 1.0, 0.01, 10)
    exact_slow = point("exact-slow", 2.0, 0.0, 10)  # slower but more accurate: on the frontier
    worse = point("worse", 3.0, 0.02, 10)  # slower and less accurate than `fast`
    lean = point("lean", 4.0, 0.05, 5)  # slowest and worst, but the least memory
    points = [fast, exact_slow, worse, lean]
    assert [conv.dominated(p, points) for p in points] == [False, False, True, False]


def test_frontier_averages_seeds() -> None:
    """Several seeds: each gap against that seed's DDP, averaged over the seeds a contender ran
    with, with their range and number."""
    conv = load_convergence_script()

    run = partial(convergence_run, conv)
    seeds = [
        [run("ddp", 2.0), run("a", 2.02), run("b", 2.0)],
        [run("ddp", 1.0), run("a", 0.99)],  # b did not run with this seed: its one seed counts
    ]
    report = {"runs": [
        {"name": n, "median_step_ms": 1.0, "spread_ms": [1.0, 1.0], "peak_mem_bytes": 1, "state_bytes": 1}
        for n in ("ddp", "a", "b")
    ]}  # fmt: skip
    points = {p.name: p for p in conv.join(report, seeds)}
    assert set(points) == {"ddp", "a", "b"}
    assert points["a"].loss_gap == pytest.approx(0.0) and points["a"].gap_range == pytest.approx((-0.01, 0.01))
    assert points["a"].num_seeds == 2 and points["b"].num_seeds == 1 and points["b"].loss_gap == 0.0


def test_frontier_compares_on_shared_seeds_and_train_memory() -> None:
    """Dominance compares two contenders' gaps on the seeds both ran (a one-seed contender is
    not judged against another's three-seed mean), and the memory axis is the step
    benchmark's train figure (peak RSS less the pre-build RSS) where it has one."""
    conv = load_convergence_script()

    run = partial(convergence_run, conv)
    seeds = [
        [run("ddp", 1.0), run("ours", 0.98), run("peer", 0.995)],  # a seed where all look better
        [run("ddp", 1.0), run("ours", 1.01)],
        [run("ddp", 1.0), run("ours", 1.01)],
    ]
    report = {"runs": [
        {"name": "ours", "median_step_ms": 2.0, "spread_ms": [2.0, 2.0], "peak_mem_bytes": 600,
         "train_mem_bytes": 200, "train_mem_range_bytes": [190, 210], "state_bytes": 1},
        {"name": "peer", "median_step_ms": 1.0, "spread_ms": [1.0, 1.0], "peak_mem_bytes": 590,
         "train_mem_bytes": 200, "train_mem_range_bytes": [200, 200], "state_bytes": 2},
    ]}  # fmt: skip
    points = {p.name: p for p in conv.join(report, seeds)}
    ours, peer = points["ours"], points["peer"]
    assert ours.memory_bytes == 200 and ours.memory_kind == "train RSS"
    assert ours.memory_range == (190, 210)
    assert ours.seed_gaps == pytest.approx({0: -0.02, 1: 0.01, 2: 0.01})
    assert peer.seed_gaps == pytest.approx({0: -0.005})
    # by the means, the faster peer (-0.5%, one seed) would dominate ours (0.0%, three seeds);
    # on seed 0, which both ran, ours is the more accurate
    assert peer.loss_gap < ours.loss_gap
    assert not conv.dominated(ours, list(points.values()))
    # without the train figure the step report's peak RSS is the memory
    del report["runs"][0]["train_mem_bytes"]
    ours = next(p for p in conv.join(report, seeds) if p.name == "ours")
    assert ours.memory_bytes == 600 and ours.memory_kind == "peak RSS"


def test_frontier_says_which_dominations_stand_out_of_the_noise() -> None:
    """[Note: dominated within noise]: a domination is resolved on an axis only beyond that
    axis's noise: the step spread, two standard errors of the paired per-seed gap differences,
    the train memory range."""
    conv = load_convergence_script()

    def point(name: str, step: tuple[float, float, float], gaps: list[float], mem: tuple[int, int, int]):
        return conv.FrontierPoint(
            name=name, step_ms=step[1], spread_ms=(step[0], step[2]), loss_gap=sum(gaps) / len(gaps),
            gap_range=(min(gaps), max(gaps)), val_gap=0.0, memory_bytes=mem[1], state_bytes=1,
            num_seeds=len(gaps), seed_gaps=dict(enumerate(gaps)), memory_range=(mem[0], mem[2]),
        )  # fmt: skip

    ours = point("ours", (90.0, 95.0, 99.0), [0.001, 0.002, 0.000, 0.001], (100, 101, 102))
    peer = point("peer", (120.0, 125.0, 130.0), [0.051, 0.049, 0.050, 0.052], (140, 141, 142))
    twin = point("twin", (93.0, 96.0, 101.0), [0.004, -0.002, 0.003, -0.001], (101, 101, 103))
    points = [ours, peer, twin]
    assert conv.dominators(peer, points) == [ours, twin]
    clear = conv.resolution(peer, ours)
    assert (clear.faster, clear.more_accurate, clear.leaner) == (True, True, True)
    assert clear.gap_difference == pytest.approx(-0.0495)
    # twin is slower than ours but within ours' spread; ours is dominated by nobody
    assert conv.dominators(ours, points) == [] and conv.dominators(twin, points) == [ours]
    tie = conv.resolution(twin, ours)
    assert (tie.faster, tie.more_accurate, tie.leaner) == (False, False, False)
    lines = conv.format_dominations(points)
    assert any(s.startswith("  twin dominated by ours") and "every difference within noise" in s for s in lines)
    assert any(s.startswith("  peer dominated by ours") and "resolved on step, loss, memory" in s for s in lines)
    # one shared seed: no standard error, so never resolved on the loss
    lone = conv.resolution(peer, point("lone", (1.0, 2.0, 3.0), [0.0], (1, 1, 1)))
    assert math.isnan(lone.gap_error) and not lone.more_accurate
