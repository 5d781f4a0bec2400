"""The GPU checks (tests/gpu, run by benchmarks/gpu_check.py) cannot rot while no GPU runs them:
the `--device cpu` dry run runs every part that can run on CPU (Triton under its interpreter; the
2-rank, 2x2, 3-rank and dp x tp worlds on gloo with CPU tensors and `time.sleep` delays; the
memory table; autotune under a tight cap; the world-size-1 parts on gloo; tiny bandwidth rows)
and writes the JSON the GPU run would. The runner records a crash or an overrun as that part's
result, keeps what a part published before it was cut, goes on, and ends a part stuck past the
watchdog; the comparison tells bits from ulps. The compile part's workers
(tests/gpu/helpers/compile_worker.py) run the compile checks and warm the numerics part's exact
kernel specializations, checked here as far as Triton compiles for sm_90 without a GPU."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from types import ModuleType

import pytest
import torch
from gpu.helpers import compare, compile_worker, copies, delays, internals, world_dp
from gpu.helpers.common import SIZES, build_world_model, make_input
from gpu.parts import CPU_BUDGET_SCALE, PARTS

pytestmark = pytest.mark.slow  # spawns worlds or runs a command end to end: `-m 'not slow'` leaves it out

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
RUN_TIMEOUT_S = 600
WORLD_CONFIGS = {"plain", "bf16_no_sync", "int8_grads_ef", "int8_params", "fp16_scaler"}


def load_runner() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check_runner", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_compile_checks(monkeypatch) -> ModuleType:
    """test_triton_compile.py as a module, compiled (never interpreted)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    spec = importlib.util.spec_from_file_location("triton_compile_checks", compile_worker.compile_checks_file())
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dry_run(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(out)],
        cwd=REPO, check=False, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
    )  # fmt: skip
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    report = json.loads(out.read_text())
    env = report["environment"]
    assert env["env"]["OVERLAP_FORCE_COLLECTIVES"] == "1" and env["TRITON_INTERPRET"] == "1"
    assert env["torch"] == torch.__version__
    api = env["torch_private_api"]  # the private torch APIs, probed on this torch
    assert (
        isinstance(api, dict) and "DeviceMesh._concatenate" in api and all(v.startswith("ok") for v in api.values())
    ), api
    has_triton = importlib.util.find_spec("triton") is not None
    if os.environ.get("OVERLAP_REQUIRE_TRITON", "") not in ("", "0"):
        assert has_triton, "OVERLAP_REQUIRE_TRITON=1 but triton is not installed"
    if has_triton:  # the Triton the checks ran on is on record
        import triton

        assert env["triton"] == triton.__version__, env
    parts = {p["part"]: p for p in report["parts"]}
    assert list(parts) == list(PARTS)
    for p in parts.values():
        assert p["seconds"] >= 0 and p["status"] not in ("error", "running", "failed"), p
        assert p["budget_s"] == PARTS[p["part"]].budget_s * CPU_BUDGET_SCALE, p
    for key in ("compile", "sync_free", "overlap"):
        assert parts[key]["status"] == "skipped: no CUDA"
    assert report["summary"] == dict(Counter(p["status"].split(":")[0] for p in report["parts"]))

    numerics = parts["numerics"]
    if has_triton:
        check_numerics(numerics)
    else:
        assert numerics["status"] == "skipped: triton is not installed", numerics
    check_worlds(parts)

    a = parts["nccl_path"]["measured"]
    assert a["backend"] == "gloo" and a["OVERLAP_FORCE_COLLECTIVES"] == "1"
    # OVERLAP_FORCE_COLLECTIVES makes world size 1 issue real collectives: counted
    assert parts["nccl_path"]["status"] == "passed" and a["collectives_per_step"] > 0, a

    parity = parts["parity"]
    assert parity["status"] == "passed" and parity["measured"]["bitwise"], parity  # CPU, fp32, SGD
    assert parity["measured"]["params"]["worst_abs_diff"] == 0.0

    bandwidth = parts["bandwidth"]
    assert bandwidth["status"] == "measured" and not bandwidth["measured"]["errors"], bandwidth
    assert bandwidth["bar"].endswith("(CUDA only)")
    rows = bandwidth["measured"]["rows"]
    ops = {r["op"] for r in rows}
    assert {"memcpy f32", "quantize int8", "dequant_acc int4", "feedback int8", "copy_out ws=8 bf16>bf16",
            "copy_in ws=2 bf16>f32"} <= ops, ops  # fmt: skip
    assert all(r["gbps"] > 0 and r["largest_size"] for r in rows)
    assert all(r["share_of_d2d_copy"] > 0 for r in rows if r["op"] != "memcpy f32")


