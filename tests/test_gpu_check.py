"""benchmarks/gpu_check.py cannot rot while no GPU is lent: its `--device cpu` dry run runs every
part that can run on CPU (gloo, tiny sizes) and writes the JSON the GPU run would; and its part
runner records a crash or an overrun as that part's result and goes on."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
RUN_TIMEOUT_S = 240


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
    assert report["environment"]["env"]["OVERLAP_FORCE_COLLECTIVES"] == "1"
    parts = {p["part"]: p for p in report["parts"]}
    assert list(parts) == ["a", "b", "c", "d", "e", "f"]
    for p in parts.values():
        assert p["seconds"] >= 0 and p["status"] != "error", p
    for key in ("b", "c"):
        assert parts[key]["status"] == "skipped: no CUDA"

    a = parts["a"]["measured"]
    assert a["backend"] == "gloo" and a["OVERLAP_FORCE_COLLECTIVES"] == "1"
    # OVERLAP_FORCE_COLLECTIVES makes world size 1 issue real collectives: part a counts them
    assert parts["a"]["status"] == "passed" and a["collectives_per_step"] > 0, a

    d = parts["d"]
    assert d["status"] == "passed" and d["measured"]["bitwise"], d  # CPU, fp32: bitwise
    assert d["measured"]["max_abs_param_diff"] == 0.0

    e = parts["e"]
    assert e["status"] == "measured" and e["measured"]["rc"] == 0, e
    ops = {r["op"].split()[0] for r in e["measured"]["rows"]}
    assert {"memcpy", "copy_out", "copy_in"} <= ops, ops
    assert all(r["share_of_d2d_copy"] > 0 for r in e["measured"]["rows"])

    f = parts["f"]["measured"]
    assert f["overlap"]["peak_rss_bytes"] > 0 and f["fsdp2"]["peak_rss_bytes"] > 0
    assert f["overlap_over_fsdp2"]["ratio"] > 0
    assert report["summary"].get("error") is None


def test_part_errors_are_recorded_and_the_run_goes_on(tmp_path: Path) -> None:
    gc = load_gpu_check()
    out = tmp_path / "parts.json"
    check = gc.Check(torch.device("cpu"), gc.SIZES["cpu"], out)

    def crash(_c: object, _budget: float) -> tuple:
        raise RuntimeError("boom")

    def overrun(_c: object, _budget: float) -> tuple:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # interrupted by the part's 5 s budget
            time.sleep(0.05)
        return "passed", "never", {}

    def after(c: object, _budget: float) -> tuple:
        written = json.loads(out.read_text())  # the earlier parts are on disk already
        return "measured", "none", {"parts_on_disk": [p["part"] for p in written["parts"]]}

    parts = [gc.Part("x", "crash", crash), gc.Part("y", "overrun", overrun),
             gc.Part("z", "after", after), gc.Part("w", "gpu", after, cuda_only=True)]  # fmt: skip
    report = {"environment": {}, "parts": []}
    start = time.monotonic()
    gc.run_parts(check, parts, report, {"y": 5.0}, 120.0)
    assert time.monotonic() - start < 40  # the overrun was cut at its budget
    on_disk = json.loads(out.read_text())
    assert on_disk == json.loads(json.dumps(report, default=str))
    x, y, z, w = on_disk["parts"]
    assert x["status"] == "error" and "RuntimeError: boom" in x["error"]
    assert y["status"] == "error" and "PartTimeout" in y["error"] and y["budget_s"] == 5.0
    assert z["status"] == "measured" and z["measured"]["parts_on_disk"] == ["x", "y"]
    assert w["status"] == "skipped: no CUDA"
