"""`overlap bench step --hsdp R`: a tiny HSDP 2 x 2 run on 4 ranks through the CLI (every
contender reports a time, overlap and FSDP2 hold half of DDP's state, the parity guard holds, the
transport line names what carried each collective: shared memory on both mesh dimensions by
default, gloo with shared_memory=off), and a number of replicas that does not
divide the world size refused before any rank starts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from overlap.tools.bench import peers
from overlap.tools.bench.step import StepBenchConfig

RUN_TIMEOUT_S = 480  # 4 ranks on a shared 2-core machine: generous
REPO = Path(__file__).resolve().parents[2]
TINY = ("--layers", "1", "--dim", "32", "--ff", "64", "--heads", "2", "--seq", "8", "--batch", "2")
CONTENDERS = ("overlap", "ddp", "fsdp2", "floor-compute")


def bench_step(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "overlap", "bench", "step", *argv],
        cwd=REPO, check=False, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_hsdp_2x2_every_contender_reports_a_time(tmp_path: Path) -> None:
    out = tmp_path / "hsdp.json"
    proc = bench_step(
        "--hsdp", "2", "--nproc", "4", "--contenders", ",".join(CONTENDERS),
        "--overlap-config", "shared_memory=off", *TINY, "--rounds", "1", "--steps", "1",
        "--no-memory", "--json", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    stdout = proc.stdout
    assert "world=4 x 1 thread(s), HSDP 2 x 2" in stdout, stdout
    assert "WARNING" not in stdout, stdout  # HSDP trains as DDP: the parity guard held
    data = json.loads(out.read_text())
    assert data["world_size"] == 4 and data["config"]["hsdp"] == 2
    runs = {r["name"]: r for r in data["runs"]}
    assert list(runs) == ["overlap", "overlap[shared_memory=off]", "fsdp2", "ddp", "floor-compute"]
    for run in runs.values():
        assert run["median_step_ms"] > 0, run
        lo, hi = run["spread_ms"]
        assert lo <= run["median_step_ms"] <= hi, run
    for name in ("overlap", "overlap[shared_memory=off]", "fsdp2"):
        assert f"parity ok: {name} loss at step 1" in stdout, stdout
        # sharded over 2 of the 4 ranks: about half of DDP's state (padding aside)
        assert runs[name]["state_bytes"] < 0.6 * runs["ddp"]["state_bytes"], runs[name]
    shm, gloo = runs["overlap"]["settings"]["transport"], runs["overlap[shared_memory=off]"]["settings"]["transport"]
    assert shm["all_gather"] == "ShmAllGather x2" and shm["reduce_scatter"] == "ShmReduceScatter x2", shm
    assert gloo["all_gather"] == "GlooAllGather x2" and gloo["reduce_scatter"] == "GlooReduceScatter x2", gloo
    # one host: the sums across replicas go through shared memory too (transport/shm_all_reduce.py)
    assert shm["all_reduce"] == "ShmAllReduce x2" and gloo["all_reduce"] == "GlooAllReduce x2"
    assert (
        "transport: all-gather ShmAllGather x2, reduce-scatter ShmReduceScatter x2, all-reduce ShmAllReduce x2"
        in stdout
    )


def test_replicas_must_divide_every_world_size() -> None:
    with pytest.raises(ValueError, match=r"--hsdp 3 needs every world size of --nproc divisible by 3"):
        StepBenchConfig(hsdp=3, nproc=(4,))
    with pytest.raises(ValueError, match=r"\[2\] is not"):
        StepBenchConfig(hsdp=4, nproc=(2, 4))
    with pytest.raises(ValueError, match="hsdp"):
        StepBenchConfig(hsdp=0)
    assert StepBenchConfig(hsdp=2, nproc=(2, 4)).hsdp == 2
    with pytest.raises(ValueError, match="num_replicas"):
        peers.TrainSetup(
            make_optimizer=lambda params: None, units_of=list, micro_batch=1, hidden_size=1, num_replicas=0
        )  # fmt: skip


def test_cli_refuses_bad_replicas_before_spawning() -> None:
    proc = bench_step("--hsdp", "3", "--nproc", "4", *TINY, "--no-memory")
    assert proc.returncode != 0
    assert "--hsdp 3 needs every world size of --nproc divisible by 3" in proc.stderr + proc.stdout
    assert "parity" not in proc.stdout  # refused on the launcher: no rank ran
