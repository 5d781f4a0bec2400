"""benchmarks/gpu_check.py cannot rot while no GPU runs it: its `--device cpu` dry run runs every
part that can run on CPU (Triton under its interpreter; the 2-rank, 2x2, 3-rank and dp x tp worlds
on gloo with CPU tensors and `time.sleep` delays; the memory table; autotune under a tight cap;
the world-size-1 parts on gloo; tiny bandwidth rows) and writes the JSON the GPU run would; its
part runner records a crash or an overrun as that part's result, keeps what a part published
before it was cut, and goes on; its comparison tells bits from ulps. The compile part's driver
(benchmarks/gpu_compile.py) runs the compile checks without pytest and warms the numerics
part's exact kernel specializations, checked here as far as Triton compiles for sm_90 without a
GPU."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
COMPILE_SCRIPT = REPO / "benchmarks" / "gpu_compile.py"
RUN_TIMEOUT_S = 600
PARTS = ["compile", "numerics", "world2", "hsdp2x2", "world3", "tp2x2", "memory", "autotune", "nccl_path", "sync_free",
         "overlap", "parity", "bandwidth"]  # fmt: skip
WORLD_CONFIGS = {"plain", "bf16_no_sync", "int8_grads_ef", "int8_params", "fp16_scaler"}


def load_gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through it
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
    assert isinstance(api, dict) and "DeviceMesh._concatenate" in api and all(v.startswith("ok") for v in api.values()), api
    has_triton = importlib.util.find_spec("triton") is not None
    if os.environ.get("OVERLAP_REQUIRE_TRITON", "") not in ("", "0"):
        assert has_triton, "OVERLAP_REQUIRE_TRITON=1 but triton is not installed"
    if has_triton:  # the Triton the checks ran on is on record
        import triton

        assert env["triton"] == triton.__version__, env
    parts = {p["part"]: p for p in report["parts"]}
    assert list(parts) == PARTS
    for p in parts.values():
        assert p["seconds"] >= 0 and p["status"] not in ("error", "running"), p
    for key in ("compile", "sync_free", "overlap"):
        assert parts[key]["status"] == "skipped: no CUDA"

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
    rows = bandwidth["measured"]["rows"]
    ops = {r["op"] for r in rows}
    assert {"memcpy f32", "quantize int8", "dequant_acc int4", "feedback int8", "copy_out ws=8 bf16>bf16",
            "copy_in ws=2 bf16>f32"} <= ops, ops  # fmt: skip
    assert all(r["gbps"] > 0 and r["largest_size"] for r in rows)
    assert all(r["share_of_d2d_copy"] > 0 for r in rows if r["op"] != "memcpy f32")
    assert report["summary"].get("error") is None


def check_numerics(numerics: dict) -> None:
    assert numerics["status"] == "passed", numerics
    cases = numerics["measured"]["cases"]
    kinds = {name.split()[0] for name in cases}
    assert kinds == {"quantize", "dequant", "dequant_acc", "feedback", "feedback_int8res", "rows", "copy_out", "copy_in"}
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
    assert min(tp_scales[0]) < 2.0**10 and all(s == tp_scales[0] for s in tp_scales), tp_scales  # one tp shard overflowed

    memory = parts["memory"]
    assert memory["status"] == "measured", memory  # the allocator's peak: CUDA only
    rows = memory["measured"]["rows"]
    assert {(r["world"], r["config"]) for r in rows} >= {("world2", "plain"), ("world3", "fp16_scaler")}

    autotune = parts["autotune"]
    assert autotune["status"] == "passed", autotune
    a = autotune["measured"]
    assert a["limit_bytes"] == a["cap_bytes"] and a["peak_bytes"] <= a["cap_bytes"] and a["actions"]["baseline"] == 1, a


def test_part_errors_are_recorded_and_the_run_goes_on(tmp_path: Path) -> None:
    gc = load_gpu_check()
    out = tmp_path / "parts.json"
    check = gc.Check(torch.device("cpu"), gc.SIZES["cpu"], out)

    def crash(_c: object, _budget: float) -> tuple:
        raise RuntimeError("boom")

    def overrun(c: object, _budget: float) -> tuple:
        c.progress({"rows": [1, 2]})  # published before it was cut: kept
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # interrupted by the part's 5 s budget
            time.sleep(0.05)
        return "passed", "never", {}

    def after(c: object, _budget: float) -> tuple:
        written = json.loads(out.read_text())  # the earlier parts are on disk, and this one, running
        return "measured", "none", {"on_disk": [(p["part"], p["status"]) for p in written["parts"]]}

    parts = [gc.Part("x", crash, 60), gc.Part("y", overrun, 5), gc.Part("z", after, 60),
             gc.Part("w", after, 60, cuda_only=True)]  # fmt: skip
    start = time.monotonic()
    gc.run_parts(check, parts, 120.0)
    assert time.monotonic() - start < 40  # the overrun was cut at its budget
    on_disk = json.loads(out.read_text())
    assert on_disk == json.loads(json.dumps(check.report, default=str))
    x, y, z, w = on_disk["parts"]
    assert x["status"] == "error" and "RuntimeError: boom" in x["error"]
    assert y["status"] == "error" and "PartTimeout" in y["error"] and y["budget_s"] == 5.0
    assert y["measured"] == {"rows": [1, 2]}
    assert z["status"] == "measured" and z["measured"]["on_disk"] == [["x", "error"], ["y", "error"], ["z", "running"]]
    assert w["status"] == "skipped: no CUDA"


def test_compare_tells_bits_from_ulps() -> None:
    gc = load_gpu_check()
    nan, inf = float("nan"), float("inf")
    want = torch.tensor([1.0, -0.0, nan, inf, 3.0])
    same = gc.compare(want.clone(), want)
    assert same["bitwise"] and same["exact_bits"] and same["max_ulp"] == 0
    other_nan = want.clone().view(torch.int32)
    other_nan[2] = 0x7FFFFFFF  # the GPU's canonical NaN: still NaN, other bits
    loose = gc.compare(other_nan.view(torch.float32), want)
    assert loose["bitwise"] and not loose["exact_bits"]
    near = gc.compare(torch.tensor([1.0, 0.0, nan, inf, torch.nextafter(torch.tensor(3.0), torch.tensor(4.0)).item()]), want)
    assert not near["bitwise"] and near["mismatches"] == 2 and near["max_ulp"] == 1  # +0 vs -0: 1 ulp
    assert gc.classify({"out": near}) == "within_1_ulp"
    lost = gc.compare(torch.tensor([1.0, -0.0, -0.0, inf, 3.0]).bfloat16(), want.bfloat16())  # NaN -> -0.0
    assert lost["nan_mismatches"] == 1 and gc.classify({"out": lost}) == "differs"
    codes = gc.compare(torch.tensor([1, 2, 4], dtype=torch.int8), torch.tensor([1, 3, 4], dtype=torch.int8))
    assert codes["mismatches"] == 1 and codes["max_code_diff"] == 1 and gc.classify({"codes": codes}) == "within_1_ulp"


def test_runtime_layouts() -> None:
    """The copy layouts the numerics and bandwidth parts build: tagged from 2 ranks on (row stride
    = shard + tag columns), the used flags after the gradients. (That they are what the runtime
    issues is checked in the dry run: `layout_mirror`.)"""
    gc = load_gpu_check()
    layout = gc.numerics_layout(2)
    sizes, cols, tag = gc.runtime_copy_out_layout(layout, 2)
    assert tag == gc.TAG_NUMEL and sum(sizes) == 2 * (layout.shard_numel + tag) and cols[-1] == tag
    assert gc.runtime_copy_out_layout(layout, 1)[2] == 0  # world size 1 is untagged
    in_sizes, _ = gc.runtime_copy_in_layout(layout, 2)
    # the used flags padded to the chunk alignment: every row stays a multiple of 16 elements
    assert sum(in_sizes) == 2 * (layout.grad_shard_numel + gc.flag_cols(len(layout.grad_slots)))
    assert (layout.shard_numel + tag) % gc.CHUNK_ALIGN_NUMEL == 0
    job = gc.copy_job("out", layout, 2, torch.float32, torch.bfloat16, torch.Generator().manual_seed(0))
    plan = job.plan()
    assert plan["row_stride"] == layout.shard_numel + tag and plan["segments"] == len(layout.slots) + 1


def test_patches_are_undone() -> None:
    """The delays and the event-wait counter replace library and torch functions for a while
    only: after the context, the originals are back (a later part or config sees none of them)."""
    from collections import Counter

    gc = load_gpu_check()
    originals = [gc._comm.wait, gc._comm.all_gather_flat, gc._Runtime.free, gc._Runtime.release_reduce]
    counts: Counter = Counter()
    with gc.injected_delays(torch.device("cpu"), counts, seed=0):
        assert gc._comm.wait is not originals[0] and gc._Runtime.free is not originals[2]
    assert [gc._comm.wait, gc._comm.all_gather_flat, gc._Runtime.free, gc._Runtime.release_reduce] == originals
    synchronize = torch.cuda.Event.synchronize
    waits: list[float] = []
    with gc.counted_event_waits(waits):
        assert torch.cuda.Event.synchronize is not synchronize
    assert torch.cuda.Event.synchronize is synchronize and waits == []


def test_compile_part_runs_every_variant_once_over_its_processes(monkeypatch) -> None:
    """The compile part (first on a GPU machine) starts benchmarks/gpu_compile.py once per process:
    process 0 runs the file's other checks, the others share the variants, each exactly once.
    Checked without compiling: Popen is faked; one process's failed check fails the part."""
    pytest.importorskip("triton")
    gc = load_gpu_check()
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

    monkeypatch.setattr(gc.subprocess, "Popen", FakePopen)
    monkeypatch.setattr(gc, "COMPILE_PROCESSES", 3)
    monkeypatch.setattr(gc.os, "cpu_count", lambda: 16)
    status, _bar, measured = gc.part_compile(gc.Check(torch.device("cpu"), gc.SIZES["cpu"], Path("/dev/null")), 20)
    assert status == "failed" and measured["processes"] == 3 and measured["triton"], measured
    assert measured["checks_passed"] == 3 and list(measured["checks_failed"]) == ["test_kernel_compiles[x]"]
    assert measured["warm_cases"] == 15 and measured["warm_compiled"] == 12
    assert [cmd[-1] for cmd, _ in calls] == ["0/3", "1/3", "2/3"]
    assert all(Path(cmd[1]) == COMPILE_SCRIPT and "pytest" not in cmd for cmd, _ in calls)
    assert all(cmd[cmd.index("--warm") + 1] == "none" for cmd, _ in calls)  # a CPU check warms nothing
    assert not any(interpreted for _, interpreted in calls)  # the real compiler, never the interpreter
    monkeypatch.syspath_prepend(str(REPO / "tests"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    compile_test = importlib.import_module("test_triton_compile")
    names = []
    for index in range(1, 3):  # the processes' shares, as gpu_compile.py sets them
        monkeypatch.setenv("OVERLAP_COMPILE_SHARD", f"{index - 1}/2")
        names += [v.name for v in compile_test._shard(compile_test.VARIANTS)]
    assert sorted(names) == sorted(v.name for v in compile_test.VARIANTS)


def _compile_script(args: list[str], env: dict[str, str] | None = None, hide_pytest: bool = False) -> dict:
    """benchmarks/gpu_compile.py in a fresh process (pytest hidden from it: `hide_pytest`)."""
    run = f"import runpy, sys; sys.argv = {[str(COMPILE_SCRIPT), *args]!r}; "
    if hide_pytest:  # as on a machine without pytest: find_spec says so, an import fails
        run += ("import importlib.util as u; find = u.find_spec; "
                "u.find_spec = lambda name, *a: None if name.split('.')[0] == 'pytest' else find(name, *a); "
                "sys.modules['pytest'] = None; ")  # fmt: skip
    run += f"runpy.run_path({str(COMPILE_SCRIPT)!r}, run_name='__main__')"
    full_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | (env or {})
    proc = subprocess.run([sys.executable, "-c", run], cwd=REPO, env=full_env, capture_output=True, text=True,
                          timeout=600, check=False)  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return {"rc": proc.returncode, **json.loads(lines[-1])}


@pytest.mark.parametrize("pytest_installed", [False, True])
def test_compile_checks_run_without_pytest(monkeypatch, pytest_installed: bool) -> None:
    """Where pytest is not installed, the driver imports tests/test_triton_compile.py with a
    stand-in, and where it is, as it is; either way it calls every check itself: each
    parametrized case, monkeypatch given. A share of the variants and the file's other checks
    all pass."""
    pytest.importorskip("triton")
    args = ["--shard", "1/60", "--checks", "all", "--warm", "none"]
    result = _compile_script(args, hide_pytest=not pytest_installed)
    checks = result["checks"]
    assert checks["pytest"] == ("installed" if pytest_installed else "stand-in"), checks
    assert result["rc"] == 0 and not checks["failed"] and not checks["skipped"], checks
    passed = set(checks["passed"])
    monkeypatch.syspath_prepend(str(REPO / "tests"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    share = importlib.import_module("test_triton_compile").VARIANTS[0::59]  # process 1 of 60: variant share 0 of 59
    assert {n for n in passed if n.startswith("test_kernel_compiles[")} == {f"test_kernel_compiles[{v.name}]" for v in share}
    assert {f"test_fp8_rejected_exactly_where_dispatch_falls_back[{a}]" for a in (80, 86, 89, 90)} <= passed
    assert {"test_fusion_check_can_fail", "test_every_launch_uses_the_launch_options_under_the_tensors_device"} <= passed
    assert sum(name.startswith("test_row_kernels_vectorize_on_aligned_sizes[") for name in passed) == 5


def test_warm_up_compiles_the_numerics_launches_into_the_cache(tmp_path: Path) -> None:
    """[Note: warm Triton cache]: the numerics part's own cases, with the kernels warm-only,
    compile through Triton's launcher (for sm_90 here: no GPU) into the on-disk cache, and a second
    process that builds the same cases finds every kernel there: the keys are the launcher's,
    computed from the same arguments as the numerics part's launches."""
    pytest.importorskip("triton")
    env = {"TRITON_CACHE_DIR": str(tmp_path / "cache")}
    args = ["--shard", "0/1", "--checks", "none", "--warm", "sm90", "--only", "int8", "--limit", "3"]
    first = _compile_script(args, env)
    warm = first["warm"]
    assert first["rc"] == 0 and warm["cases"] == 3 and warm["compiled"] >= 3 and not warm["errors"], warm
    entries = {p.name for p in (tmp_path / "cache").iterdir()}
    cubins = list((tmp_path / "cache").glob("*/*.cubin"))
    assert entries and len(cubins) == len(entries), entries  # each a kernel compiled to a cubin
    second = _compile_script(args, env)
    assert second["warm"]["compiled"] == warm["compiled"] and not second["warm"]["errors"]
    assert {p.name for p in (tmp_path / "cache").iterdir()} == entries  # all found: no new compile


def test_compile_driver_reports_each_case(monkeypatch) -> None:
    """The driver's verdicts without compiling: each parametrized case passes or fails on its
    own (a failure is kept with its traceback, the exit code says it), a test that needs a fixture
    the driver does not give is skipped by name, monkeypatch's changes are undone."""
    import types

    spec = importlib.util.spec_from_file_location("gpu_compile_under_test", COMPILE_SCRIPT)
    assert spec is not None and spec.loader is not None
    driver = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(driver)
    stand_in = driver._pytest_stand_in()
    target = types.SimpleNamespace(value=1)

    @stand_in.mark.parametrize("n", [1, 2, 3], ids=["one", "two", "three"])
    def test_even_fails(n: int) -> None:
        assert n % 2, f"{n} is even"

    def test_patches(monkeypatch) -> None:
        monkeypatch.setattr(target, "value", 2)
        assert target.value == 2

    def test_needs_tmp_path(tmp_path) -> None:
        raise AssertionError("never called")

    fake = types.ModuleType("fake_compile_checks")
    fake.test_even_fails, fake.test_patches, fake.test_needs_tmp_path = test_even_fails, test_patches, test_needs_tmp_path
    monkeypatch.setattr(driver, "load_compile_checks", lambda: fake)
    out = driver.run_checks("all")
    assert out["passed"] == ["test_even_fails[one]", "test_even_fails[three]", "test_patches"], out
    assert list(out["failed"]) == ["test_even_fails[two]"] and "2 is even" in out["failed"]["test_even_fails[two]"]
    assert list(out["skipped"]) == ["test_needs_tmp_path"] and target.value == 1
    assert driver.run_checks("variants")["passed"] == []  # only test_kernel_compiles, which this file lacks


def test_plain_step_bytes_runs_on_the_world_model(monkeypatch) -> None:
    """The memory part's yardstick (CUDA only in the run): one unwrapped step of the worlds' model,
    whose `unused` and `probe` get no gradient, measured by the allocator (faked here)."""
    gc = load_gpu_check()
    allocated = iter([1000, 5000])  # before, then the peak
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: next(allocated))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: next(allocated))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    sizes = gc.SIZES["cpu"]
    model = gc.build_world_model(sizes, torch.device("cpu"))
    out = gc.plain_step_bytes(model, gc.make_input(sizes, torch.device("cpu")), torch.device("cpu"))
    assert out == {"step_peak_bytes": 4000, "param_bytes": sum(4 * p.numel() for p in model.parameters())}
