"""`overlap bench memory`: tiny real runs through the CLI (every contender in its own world of
2 fresh processes; the default contenders, DeepSpeed ZeRO-3 and PowerSGD in one run), checked
for exit code, table and JSON; and config validation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.harness import DEEPSPEED_BUILD_S

from overlap.observe.monitor import rss_bytes
from overlap.tools.bench.memory import BYTES_PER_PARAM_ZERO3, MemoryBenchConfig, num_params
from overlap.tools.bench.step import process_peak_rss_bytes
from overlap.tools.worlds.launch import run_local_world

pytestmark = pytest.mark.slow  # spawns worlds or runs a command end to end: `-m 'not slow'` leaves it out

RUN_TIMEOUT_S = 360  # five spawned worlds of 2 ranks on a loaded 2-core machine
REPO = Path(__file__).resolve().parents[2]
TINY = ("--layers", "2", "--d-model", "32", "--ff", "64", "--heads", "2", "--seq", "8", "--batch", "2")
DEFAULTS = ["overlap", "fsdp2", "ddp"]
PEERS = ["deepspeed-tuned", "ddp-powersgd1"]


@pytest.fixture(scope="module")
def memory_run(tmp_path_factory: pytest.TempPathFactory, deepspeed_op: float) -> dict:
    """One `overlap bench memory` run of the default contenders and the peers, 3 steps (PowerSGD
    allocates its error feedback at step 2); the tests below read it."""
    out = tmp_path_factory.mktemp("memory") / "memory.json"
    proc = subprocess.run(
        [sys.executable, "-m", "overlap", "bench", "memory", *TINY, "--nproc", "2", "--device", "cpu",
         "--steps", "3", "--contenders", ",".join(DEFAULTS + PEERS), "--json", str(out)],
        cwd=REPO, check=False, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
    )  # fmt: skip
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    assert "each contender ran in its own fresh processes" in proc.stdout
    data = json.loads(out.read_text())
    assert [r["name"] for r in data["runs"]] == DEFAULTS + PEERS
    assert len({r["pid"] for run in data["runs"] for r in run["ranks"]}) == 10  # every world fresh
    return data


@pytest.mark.timeout(DEEPSPEED_BUILD_S + RUN_TIMEOUT_S)
def test_bench_memory_run(memory_run: dict) -> None:
    data = memory_run
    params = data["params"]
    assert params == num_params(MemoryBenchConfig(layers=2, d_model=32, ff=64, heads=2))
    runs = {r["name"]: r for r in data["runs"] if r["name"] in DEFAULTS}
    assert list(runs) == DEFAULTS
    pids = set()
    for name, run in runs.items():
        assert run["world_size"] == 2 and run["device"] == "cpu"
        assert [r["rank"] for r in run["ranks"]] == [0, 1]
        assert run["peak_rss_bytes"] == max(r["peak_rss_bytes"] for r in run["ranks"])
        assert run["peak_rss_bytes"] >= run["base_rss_bytes"] > 0
        assert run["ideal_zero3_bytes"] == BYTES_PER_PARAM_ZERO3 * params // 2
        assert run["cuda_max_allocated_bytes"] is None  # CPU run
        pids |= {r["pid"] for r in run["ranks"]}
        # state by accounting: sharded contenders hold about half of DDP's (padding aside)
        if name != "ddp":
            assert run["state_bytes"] < 0.75 * runs["ddp"]["state_bytes"], (name, run)
    assert len(pids) == 6  # every contender's ranks were processes of their own
    # replicated: all of it (plus Adam's 4-byte step counter per parameter tensor)
    assert runs["ddp"]["state_bytes"] == pytest.approx(BYTES_PER_PARAM_ZERO3 * params, rel=0.01)
    assert "library_peak_bytes" in runs["overlap"]


@pytest.mark.timeout(DEEPSPEED_BUILD_S + RUN_TIMEOUT_S)
def test_bench_memory_peers(memory_run: dict) -> None:
    """DeepSpeed ZeRO-3 partitions its state (tuned: even the small parameters) but keeps an fp32
    copy of its partition; PowerSGD adds its error feedback (allocated at step 2) to DDP's."""
    data = memory_run
    runs = {r["name"]: r for r in data["runs"] if r["name"] in PEERS}
    assert list(runs) == PEERS
    ddp = BYTES_PER_PARAM_ZERO3 * data["params"]  # DDP's, within 1% (test_bench_memory_run)
    # partitions, fp32 copy, gradient partitions: 4 + 4 + 4 bytes per element / 2, AdamW 8 / 2
    assert 0.55 * ddp < runs["deepspeed-tuned"]["state_bytes"] < 0.75 * ddp
    assert runs["ddp-powersgd1"]["state_bytes"] > ddp
    for run in runs.values():
        assert run["peak_rss_bytes"] >= run["base_rss_bytes"] > 0
        assert len({r["pid"] for r in run["ranks"]}) == 2


def peak_of_this_rank(rank: int, world_size: int) -> int:
    return process_peak_rss_bytes()


def test_spawned_rank_peak_excludes_its_launcher() -> None:
    """[Note: ru_maxrss of a spawned rank]: a rank spawned from a process holding 1 GiB must
    not report that GiB as its own peak (ru_maxrss would)."""
    ballast = bytearray(2**30)
    ballast[::4096] = b"\1" * len(ballast[::4096])  # touch every page: resident
    launcher_rss = rss_bytes()
    (child_peak,) = run_local_world(peak_of_this_rank, 1, timeout_s=120, deadline_s=180)
    del ballast
    assert 0 < child_peak < launcher_rss - 2**29, (child_peak, launcher_rss)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="divisible"):
        MemoryBenchConfig(d_model=30, heads=4)
    with pytest.raises(ValueError, match="contenders"):
        MemoryBenchConfig(contenders=("zero",))
    with pytest.raises(ValueError, match="key=value"):
        MemoryBenchConfig(overlap_configs=("prefetch_depth",))
    cfg = MemoryBenchConfig(overlap_configs=("prefetch_depth=2",))
    assert cfg.contender_names() == ["overlap", "overlap[prefetch_depth=2]", "fsdp2", "ddp"]
    assert num_params(MemoryBenchConfig()) == 151_154_688  # the 151 M-parameter model
