"""Blockwise quantize / dequantize kernels: every backend equals the torch reference bitwise.

Backends: the C++ CPU extension (built at first use; set OVERLAP_REQUIRE_EXT=1 to fail instead
of skip when it cannot be built, as CI does), Triton under TRITON_INTERPRET=1 (small sizes; int
formats only: the interpreter's fp32 -> fp8 cast is wrong, so fp8 Triton runs on a GPU only), and
the CUDA sources compiled by nvcc as a check.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from overlap.kernels import (
    code_numel,
    cpu,
    dequantize_blockwise,
    dequantize_blockwise_ref,
    num_blocks_for,
    quantize_blockwise,
    quantize_blockwise_ref,
    select_backend,
)
from overlap.kernels.quantize import Backend

ROOT = Path(__file__).resolve().parents[1]
FORMATS = [(8, "int"), (4, "int"), (8, "fp8")]
IN_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
OUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _random_input(numel: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    # Wide dynamic range across blocks, some zeros, and (in fp32) a denormal.
    x = torch.randn(numel, generator=gen) * torch.rand(numel, generator=gen).pow(6) * 100
    x[:: max(1, numel // 5)] = 0.0
    if dtype == torch.float32 and numel > 3:
        x[numel // 3] = 3e-41
    return x.to(dtype)


def _shapes(gen: torch.Generator, count: int, max_numel: int) -> list[tuple[int, int]]:
    """(numel, block) pairs: random sizes, most not multiples of the block."""
    out = [(1, 2), (5, 4), (64, 64), (65, 64)]
    for _ in range(count):
        block = [2, 16, 64, 128, 256, 1000, 2048][int(torch.randint(7, (1,), generator=gen))]
        out.append((int(torch.randint(1, max_numel, (1,), generator=gen)), block))
    return out


def _cpp_or_skip():
    ext = cpu.load_extension()
    if ext is None:
        if os.environ.get("OVERLAP_REQUIRE_EXT", "") not in ("", "0"):
            pytest.fail("OVERLAP_REQUIRE_EXT=1 but the C++ CPU kernels could not be built")
        pytest.skip("the C++ CPU kernels could not be built here (see the warning)")
    return ext


def _check_backend_matches(backend: Backend, shapes: list[tuple[int, int]], formats, in_dtypes, gen) -> None:
    for numel, block in shapes:
        for bits, fmt in formats:
            for dtype in in_dtypes:
                x = _random_input(numel, dtype, gen)
                ref = quantize_blockwise(x, bits, block, fmt=fmt, backend="ref")
                got = quantize_blockwise(x, bits, block, fmt=fmt, backend=backend)
                where = f"{backend} {fmt}{bits} block={block} numel={numel} {dtype}"
                assert torch.equal(ref[0], got[0]) and ref[0].dtype == got[0].dtype, where
                assert torch.equal(ref[1], got[1]), where
                if fmt == "int":
                    seed = int(torch.randint(1 << 30, (1,), generator=gen))
                    g_ref = torch.Generator().manual_seed(seed)
                    g_got = torch.Generator().manual_seed(seed)
                    sr = quantize_blockwise(x, bits, block, True, g_ref, backend="ref")
                    sg = quantize_blockwise(x, bits, block, True, g_got, backend=backend)
                    assert torch.equal(sr[0], sg[0]) and torch.equal(sr[1], sg[1]), "stochastic " + where
                codes, scales = ref
                for out_dtype in OUT_DTYPES:
                    base = torch.randn(numel, generator=gen).to(out_dtype)
                    for accumulate in (False, True):
                        r = dequantize_blockwise(
                            codes, scales, bits, block, numel, base.clone(), accumulate, fmt=fmt, backend="ref"
                        )
                        o = dequantize_blockwise(
                            codes, scales, bits, block, numel, base.clone(), accumulate, fmt=fmt, backend=backend
                        )
                        assert torch.equal(r, o), f"dequantize acc={accumulate} out={out_dtype} " + where


def test_cpp_matches_reference_bitwise():
    _cpp_or_skip()
    gen = torch.Generator().manual_seed(0)
    _check_backend_matches("cpp", _shapes(gen, 12, 20_000), FORMATS, IN_DTYPES, gen)


def test_cpp_large_parallel_matches_reference():
    _cpp_or_skip()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3_000_001, generator=gen)  # many parallel chunks, ragged tail
    for bits, fmt in FORMATS:
        ref = quantize_blockwise(x, bits, 256, fmt=fmt, backend="ref")
        got = quantize_blockwise(x, bits, 256, fmt=fmt, backend="cpp")
        assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
        acc_ref = dequantize_blockwise(*ref, bits, 256, x.numel(), x.clone(), True, fmt=fmt, backend="ref")
        acc_got = dequantize_blockwise(*ref, bits, 256, x.numel(), x.clone(), True, fmt=fmt, backend="cpp")
        assert torch.equal(acc_ref, acc_got)


def test_cpp_baseline_isa_matches_reference():
    """The extension picks an AVX2 copy of the quantize loop at run time; check the other one."""
    _cpp_or_skip()
    code = (
        "import torch\n"
        "from overlap.kernels import quantize_blockwise as q\n"
        "g = torch.Generator().manual_seed(5)\n"
        "x = torch.randn(100_003, generator=g) * torch.rand(100_003, generator=g).pow(4)\n"
        "for bits, fmt in ((8, 'int'), (4, 'int'), (8, 'fp8')):\n"
        "    for block in (64, 1000):\n"
        "        a, b = q(x, bits, block, fmt=fmt, backend='ref'), q(x, bits, block, fmt=fmt, backend='cpp')\n"
        "        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), (bits, fmt, block)\n"
    )
    env = {**os.environ, "OVERLAP_CPU_BASELINE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, check=False, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]


def test_nonfinite_blocks_are_nan_in_every_backend():
    backends = ["ref"] + (["cpp"] if cpu.load_extension() is not None else [])
    x = torch.tensor([1.0, float("nan"), 3.0, 4.0, float("inf"), 0.0, -2.0, 1.0])
    for backend in backends:
        for bits, fmt in FORMATS:
            codes, scales = quantize_blockwise(x, bits, 2, fmt=fmt, backend=backend)
            assert torch.isnan(scales[[0, 2]]).all() and torch.isfinite(scales[[1, 3]]).all(), backend
            decoded = dequantize_blockwise(codes, scales, bits, 2, x.numel(), fmt=fmt, backend=backend)
            assert torch.isnan(decoded[[0, 1, 4, 5]]).all(), backend
            assert torch.isfinite(decoded[[2, 3, 6, 7]]).all(), backend


def test_reference_format():
    x = torch.tensor([-7.0, 7.0, 3.0, 0.0, 1.0])  # block 4: scale 1 for int4, 7/127 for int8
    codes, scales = quantize_blockwise_ref(x, 4, 4)
    assert codes.dtype == torch.uint8 and codes.numel() == code_numel(5, 4, 4) == 4
    assert codes[0].item() == (-7 + 8) | ((7 + 8) << 4)  # element 0 in the low nibble
    assert codes[1].item() == (3 + 8) | ((0 + 8) << 4)
    assert torch.equal(scales, torch.tensor([7.0, 1.0]) / 7.0)
    c8, _ = quantize_blockwise_ref(x, 8, 4)
    assert c8.dtype == torch.int8 and c8[:4].tolist() == [-127, 127, 54, 0]
    fp8, _ = quantize_blockwise_ref(x, 8, 4, fmt="fp8")
    assert fp8.dtype == torch.uint8 and fp8.numel() == 8
    assert num_blocks_for(0, 4) == 0 and quantize_blockwise_ref(torch.empty(0), 8, 4)[0].numel() == 0


def test_argument_errors():
    x = torch.randn(10)
    with pytest.raises(ValueError, match="bits"):
        quantize_blockwise(x, 3, 4)
    with pytest.raises(ValueError, match="even"):
        quantize_blockwise(x, 4, 5)
    with pytest.raises(ValueError, match="stochastic"):
        quantize_blockwise(x, 8, 4, stochastic=True, fmt="fp8")
    with pytest.raises(TypeError, match="floating"):
        quantize_blockwise(torch.arange(10), 8, 4)
    codes, scales = quantize_blockwise(x, 8, 4)
    with pytest.raises(ValueError, match="do not match"):
        dequantize_blockwise(codes, scales, 8, 4, 13)
    with pytest.raises(ValueError, match="accumulate"):
        dequantize_blockwise(codes, scales, 8, 4, 10, accumulate=True)


def test_dispatch_and_fallback_without_ninja(monkeypatch):
    from torch.utils import cpp_extension

    expected = "cpp" if cpu.load_extension() is not None else "ref"
    assert select_backend(torch.device("cpu"), 256) == expected
    # A machine without ninja: one warning, then the reference kernels, same results.
    monkeypatch.setattr(cpu, "_tried", False)
    monkeypatch.setattr(cpu, "_module", None)
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)
    with pytest.warns(UserWarning, match="ninja"):
        assert cpu.load_extension() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the warning is one-time
        assert cpu.load_extension() is None
        assert select_backend(torch.device("cpu"), 256) == "ref"
        x = torch.randn(1000)
        codes, _ = quantize_blockwise(x, 8, 256)
        assert torch.equal(codes, quantize_blockwise_ref(x, 8, 256)[0])
    monkeypatch.setenv("OVERLAP_NO_EXT", "1")
    monkeypatch.setattr(cpu, "_tried", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cpu.load_extension() is None  # opted out: silent


def test_triton_interpreter_matches_reference():
    """Triton's kernels under TRITON_INTERPRET=1 equal the reference bitwise (int8/int4; fp8 is
    checked on a GPU only: the interpreter's fp32 -> fp8 cast is wrong).

    Runs in a fresh interpreter: triton decides interpreter-or-GPU when `triton` is first
    imported, and other tests in this process may have imported it already."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (extra `triton`: pip install -e '.[triton]'; CI installs it)")
    script = ROOT / "tests" / "triton_interpreter_check.py"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "checked" in result.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_gpu_matches_reference():
    pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(3)
    shapes = _shapes(gen, 8, 200_000)
    shapes = [(n, b) for n, b in shapes if b & (b - 1) == 0]
    for numel, block in shapes:
        for bits, fmt in FORMATS:
            x = _random_input(numel, torch.float32, gen).cuda()
            ref = quantize_blockwise(x, bits, block, fmt=fmt, backend="ref")
            got = quantize_blockwise(x, bits, block, fmt=fmt, backend="triton")
            assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
            base = torch.randn(numel, device="cuda")
            r = dequantize_blockwise(*ref, bits, block, numel, base.clone(), True, fmt=fmt, backend="ref")
            o = dequantize_blockwise(*ref, bits, block, numel, base.clone(), True, fmt=fmt, backend="triton")
            assert torch.equal(r, o)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_cuda_sources_compile_with_nvcc(tmp_path):
    sources = sorted((ROOT / "csrc" / "cuda").glob("*.cu"))
    assert sources, "csrc/cuda/ holds no .cu files"
    for src in sources:
        result = subprocess.run(
            ["nvcc", "-c", "-arch=sm_90", "-o", str(tmp_path / (src.stem + ".o")), str(src)],
            check=False,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, f"nvcc failed on {src.name}:\n{result.stderr}"