def check_numerics(numerics: dict) -> None:
    assert numerics["status"] == "passed", numerics
    cases = numerics["measured"]["cases"]
    kinds = {name.split()[0] for name in cases}
    assert kinds == {
        "quantize",
        "dequant",
        "dequant_acc",
        "feedback",
        "feedback_int8res",
        "rows",
        "copy_out",
        "copy_in",
    }
    for ws in (1, 2, 8):  # the runtime's layouts, tagged from 2 ranks on
        assert f"copy_out ws={ws} bf16>f32" in cases and f"copy_in ws={ws} f16>bf16" in cases
    assert "tags" in cases["copy_out ws=2 f32>f32"] and "tags" not in cases["copy_out ws=1 f32>f32"]
    assert any(" sr " in name for name in cases) and all(c["class"] == "bitwise" for c in cases.values())
    plans = numerics["measured"]["plans"]
    assert set(plans) == {f"copy_{k} ws={n}" for k in ("out", "in") for n in (1, 2, 8)}
    # untagged, the padded chunks take the vector branch, as the runtime's do
    assert any(launch["aligned_segments"] for launch in plans["copy_out ws=1"]["launches"]), plans["copy_out ws=1"]
    assert numerics["measured"]["skipped"]  # fp8 (the interpreter's cast)


def check_worlds(parts: dict) -> None:
    for key, nproc, configs in (("world2", 2, WORLD_CONFIGS), ("hsdp2x2", 4, WORLD_CONFIGS),
                                ("world3", 3, {"plain", "int8_grads_ef", "fp16_scaler"})):  # fmt: skip
        world = parts[key]
        assert world["status"] == "passed", world
        measured = world["measured"]
        assert measured["probe"]["overrides"] == {"reduce_scatter_impl": "native", "all_gather_impl": "native"}
        assert set(measured["configs"]) == configs
        for name, config in measured["configs"].items():
            assert config["ok"] and len(config["ranks"]) == nproc, (key, name, config)
            for rank in config["ranks"].values():
                assert rank["bitwise_delayed"], (key, name, rank)
                assert all(rank["delays"].get(k, 0) > 0 for k in
                           ("before_collective", "after_wait", "before_free", "before_release_reduce")), rank  # fmt: skip
                assert rank["memory"]["library_peak_bytes"] > rank["memory"]["sharded_param_bytes"] > 0, rank
        scales = [r["scales"] for r in measured["configs"]["fp16_scaler"]["ranks"].values()]
        # the overflow in one rank's shard: every rank skipped alike (the scale halved everywhere)
        assert len(scales[0]) == 3 and min(scales[0]) < 2.0**16 and all(s == scales[0] for s in scales), scales
        plain = measured["configs"]["plain"]["ranks"]
        if nproc == 3:  # the backend's summation order: within fp32 rounding of the reference
            assert all(r["close_vs_reference"] for r in plain.values()), plain
            continue
        assert all(r["bitwise_vs_reference"] and r["vs_reference"]["bitwise"] for r in plain.values())
        assert {p["kind"] for p in plain["0"]["copy_plans"]} == {"copy_out", "copy_in"}
        assert all(p["num_rows"] == 2 for p in plain["0"]["copy_plans"])  # the shard group
        # the layouts numerics and bandwidth build are the ones this runtime issued
        assert plain["0"]["layout_mirror"]["matches"], plain["0"]["layout_mirror"]
    assert parts["hsdp2x2"]["measured"]["configs"]["plain"]["ranks"]["0"]["stats"]["num_allreduces"] > 0  # HSDP's

    tp = parts["tp2x2"]
    assert tp["status"] == "passed", tp
    assert set(tp["measured"]["configs"]) == {"plain", "fp16_scaler"}
    for rank in tp["measured"]["configs"]["plain"]["ranks"].values():
        assert rank["close_vs_reference"] and rank["bitwise_delayed"] and rank["delays"]["before_collective"] > 0, rank
    tp_scales = [r["scales"] for r in tp["measured"]["configs"]["fp16_scaler"]["ranks"].values()]
    assert min(tp_scales[0]) < 2.0**10 and all(s == tp_scales[0] for s in tp_scales), (
        tp_scales
    )  # one tp shard overflowed

    memory = parts["memory"]
    assert memory["status"] == "measured", memory  # the allocator's peak: CUDA only
    rows = memory["measured"]["rows"]
    assert {(r["world"], r["config"]) for r in rows} >= {("world2", "plain"), ("world3", "fp16_scaler")}

    autotune = parts["autotune"]
    assert autotune["status"] == "passed", autotune
    a = autotune["measured"]
    assert a["limit_bytes"] == a["cap_bytes"] and a["peak_bytes"] <= a["cap_bytes"] and a["actions"]["baseline"] == 1, a


