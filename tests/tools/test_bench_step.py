"""`overlap bench step`: tiny real runs (gpt and W1, world sizes 1 and 2) through the CLI and
through benchmarks/step_w1.py, checked for exit code, JSON schema and the scaling table; the peer
contenders (DeepSpeed, DDP hooks, FSDP2 bf16 reduce) beside overlap's codecs in one tiny run; and
the pure pieces (config validation, override parsing, JSON paths, the scaling table's arithmetic).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.harness import DEEPSPEED_BUILD_S

from overlap.tools.bench import peers, step
from overlap.tools.bench.step import (
    DEFAULT_CONTENDERS,
    StepBenchConfig,
    StepReport,
    StepRun,
    format_scaling,
    json_path_for,
    parse_overrides,
)

pytestmark = pytest.mark.slow  # spawns worlds or runs a command end to end: `-m 'not slow'` leaves it out

RUN_TIMEOUT_S = 240  # the memory pass spawns one more world per contender
REPO = Path(__file__).resolve().parents[2]
TINY = ("--layers", "1", "--dim", "32", "--heads", "2", "--seq", "16", "--batch", "2")
TINY_RUN = ("--rounds", "1", "--steps", "1")
RUN_KEYS = {"name", "median_step_ms", "spread_ms", "tokens_per_s", "exposed_comm_ms", "peak_mem_bytes"}


def run_python(*argv: str, tmpdir: Path | None = None) -> str:
    env = None if tmpdir is None else {**os.environ, "TMPDIR": str(tmpdir)}
    proc = subprocess.run(
        [sys.executable, *argv], cwd=REPO, check=False, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env
    )
    assert proc.returncode == 0, f"{' '.join(argv)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def check_report(path: Path, world_size: int, memory: bool, contenders: tuple[str, ...] = DEFAULT_CONTENDERS) -> dict:
    data = json.loads(path.read_text())
    assert {"world_size", "link", "runs"} <= data.keys()
    assert data["world_size"] == world_size
    assert data["link"] == "loopback"
    assert [r["name"] for r in data["runs"]] == list(contenders)
    for run in data["runs"]:
        assert run.keys() >= RUN_KEYS, run
        assert run["median_step_ms"] > 0 and run["tokens_per_s"] > 0
        lo, hi = run["spread_ms"]
        assert lo <= run["median_step_ms"] <= hi
        if memory:  # from a fresh world running only this contender
            assert run["peak_mem_bytes"] > 0, run
            # what training added: above the pre-build RSS, below the whole process's peak
            assert 0 < run["train_mem_bytes"] < run["peak_mem_bytes"], run
            assert run["train_mem_range_bytes"] == [run["train_mem_bytes"]] * 2, run  # one world
        else:
            assert run["peak_mem_bytes"] is None and run["train_mem_bytes"] is None, run
        eff = run.get("overlap_efficiency")
        if run["name"] == "overlap" and world_size > 1:
            assert eff is not None and 0.0 <= eff <= 1.0, run  # from overlap's own trace
        else:
            assert eff is None, run  # world size 1 moves no bytes; others have no trace
    return data


# ---------------------------------------------------------------------------------------------
# tiny real runs


@pytest.mark.parametrize("model", ["gpt", "w1"])
def test_bench_step_scaling_run(model: str, tmp_path: Path) -> None:
    out = tmp_path / f"{model}.json"
    stdout = run_python(
        "-m", "overlap", "bench", "step", "--model", model, *TINY, *TINY_RUN,
        "--nproc", "1,2", "--json", str(out), "--no-memory",
    )  # fmt: skip
    assert "not measured (--no-memory)" in stdout
    for n in (1, 2):
        data = check_report(tmp_path / f"{model}.n{n}.json", n, memory=False)
        assert data["config"]["model"] == model
    assert not out.exists()  # several world sizes: one suffixed file each
    assert "scaling: global tokens/s" in stdout
    table = stdout[stdout.index("scaling: global tokens/s") :].splitlines()
    assert "n=1" in table[1] and "n=2" in table[1]
    for name in DEFAULT_CONTENDERS:
        row = next(line for line in table if line.startswith(name + " "))
        assert "(1.00x)" in row, row  # world size 1 is the reference
    assert "WARNING" not in stdout, stdout  # parity held for every data-parallel contender


def test_step_w1_script(tmp_path: Path) -> None:
    """The script with the memory pass: a fresh world per contender, so three contenders (each
    library's sharding and DDP's replicas; every default contender runs in the tests above)."""
    out = tmp_path / "w1.json"
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    contenders = ("overlap", "fsdp2", "ddp")
    stdout = run_python(
        "benchmarks/step_w1.py", *TINY, "--ff", "64", *TINY_RUN, "--world-size", "2",
        "--contenders", ",".join(contenders), "--json", str(out), tmpdir=scratch,
    )  # fmt: skip
    # overlap's trace folders (one per rank and world) are removed when the ranks exit
    assert not list(scratch.glob("overlap-bench-trace-*")), list(scratch.iterdir())
    check_report(out, 2, memory=True, contenders=contenders)  # a single world size: PATH itself
    assert "peak RSS = the OS's high-water mark (VmHWM) of a fresh world running only that contender" in stdout
    assert "W1 step: 1 x TransformerEncoderLayer(d=32, ff=64)" in stdout
    assert "overlap/fsdp2 = " in stdout
    assert "scaling" not in stdout


@pytest.mark.timeout(DEEPSPEED_BUILD_S + RUN_TIMEOUT_S)
def test_bench_step_peers(tmp_path: Path, deepspeed_op: float) -> None:
    """Every peer in one run with overlap's int8 codec, named in the JSON; exact ones pass the
    parity guard, lossy ones report their difference without a warning."""
    out = tmp_path / "peers.json"
    int8 = "grad_compression=int8,error_feedback=True"
    stdout = run_python(
        "-m", "overlap", "bench", "step", "--model", "gpt", *TINY, *TINY_RUN, "--no-memory",
        "--contenders", ",".join(("overlap", "ddp", *peers.PEERS)), "--overlap-config", int8,
        "--json", str(out),
    )  # fmt: skip
    runs = {r["name"]: r for r in json.loads(out.read_text())["runs"]}
    assert list(runs) == ["overlap", f"overlap[{int8}]", "ddp", *peers.PEERS]
    for run in runs.values():
        assert run.keys() >= RUN_KEYS and run["median_step_ms"] > 0, run
        assert run["state_bytes"] > 0, run
    assert "WARNING" not in stdout, stdout
    for name in ("overlap", *peers.DEEPSPEED_PEERS):
        assert f"parity ok: {name} loss at step 1" in stdout, stdout
        assert runs[name]["lossy"] is False and runs[name]["parity_rel"] <= 1e-5
    for name in (f"overlap[{int8}]", *peers.DDP_HOOK_PEERS, "fsdp2-bf16reduce"):
        assert f"parity (lossy): {name} loss at step 1 differs from ddp by" in stdout, stdout
        assert runs[name]["lossy"] is True
    assert runs["deepspeed-tuned"]["settings"]["stage3_prefetch_bucket_size"] == int(0.9 * 32 * 32)
    assert runs["ddp-powersgd1"]["settings"]["start_powerSGD_iter"] == 2
    # accounted after PowerSGD's first compressed step: its error feedback counts
    assert runs["ddp-powersgd1"]["state_bytes"] > runs["ddp"]["state_bytes"]
    assert f"overlap[{int8}]/deepspeed-tuned = " in stdout
    assert "memory (state) overlap/deepspeed = " in stdout


# ---------------------------------------------------------------------------------------------
# pure pieces


def test_config_validation() -> None:
    assert StepBenchConfig().nproc == (2,)
    with pytest.raises(ValueError, match="contenders"):
        StepBenchConfig(contenders=("fsdp3",))
    with pytest.raises(ValueError, match="nproc"):
        StepBenchConfig(nproc=(2, 2))
    with pytest.raises(ValueError, match="nproc"):
        StepBenchConfig(nproc=(0,))
    with pytest.raises(ValueError, match="divisible"):
        StepBenchConfig(dim=30, heads=4)
    with pytest.raises(ValueError, match="key=value"):
        StepBenchConfig(overlap_configs=("prefetch_depth",))
    with pytest.raises(ValueError, match="memory_repeats"):
        StepBenchConfig(memory_repeats=0)


def test_memory_pass_takes_contenders_in_turn_and_medians(monkeypatch: pytest.MonkeyPatch) -> None:
    """--memory-repeats: one world per contender per repeat, in turn; medians and the range."""
    calls = []
    figures = {"ddp": [(900, 300), (910, 280), (950, 330)], "overlap": [(800, 200), (700, 100), (810, 210)]}

    def fake_world(fn, world_size, cfg, name, **kw):
        calls.append(name)
        return [figures[name][calls.count(name) - 1], None]

    monkeypatch.setattr(step, "run_local_world", fake_world)
    cfg = StepBenchConfig(contenders=("overlap", "ddp"), memory_repeats=3)
    peaks = step.measure_peaks(cfg, 2)
    assert calls == ["overlap", "ddp"] * 3
    assert peaks["ddp"] == step.Peaks(peak_bytes=910, train_bytes=300, train_range_bytes=(280, 330))
    assert peaks["overlap"] == step.Peaks(peak_bytes=800, train_bytes=200, train_range_bytes=(100, 210))


def test_parse_overrides() -> None:
    assert parse_overrides("prefetch_depth=2,param_dtype=bfloat16,x=none,y=True") == {
        "prefetch_depth": 2,
        "param_dtype": "bfloat16",
        "x": None,
        "y": True,
    }


def test_json_path_per_world_size() -> None:
    assert json_path_for("out/w1.json", 2, 1) == Path("out/w1.json")
    assert json_path_for("out/w1.json", 4, 3) == Path("out/w1.n4.json")


def _report(world_size: int, tokens_per_s: dict[str, float]) -> StepReport:
    runs = [
        StepRun(
            name=name,
            median_step_ms=1.0,
            spread_ms=(1.0, 1.0),
            tokens_per_s=tps,
            exposed_comm_ms=None,
            exposed_comm_estimated=False,
            peak_mem_bytes=1,
            state_bytes=1,
            parity_rel=None,
        )
        for name, tps in tokens_per_s.items()
    ]
    return StepReport(world_size=world_size, link="loopback", config=StepBenchConfig(), runs=runs)


def test_scaling_table_speedups() -> None:
    table = format_scaling([_report(4, {"ddp": 3000.0}), _report(1, {"ddp": 1000.0, "fsdp2": 500.0})]).splitlines()
    assert table[2].split() == ["contender", "n=1", "n=4"]
    assert table[4].split() == ["ddp", "1000", "(1.00x)", "3000", "(3.00x)"]
    assert table[5].split() == ["fsdp2", "500", "(1.00x)", "-"]
    assert table[6].split() == ["ideal", "(1.00x)", "(4.00x)"]
