"""The flags of every command come from its config dataclass (overlap/tools/flags.py): each config
round-trips (flags -> dataclass -> flags), and every command still takes the flags it took when
they were written by hand."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from overlap.tools.bench.comm import CommBenchConfig
from overlap.tools.bench.memory import MemoryBenchConfig
from overlap.tools.bench.mesh import MeshBenchConfig
from overlap.tools.bench.overhead import OverheadBenchConfig
from overlap.tools.bench.overlap import OverlapBenchConfig
from overlap.tools.bench.step import StepBenchConfig
from overlap.tools.cli import build_parser
from overlap.tools.demo import DemoConfig
from overlap.tools.flags import add_flags, field_docs, from_flags, to_flags
from overlap.tools.tune.command import SEARCH_FLAGS, TuneCommand, command_from_args
from overlap.tools.tune.options import TuneConfig
from overlap.tools.workloads.step import Workload

CHANGED = [
    CommBenchConfig(ops=("all_gather", "all_reduce"), min_bytes=16, max_bytes=1024, dtype="bfloat16", iters=3,
                    warmup=0, budget_bytes=4096, nproc=3, link="1gbit,200us", json_path="out/c.json"),
    OverlapBenchConfig(op="reduce_scatter", comm_bytes=1024, num_comms=2, matmul_dim=64, num_matmuls=3, rounds=2,
                       dtype="float64", nproc=2, link="1gbit", json_path="o.json"),
    StepBenchConfig(model="gpt", contenders=("overlap", "ddp"), overlap_configs=("prefetch_depth=2", "a=1,b=2"),
                    rounds=1, steps=2, layers=2, dim=64, heads=2, ff=128, batch=2, seq=16, lr=0.5, seed=3,
                    nproc=(1, 2, 4), threads=2, keep_freed_memory=False, memory=False, memory_repeats=3,
                    timeout_s=60.0, link="1gbit", json_path="s.json"),
    OverheadBenchConfig(units=4, dim=8, batch=2, rounds=1, steps=3, contenders=("plain", "overlap"), nproc=(1,),
                        lr=0.5, seed=1, timeout_s=10.0, json_path="h.json", profile_path="p.prof", profile_steps=4),
    MemoryBenchConfig(layers=2, d_model=64, heads=4, ff=128, seq=8, batch=1, steps=4, lr=0.5, seed=2,
                      contenders=("overlap", "ddp"), overlap_configs=("prefetch_depth=1",), nproc=(1, 2),
                      device="cpu", threads=1, timeout_s=30.0, json_path="m.json"),
    MeshBenchConfig(dp=1, tp=4, overlap_configs=("prefetch_depth=1",), rounds=1, steps=2, layers=2, dim=64, ff=128,
                    batch=2, seq=8, lr=0.5, threads=2, memory=False, timeout_s=30.0),
    DemoConfig(steps=5, nproc=3, layers=2, dim=64, heads=2, block_size=32, batch_size=4, lr=0.5, seed=1,
               log_every=2, eval_batches=1, max_bytes=4096, prefetch_depth=1, bucket_bytes=1000,
               reshard_after_forward=False, param_compression="int8", grad_compression="int4",
               error_feedback=True, checkpoint_dir="ckpt", save_every=2),
    Workload(model="gpt", layers=3, dim=32, heads=4, ff=64, batch=1, seq=8, lr=0.5, seed=9),
    TuneCommand(out="t.json", nproc=3, link="1gbit", json_path="r.json"),
]  # fmt: skip


def parse(cls: type, argv: list[str]) -> object:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_flags(parser, cls)
    return from_flags(cls, parser.parse_args(argv))


@pytest.mark.parametrize("cfg", CHANGED, ids=lambda c: type(c).__name__)
def test_every_config_round_trips(cfg: object) -> None:
    cls = type(cfg)
    assert parse(cls, []) == cls()  # no flag: the defaults
    argv = to_flags(cfg)
    changed = [f.name for f in dataclasses.fields(cls) if getattr(cfg, f.name) != getattr(cls(), f.name)]
    assert changed and argv, cls  # the case sets something the flags must carry
    back = parse(cls, argv)
    assert back == cfg, (argv, back)
    assert to_flags(back) == argv


def test_search_flags_round_trip() -> None:
    cfg = TuneConfig(allow_compression=True, keep_fraction=0.5, max_candidates=3, first_round_steps=2,
                     total_steps=9, warmup_steps=0, cache_dir="cache")  # fmt: skip
    parser = argparse.ArgumentParser()
    add_flags(parser, TuneConfig, only=SEARCH_FLAGS)
    argv = to_flags(cfg, only=SEARCH_FLAGS)
    assert "--budget" in argv and "--allow-compression" in argv
    assert from_flags(TuneConfig, parser.parse_args(argv)) == cfg


def test_help_comes_from_the_field_docstrings() -> None:
    docs = field_docs(StepBenchConfig)
    assert docs["steps"] == "Timed steps per contender per round."
    assert docs["ff"].startswith("W1's feed-forward width")  # inherited from Workload
    text = build_parser("bench").parse_known_args(["bench", "step"])[0]  # the parser builds
    assert text.bench == "step"


OLD_FLAGS = {
    "bench comm": "--ops all_gather --min-bytes 8 --max-bytes 64 --dtype float32 --iters 2 --warmup 1 "
                  "--budget-bytes 64 --nproc 2 --link 1gbit --json x.json",
    "bench overlap": "--op all_gather --comm-bytes 64 --num-comms 2 --matmul-dim 8 --num-matmuls 2 --rounds 1 "
                     "--dtype float32 --nproc 2 --link 1gbit --json x.json",
    "bench step": "--model gpt --contenders overlap,ddp --overlap-config prefetch_depth=2 --overlap-config a=1 "
                  "--no-keep-freed-memory --no-memory --memory-repeats 2 --rounds 1 --steps 1 --layers 2 --dim 64 "
                  "--heads 2 --ff 128 --batch 2 --seq 16 --lr 0.1 --seed 1 --nproc 1,2 --threads 1 --timeout-s 60 "
                  "--link 1gbit --mesh dp=1,tp=2 --json x.json",
    "bench overhead": "--units 4 --dim 8 --batch 2 --rounds 1 --steps 1 --contenders plain,overlap --nproc 1,2 "
                      "--lr 0.1 --seed 1 --timeout-s 60 --json x.json --profile p.prof --profile-steps 2",
    "bench memory": "--layers 2 --d-model 64 --heads 2 --ff 128 --seq 8 --batch 1 --steps 3 --lr 0.1 --seed 1 "
                    "--contenders overlap,ddp --overlap-config prefetch_depth=1 --nproc 1,2 --device cpu "
                    "--threads 1 --timeout-s 60 --json x.json",
    "bench mesh": "--dp 2 --tp 2 --overlap-config prefetch_depth=1 --rounds 1 --steps 1 --layers 2 --dim 64 "
                  "--ff 128 --batch 2 --seq 8 --lr 0.1 --threads 1 --no-memory --timeout-s 60",
    "demo": "--steps 2 --nproc 2 --layers 2 --dim 64 --heads 2 --block-size 32 --batch-size 4 --lr 0.1 --seed 1 "
            "--log-every 1 --eval-batches 1 --max-bytes 4096 --engine overlap --checkpoint-dir d --save-every 1 "
            "--json x.json --prefetch-depth 1 --bucket-bytes 100 --no-reshard-after-forward "
            "--param-compression int8 --grad-compression int8 --error-feedback",
    "tune": "--model w1 --nproc 2 --link 1gbit --out t.json --json r.json --budget 8 --allow-compression "
            "--keep-fraction 0.5 --max-candidates 4 --first-round-steps 1 --warmup-steps 1 --cache-dir c "
            "--refresh --min-unit-numel 0,1e6 --prefetch-depth 1,2 --max-inflight-bytes none,50e6 "
            "--bucket-bytes 0,50e6 --max-reduce-inputs 1,2 --codecs none,int8+ef --layers 2 --dim 64 --heads 2 "
            "--ff 128 --batch 2 --seq 16 --lr 0.1 --seed 1",
}  # fmt: skip


@pytest.mark.parametrize("command", sorted(OLD_FLAGS))
def test_commands_take_their_old_flags(command: str) -> None:
    words = command.split()
    args = build_parser(words[0]).parse_args(words + OLD_FLAGS[command].split())
    assert args.command == words[0]
    if command == "tune":
        cmd = command_from_args(args)
        assert cmd.search.total_steps == 8 and cmd.search.cache == "refresh"
        assert cmd.space_overrides["max_inflight_allgather_bytes"] == (None, 50_000_000)
        assert cmd.space_overrides["reduce_scatter_bucket_bytes"] == (0, 50_000_000)
        assert cmd.workload == Workload(layers=2, dim=64, heads=2, ff=128, batch=2, seq=16, lr=0.1, seed=1)
    if command == "bench step":
        assert args.overlap_configs == ["prefetch_depth=2", "a=1"] and args.nproc == (1, 2) and not args.memory
    if command == "demo":
        assert args.reshard_after_forward is False and args.error_feedback is True and args.json_path == "x.json"


def test_bench_step_mesh_is_bench_mesh_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    """The old spelling `overlap bench step --mesh dp=N,tp=M` runs `overlap bench mesh` with the
    step flags it shares, and warns."""
    from overlap.tools.bench import mesh, step

    ran = []
    monkeypatch.setattr(mesh, "bench_mesh", ran.append)
    argv = ["bench", "step", "--mesh", "dp=1,tp=4", "--layers", "2", "--dim", "64", "--ff", "128", "--no-memory"]
    with pytest.warns(DeprecationWarning, match="overlap bench mesh"):
        assert step.run(build_parser("bench").parse_args(argv)) == 0
    assert ran == [MeshBenchConfig(dp=1, tp=4, layers=2, dim=64, ff=128, memory=False)]
    new = build_parser("bench").parse_args(["bench", "mesh", "--dp", "1", "--tp", "4", "--layers", "2", "--dim", "64",
                                            "--ff", "128", "--no-memory"])  # fmt: skip
    assert from_flags(MeshBenchConfig, new) == ran[0]