FAKE_PARTS = """
import time
import pytest

pytestmark = pytest.mark.cuda


@pytest.mark.part("x")
def test_crash(device, record):
    raise RuntimeError("boom")


@pytest.mark.part("y", budget_s=2.5)
def test_overrun(device, record):
    record.progress({"rows": [1, 2]})  # published before it was cut: kept
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # interrupted at the part's budget
        time.sleep(0.05)


@pytest.mark.part("z")
def test_after(device, record):
    record.bar = "none"
    written = __import__("json").loads(open(__import__("os").environ["OVERLAP_GPU_REPORT"]).read())
    record.progress({"on_disk": [(p["part"], p["status"]) for p in written["parts"]]})
    record.unjudged("no bar here")


@pytest.mark.part("v")
def test_missed_bar(device, record):
    record.bar = "1 == 2"
    assert 1 == 2, "the bar missed"


@pytest.mark.part("w", cuda_only=True)
def test_cuda_only(device, record):
    raise AssertionError("never runs on the CPU")


@pytest.mark.part("never")
def test_left_out(device, record):
    raise AssertionError("left out by --only: never runs")
"""


def test_runner_records_each_outcome(tmp_path: Path) -> None:
    """Fake parts under the GPU checks' conftest, run by the runner: a crash is an error, an
    overrun is cut at its budget with what it published kept, a later part finds the earlier ones
    on disk, a missed bar is a result, a CUDA-only part skips, a part left out by --only never
    runs."""
    folder = tmp_path / "fake"
    folder.mkdir()
    (folder / "conftest.py").write_text(
        "from gpu.conftest import *  # noqa: F403  the GPU checks' hooks and fixtures\n"
    )
    (folder / "test_fake_parts.py").write_text(FAKE_PARTS)
    out = tmp_path / "parts.json"
    start = time.monotonic()
    report = load_runner().run_checks(out, "cpu", ["x", "y", "z", "v", "w"], paths=[folder])
    assert time.monotonic() - start < 120  # the overrun cut at 5 s (2.5 s x the dry run's scale)
    on_disk = json.loads(out.read_text())
    assert on_disk == json.loads(json.dumps(report, default=str))
    x, y, z, v, w = on_disk["parts"]
    assert x["status"] == "error" and "RuntimeError: boom" in x["error"] and "boom" in x["traceback"]
    assert y["status"] == "error" and "ran past its budget of 5 s" in y["error"] and y["budget_s"] == 5.0
    assert y["measured"] == {"rows": [1, 2]} and 4.5 < y["seconds"] < 60
    assert z["status"] == "measured" and z["bar"] == "none (no bar here)"
    assert z["measured"]["on_disk"] == [["x", "error"], ["y", "error"], ["z", "running"]]
    assert v["status"] == "failed" and "the bar missed" in v["failure"] and v["bar"] == "1 == 2"
    assert w["status"] == "skipped: no CUDA"
    assert on_disk["summary"] == {"error": 2, "measured": 1, "failed": 1, "skipped": 1}


def test_watchdog_ends_a_part_stuck_past_its_budget(tmp_path: Path) -> None:
    """A part stuck where its timeout cannot reach (in a C++ call) stays "running" in the report:
    the watchdog stops the run `grace_s` past that part's budget, and the whole run past its own
    deadline. Here the checks are a process that sleeps, beside a report that says so."""
    runner = load_runner()
    out = tmp_path / "stuck.json"
    out.write_text(json.dumps({"parts": [{"part": "a", "status": "passed", "budget_s": 0.1},
                                         {"part": "stuck", "status": "running", "budget_s": 0.5}]}))  # fmt: skip
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = time.monotonic()
        assert runner.watch(sleeper, out, 60, 0.5) == "watchdog: stuck ran 0.5 s past its budget of 0.5 s"
        assert time.monotonic() - start < 30
        out.write_text(json.dumps({"parts": []}))
        assert runner.watch(sleeper, out, 1.0, 0.5) == "watchdog: the run went past 1 s"
    finally:
        sleeper.kill()
        sleeper.wait()
    assert runner.watch(sleeper, out, 60, 0.5) is None  # the checks ended on their own


