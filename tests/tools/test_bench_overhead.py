"""`overlap bench overhead`: a tiny real run (world sizes 1 and 2, plus the profile) through the
CLI, checked for exit code, table and JSON fields; and the per-unit arithmetic and validation."""

from __future__ import annotations

import json
import pstats
import subprocess
import sys
from pathlib import Path

import pytest

from overlap.tools.bench.overhead import CONTENDERS, OverheadBenchConfig, summarize

pytestmark = pytest.mark.slow  # spawns worlds or runs a command end to end: `-m 'not slow'` leaves it out

RUN_TIMEOUT_S = 240  # three spawned worlds on a loaded 2-core machine
REPO = Path(__file__).resolve().parents[2]


def test_bench_overhead_run(tmp_path: Path) -> None:
    out, prof = tmp_path / "overhead.json", tmp_path / "overhead.prof"
    proc = subprocess.run(
        [
            sys.executable, "-m", "overlap", "bench", "overhead", "--units", "3", "--rounds", "1",
            "--steps", "2", "--nproc", "1,2", "--json", str(out), "--profile", str(prof),
            "--profile-steps", "2",
        ],
        cwd=REPO, check=False, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
    )  # fmt: skip
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    assert "µs/unit over plain" in proc.stdout and "cProfile of overlap" in proc.stdout
    data = json.loads(out.read_text())
    assert data["config"]["units"] == 3
    assert [w["world_size"] for w in data["worlds"]] == [1, 2]
    for world in data["worlds"]:
        runs = {r["name"]: r for r in world["runs"]}
        assert list(runs) == list(CONTENDERS)
        plain = runs["plain"]["median_step_ms"]
        assert plain > 0 and runs["plain"]["overhead_per_unit_us"] is None
        for name in ("ddp", "fsdp2", "overlap"):
            run = runs[name]
            lo, hi = run["spread_ms"]
            assert 0 < lo <= run["median_step_ms"] <= hi
            expected_us = (run["median_step_ms"] - plain) * 1e3 / 3
            assert run["overhead_per_unit_us"] == pytest.approx(expected_us)
        assert "overlap_over_fsdp2_per_unit" in world
    profile = data["profile"]
    assert profile["steps"] == 2 and profile["step_ms"] > 0
    assert pstats.Stats(str(prof)).total_calls > 0  # type: ignore[attr-defined]
    assert profile["functions"] and all(f["self_us_per_unit"] >= 0 for f in profile["functions"])
    verbs = {f["function"] for f in profile["overlap_functions"]}
    # overlap/runtime.py's gradient verbs lead at world size 1, where the gather verbs only swap
    # parameters ([Note: aliased units]) and may fall out of the top rows
    assert {"reduce", "wait_reduce"} <= verbs, verbs
    assert all("/overlap/bench/" not in f["where"] for f in profile["overlap_functions"])


def test_overhead_per_unit_arithmetic() -> None:
    cfg = OverheadBenchConfig(units=4, rounds=2, steps=3)
    step_ms = [
        [[1.0, 1.0, 2.0], [1.0, 3.0, 3.0]],  # plain: round medians 1, 3 -> 2 ms
        [[2.0, 2.0, 2.0], [2.0, 2.0, 2.0]],  # ddp: 2 ms -> 0 µs per unit
        [[4.0, 4.0, 4.0], [6.0, 6.0, 6.0]],  # fsdp2: 5 ms -> 750 µs per unit
        [[8.0, 8.0, 8.0], [8.0, 8.0, 8.0]],  # overlap: 8 ms -> 1500 µs per unit
    ]
    world = summarize(cfg, 1, step_ms)
    runs = {r.name: r for r in world.runs}
    assert runs["plain"].median_step_ms == 2.0 and runs["plain"].spread_ms == (1.0, 3.0)
    assert runs["ddp"].overhead_per_unit_us == pytest.approx(0.0)
    assert runs["fsdp2"].overhead_per_unit_us == pytest.approx(750.0)
    assert runs["overlap"].overhead_per_unit_us == pytest.approx(1500.0)
    assert world.overlap_over_fsdp2_per_unit == pytest.approx(2.0)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="plain"):
        OverheadBenchConfig(contenders=("ddp", "overlap"))
    with pytest.raises(ValueError, match="nproc"):
        OverheadBenchConfig(nproc=(1, 1))
    with pytest.raises(ValueError, match=">= 1"):
        OverheadBenchConfig(units=0)