def test_without_a_gpu_the_checks_skip(tmp_path: Path) -> None:
    """Outside the dry run, on a machine without CUDA, every check skips and says why."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the checks run")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OVERLAP_GPU_")} | {
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"
    }
    cmd = [sys.executable, "-m", "pytest", str(REPO / "tests" / "gpu"), "-q", "-rs", "-p", "pytest_timeout", "-p", "no:cacheprovider",
           "-o", "addopts="]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:]
    reasons = [line for line in proc.stdout.splitlines() if line.startswith("SKIPPED") and "needs a CUDA GPU" in line]
    assert f"{len(PARTS)} skipped" in proc.stdout and len(reasons) == len(PARTS), proc.stdout[-3000:]


def test_device_selection(monkeypatch) -> None:
    """OVERLAP_GPU_DEVICE picks the device: cpu is the dry run, cuda insists on a GPU; unset, a
    GPU where there is one, else none (the checks skip)."""
    from gpu.conftest import selected_device

    for has_cuda in (False, True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda has_cuda=has_cuda: has_cuda)
        monkeypatch.delenv("OVERLAP_GPU_DEVICE", raising=False)
        assert selected_device() == (torch.device("cuda", 0) if has_cuda else None)
        monkeypatch.setenv("OVERLAP_GPU_DEVICE", "cpu")
        assert selected_device() == torch.device("cpu")
        monkeypatch.setenv("OVERLAP_GPU_DEVICE", "cuda")
        if has_cuda:
            assert selected_device() == torch.device("cuda", 0)
        else:
            with pytest.raises(pytest.UsageError, match="CUDA is not available"):
                selected_device()
    monkeypatch.setenv("OVERLAP_GPU_DEVICE", "gpu")
    with pytest.raises(pytest.UsageError, match="use cuda or cpu"):
        selected_device()


def test_compare_tells_bits_from_ulps() -> None:
    nan, inf = float("nan"), float("inf")
    want = torch.tensor([1.0, -0.0, nan, inf, 3.0])
    same = compare.compare(want.clone(), want)
    assert same["bitwise"] and same["exact_bits"] and same["max_ulp"] == 0
    other_nan = want.clone().view(torch.int32)
    other_nan[2] = 0x7FFFFFFF  # the GPU's canonical NaN: still NaN, other bits
    loose = compare.compare(other_nan.view(torch.float32), want)
    assert loose["bitwise"] and not loose["exact_bits"]
    near = compare.compare(
        torch.tensor([1.0, 0.0, nan, inf, torch.nextafter(torch.tensor(3.0), torch.tensor(4.0)).item()]), want
    )
    assert not near["bitwise"] and near["mismatches"] == 2 and near["max_ulp"] == 1  # +0 vs -0: 1 ulp
    assert compare.classify({"out": near}) == "within_1_ulp"
    lost = compare.compare(torch.tensor([1.0, -0.0, -0.0, inf, 3.0]).bfloat16(), want.bfloat16())  # NaN -> -0.0
    assert lost["nan_mismatches"] == 1 and compare.classify({"out": lost}) == "differs"
    codes = compare.compare(torch.tensor([1, 2, 4], dtype=torch.int8), torch.tensor([1, 3, 4], dtype=torch.int8))
    assert (
        codes["mismatches"] == 1
        and codes["max_code_diff"] == 1
        and compare.classify({"codes": codes}) == "within_1_ulp"
    )


def test_runtime_layouts() -> None:
    """The copy layouts the numerics and bandwidth parts build: tagged from 2 ranks on (row stride
    = shard + tag columns), the used flags after the gradients. (That they are what the runtime
    issues is checked in the dry run: `layout_mirror`.)"""
    layout = copies.numerics_layout(2)
    sizes, cols, tag = copies.runtime_copy_out_layout(layout, 2)
    assert tag == internals.TAG_NUMEL and sum(sizes) == 2 * (layout.shard_numel + tag) and cols[-1] == tag
    assert copies.runtime_copy_out_layout(layout, 1)[2] == 0  # world size 1 is untagged
    in_sizes, _ = copies.runtime_copy_in_layout(layout, 2)
    # the used flags padded to the chunk alignment: every row stays a multiple of 16 elements
    assert sum(in_sizes) == 2 * (layout.grad_shard_numel + internals.flag_cols(len(layout.grad_slots)))
    assert (layout.shard_numel + tag) % internals.CHUNK_ALIGN_NUMEL == 0
    job = copies.copy_job("out", layout, 2, torch.float32, torch.bfloat16, torch.Generator().manual_seed(0))
    plan = job.plan()
    assert plan["row_stride"] == layout.shard_numel + tag and plan["segments"] == len(layout.slots) + 1


def test_patches_are_undone() -> None:
    """The delays and the event-wait counter replace library and torch functions for a while
    only: after the context, the originals are back (a later part or config sees none of them)."""
    comm, runtime = internals.comm, internals.Runtime
    originals = [comm.wait, comm.all_gather_flat, runtime.free, runtime.release_reduce]
    counts: Counter = Counter()
    with delays.injected_delays(torch.device("cpu"), counts, seed=0):
        assert comm.wait is not originals[0] and runtime.free is not originals[2]
    assert [comm.wait, comm.all_gather_flat, runtime.free, runtime.release_reduce] == originals
    synchronize = torch.cuda.Event.synchronize
    waits: list[float] = []
    with delays.counted_event_waits(waits):
        assert torch.cuda.Event.synchronize is not synchronize
    assert torch.cuda.Event.synchronize is synchronize and waits == []


def test_plain_step_bytes_runs_on_the_world_model(monkeypatch) -> None:
    """The memory part's yardstick (CUDA only in the run): one unwrapped step of the worlds' model,
    whose `unused` and `probe` get no gradient, measured by the allocator (faked here)."""
    allocated = iter([1000, 5000])  # before, then the peak
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: next(allocated))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: next(allocated))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    sizes = SIZES["cpu"]
    model = build_world_model(sizes, torch.device("cpu"))
    out = world_dp.plain_step_bytes(model, make_input(sizes, torch.device("cpu")), torch.device("cpu"))
    assert out == {"step_peak_bytes": 4000, "param_bytes": sum(4 * p.numel() for p in model.parameters())}


def test_compile_part_runs_every_variant_once_over_its_processes(monkeypatch) -> None:
    """The compile part (first on a GPU machine) starts a compile worker per process: process 0
    runs the file's other checks, the others share the variants, each exactly once. Checked
    without compiling: Popen is faked; one process's failed check fails the part."""
    pytest.importorskip("triton")
    calls = []

    class FakePopen:
        def __init__(self, cmd: list, cwd: object, env: dict, **kwargs: object) -> None:
            calls.append((cmd, "TRITON_INTERPRET" in env))
            self.returncode = 1 if cmd[-1] == "2/3" else 0
            failed = {"test_kernel_compiles[x]": "AssertionError"} if self.returncode else {}
            self.out = json.dumps({"checks": {"passed": ["test_kernel_compiles[y]"], "failed": failed, "skipped": {}},
                                   "warm": {"cases": 5, "compiled": 4, "errors": {}}})  # fmt: skip

        def communicate(self, timeout: float | None = None) -> tuple:
            return f"some output\n{self.out}\n", ""

    monkeypatch.setattr(compile_worker.subprocess, "Popen", FakePopen)
    measured = compile_worker.compile_in_processes("none", 20, count=3)
    assert not measured["all_exited_0"] and measured["processes"] == 3, measured
    assert measured["checks_passed"] == 3 and list(measured["checks_failed"]) == ["test_kernel_compiles[x]"]
    assert measured["warm_cases"] == 15 and measured["warm_compiled"] == 12
    assert [cmd[-1] for cmd, _ in calls] == ["0/3", "1/3", "2/3"]
    assert all(cmd[1:3] == ["-m", "gpu.helpers.compile_worker"] for cmd, _ in calls)
    assert all(cmd[cmd.index("--warm") + 1] == "none" for cmd, _ in calls)  # a CPU check warms nothing
    assert not any(interpreted for _, interpreted in calls)  # the real compiler, never the interpreter
    compile_test = load_compile_checks(monkeypatch)
    names = []
    for index in range(1, 3):  # the processes' shares, as the worker sets them
        monkeypatch.setenv("OVERLAP_COMPILE_SHARD", f"{index - 1}/2")
        names += [v.name for v in compile_test._shard(compile_test.VARIANTS)]
    assert sorted(names) == sorted(v.name for v in compile_test.VARIANTS)


def run_worker(args: list[str], env: dict[str, str] | None = None) -> dict:
    """A compile worker in a fresh process, as the compile part starts it."""
    path = os.pathsep.join([str(REPO / "tests"), str(REPO)])
    full_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": path} | (env or {})
    proc = subprocess.run([sys.executable, "-m", "gpu.helpers.compile_worker", *args], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return {"rc": proc.returncode, **json.loads(lines[-1])}


def test_compile_worker_runs_its_share_of_the_checks(monkeypatch) -> None:
    """A worker runs test_triton_compile.py under pytest: its share of the variants and the
    file's other checks, each parametrized case on its own; all pass."""
    pytest.importorskip("triton")
    result = run_worker(["--shard", "1/60", "--checks", "all", "--warm", "none"])
    checks = result["checks"]
    assert result["rc"] == 0 and not checks["failed"] and not checks["skipped"], checks
    passed = set(checks["passed"])
    share = load_compile_checks(monkeypatch).VARIANTS[0::59]  # process 1 of 60: variant share 0 of 59
    assert {n for n in passed if n.startswith("test_kernel_compiles[")} == {
        f"test_kernel_compiles[{v.name}]" for v in share
    }
    assert {f"test_fp8_rejected_exactly_where_dispatch_falls_back[{a}]" for a in (80, 86, 89, 90)} <= passed
    assert {
        "test_fusion_check_can_fail",
        "test_every_launch_uses_the_launch_options_under_the_tensors_device",
    } <= passed
    assert sum(name.startswith("test_row_kernels_vectorize_on_aligned_sizes[") for name in passed) == 5


def test_compile_worker_reports_each_case(tmp_path: Path) -> None:
    """The worker's verdicts: each parametrized case passes, fails (kept with its traceback; the
    exit code says it) or skips on its own."""
    checks = tmp_path / "test_checks.py"
    checks.write_text(
        "import pytest\n\n"
        "@pytest.mark.parametrize('n', [1, 2, 3], ids=['one', 'two', 'three'])\n"
        "def test_even_fails(n):\n    assert n % 2, f'{n} is even'\n\n"
        "def test_skips():\n    pytest.skip('not here')\n"
    )  # fmt: skip
    result = run_worker(["--shard", "0/1", "--checks", "all", "--warm", "none", "--file", str(checks)])
    out = result["checks"]
    assert result["rc"] == 1 and out["passed"] == ["test_even_fails[one]", "test_even_fails[three]"], out
    assert list(out["failed"]) == ["test_even_fails[two]"] and "2 is even" in out["failed"]["test_even_fails[two]"]
    assert out["skipped"] == {"test_skips": "not here"}


def test_warm_up_compiles_the_numerics_launches_into_the_cache(tmp_path: Path) -> None:
    """[Note: warm Triton cache]: the numerics part's own cases, with the kernels warm-only,
    compile through Triton's launcher (for sm_90 here: no GPU) into the on-disk cache, and a second
    process that builds the same cases finds every kernel there: the keys are the launcher's,
    computed from the same arguments as the numerics part's launches."""
    pytest.importorskip("triton")
    env = {"TRITON_CACHE_DIR": str(tmp_path / "cache")}
    args = ["--shard", "0/1", "--checks", "none", "--warm", "sm90", "--only", "int8", "--limit", "3"]
    first = run_worker(args, env)
    warm = first["warm"]
    assert first["rc"] == 0 and warm["cases"] == 3 and warm["compiled"] >= 3 and not warm["errors"], warm
    entries = {p.name for p in (tmp_path / "cache").iterdir()}
    cubins = list((tmp_path / "cache").glob("*/*.cubin"))
    assert entries and len(cubins) == len(entries), entries  # each a kernel compiled to a cubin
    second = run_worker(args, env)
    assert second["warm"]["compiled"] == warm["compiled"] and not second["warm"]["errors"]
    assert {p.name for p in (tmp_path / "cache").iterdir()} == entries  # all found: no new compile
