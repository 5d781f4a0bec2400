"""Blockwise quantize / dequantize and fused copy-out / copy-in kernels: every backend equals the
torch reference bitwise.

Backends: the C++ CPU extension (built at first use; set OVERLAP_REQUIRE_EXT=1 to fail instead
of skip when it cannot be built, as CI does), Triton under TRITON_INTERPRET=1 (small sizes; int
formats only: the interpreter's fp32 -> fp8 cast is wrong, so fp8 Triton runs on a GPU only), and
the CUDA sources compiled by nvcc as a check.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from helpers.harness import triton_or_skip
from helpers.kernel_inputs import random_input

from overlap.kernels import cpu
from overlap.kernels.quantize import Backend, dequantize_blockwise, quantize_blockwise, select_backend
from overlap.kernels.reference import code_numel, dequantize_blockwise_ref, num_blocks_for, quantize_blockwise_ref

ROOT = Path(__file__).resolve().parents[2]
FORMATS = [(8, "int"), (4, "int"), (8, "fp8")]
IN_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
OUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _shapes(gen: torch.Generator, count: int, max_numel: int) -> list[tuple[int, int]]:
    """(numel, block) pairs: random sizes, most not multiples of the block."""
    out = [(1, 2), (5, 4), (64, 64), (65, 64)]
    for _ in range(count):
        block = [2, 16, 64, 128, 256, 1000, 2048][int(torch.randint(7, (1,), generator=gen))]
        out.append((int(torch.randint(1, max_numel, (1,), generator=gen)), block))
    return out


def _pythonpath() -> str:
    """For subprocesses: import the checkout under test, whatever an editable install points at,
    and the tests' helpers."""
    return os.pathsep.join(p for p in (str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")) if p)


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
                x = random_input(numel, dtype, gen)
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
    """The extension picks AVX2 copies of the quantize and cast loops at run time; check the others."""
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
        "from overlap.kernels import copy_in, copy_out\n"  # the casts have an AVX2 copy too
        "f = x * 1e4\n"
        "for dt in (torch.bfloat16, torch.float16):\n"
        "    a, b = torch.empty(100_003, dtype=dt), torch.empty(100_003, dtype=dt)\n"
        "    copy_out(f, [a], backend='ref'); copy_out(f, [b], backend='cpp')\n"
        "    assert torch.equal(a.view(torch.int16), b.view(torch.int16)), dt\n"
        "    y, z = torch.empty(100_003), torch.empty(100_003)\n"
        "    copy_in([a], y, backend='ref'); copy_in([a], z, backend='cpp')\n"
        "    assert torch.equal(y.view(torch.int32), z.view(torch.int32)), dt\n"
    )
    env = {**os.environ, "OVERLAP_CPU_BASELINE": "1", "PYTHONPATH": _pythonpath()}
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


def test_dispatch_and_fallback_without_ninja(monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    expected = "cpp" if cpu.load_extension() is not None else "ref"
    assert select_backend(torch.device("cpu"), 256) == expected
    # A machine without ninja (and no build cached): one warning, then the reference kernels.
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
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


def test_build_is_keyed_by_what_it_depends_on(monkeypatch, tmp_path):
    """[Note: just-in-time C++ build]: another torch, compiler, flag or source byte is another
    folder (two environments never rebuild each other's build); the same inputs, the same one."""
    key = cpu.build_key()
    assert key == cpu.build_key() and cpu.module_name() == f"overlap_cpu_kernels_{key}"
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    assert cpu.build_key() != key
    monkeypatch.undo()
    monkeypatch.setattr(cpu, "_CFLAGS", [*cpu._CFLAGS, "-march=native"])
    assert cpu.build_key() != key
    monkeypatch.undo()
    monkeypatch.setenv("CXX", "clang++-that-is-not-here")
    assert cpu.build_key() != key
    monkeypatch.undo()
    copies = []
    for src in cpu.source_paths():
        copies.append(tmp_path / src.name)
        copies[-1].write_bytes(src.read_bytes())
    monkeypatch.setattr(cpu, "source_paths", lambda: copies)
    assert cpu.build_key() == key
    copies[1].write_bytes(copies[1].read_bytes() + b"\n// edited\n")
    assert cpu.build_key() != key


def test_cached_build_loads_without_compiling(monkeypatch):
    """A finished build in its keyed folder is loaded as it is: no compiler, no ninja run."""
    from torch.utils import cpp_extension

    ext = _cpp_or_skip()
    folder = cpu._build_root() / cpu.module_name()
    assert (folder / "built.ok").is_file() and (folder / f"{cpu.module_name()}.so").is_file()

    def no_compile(*args, **kwargs):
        raise AssertionError("compiled although a finished build was cached")

    monkeypatch.setattr(cpp_extension, "load", no_compile)
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)
    assert cpu._build() is ext


def test_fp8_falls_back_below_sm89(monkeypatch):
    """[Note: Triton launches]: Triton has no fp8 below sm_89 (A100): "auto" picks the reference
    there, with one warning per device, and int codes keep Triton; forcing Triton is an error.
    Decided from the tensor's device (no CUDA needed: capability and triton are faked)."""
    from overlap.kernels import quantize, triton_launch

    capabilities = {0: (8, 0), 1: (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capabilities[index])
    monkeypatch.setattr(triton_launch, "_capability", {})
    monkeypatch.setattr(triton_launch, "available", lambda: True)  # "installed"
    monkeypatch.setattr(quantize, "_fp8_fallback_warned", set())
    a100, h100 = torch.device("cuda", 0), torch.device("cuda", 1)
    with pytest.warns(UserWarning, match=r"cuda:0 \(compute capability \(8, 0\)\) has no fp8"):
        assert select_backend(a100, 256, fmt="fp8") == "ref"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per device
        assert select_backend(a100, 256, fmt="fp8") == "ref"
        assert select_backend(a100, 256, fmt="int") == "triton"
        assert select_backend(h100, 256, fmt="fp8") == "triton"
        assert select_backend(a100, 100, fmt="int") == "ref"  # not a power of two
    with pytest.raises(ValueError, match="no fp8 kernel for cuda:0"):
        select_backend(a100, 256, "triton", fmt="fp8")
    assert select_backend(h100, 256, "triton", fmt="fp8") == "triton"


def test_triton_interpreter_matches_reference():
    """Triton's kernels under TRITON_INTERPRET=1 equal the reference bitwise (int8/int4; fp8 is
    checked on a GPU only: the interpreter's fp32 -> fp8 cast is wrong), and repeated launches
    build and upload no host data ([Note: copy tables] in triton_copy.py).

    Runs in fresh interpreters: triton decides interpreter-or-GPU when `triton` is first
    imported, and other tests in this process may have imported it already. The script's two
    halves (the kernels alone, the runtime's copies) run at once, one process each: on two cores, in the time of one."""
    triton_or_skip()
    script = Path(__file__).resolve().parent / "triton_interpreter_check.py"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": _pythonpath()}
    procs = {
        part: subprocess.Popen(
            [sys.executable, str(script), part], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for part in ("kernels", "runtime")
    }
    try:
        outputs = {part: proc.communicate(timeout=600) for part, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.kill()
    for part, (stdout, stderr) in outputs.items():
        assert procs[part].returncode == 0, f"{part}:\n{stdout[-3000:]}{stderr[-3000:]}"
        assert f"checked {part}: " in stdout, stdout


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise on the host (as integers, so -0.0 is not 0.0), NaN where the other is NaN
    whatever its payload (torch's CPU casts keep a NaN's sign; the kernels write the canonical
    quiet NaN)."""
    a, b = a.cpu(), b.cpu()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    iv = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(iv), b[~nan].view(iv))


def _gpu_input(numel: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """`random_input` with, where it fits, a NaN block, an Inf block, and a block whose scale
    is subnormal (every value tiny), beside ordinary ones."""
    x = random_input(numel, torch.float32, gen)
    if numel >= 1024:
        x[100] = float("nan")
        x[300] = float("inf")
        x[512:768] = torch.randn(256, generator=gen) * 1e-39
    return x.to(dtype)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_gpu_matches_reference():
    """[Note: kernel numerics across devices] in overlap/kernels/reference.py, on a real GPU:
    Triton on CUDA == the reference on CUDA == the reference on the CPU, bitwise (NaN as NaN),
    for every format, input and output dtype, both roundings (one noise tensor for all), the
    decode and the accumulating decode; fp8 too (the interpreter cannot check it)."""
    pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(3)
    shapes = [(n, b) for n, b in _shapes(gen, 8, 200_000) if b & (b - 1) == 0] + [(70_001, 256), (5000, 128)]
    for numel, block in shapes:
        for bits, fmt in FORMATS:
            for dtype in IN_DTYPES:
                x = _gpu_input(numel, dtype, gen)
                where = f"{fmt}{bits} block={block} numel={numel} {dtype}"
                cpu_ref = quantize_blockwise_ref(x, bits, block, fmt=fmt)
                cuda_ref = quantize_blockwise(x.cuda(), bits, block, fmt=fmt, backend="ref")
                got = quantize_blockwise(x.cuda(), bits, block, fmt=fmt, backend="triton")
                for part in (0, 1):
                    assert _same(got[part], cpu_ref[part]), f"triton vs CPU reference {where}"
                    assert _same(cuda_ref[part], cpu_ref[part]), f"CUDA reference vs CPU reference {where}"
                if fmt == "int":
                    noise = torch.rand(num_blocks_for(numel, block) * block, generator=gen)
                    noise[::97] = 0.0  # a denormal y + 0 exercises floor's flush-to-zero correction
                    s_cpu = quantize_blockwise_ref(x, bits, block, True, noise=noise)
                    s_got = quantize_blockwise(x.cuda(), bits, block, fmt=fmt, backend="triton", noise=noise.cuda(),
                                               stochastic=True)  # fmt: skip
                    assert _same(s_got[0], s_cpu[0]) and _same(s_got[1], s_cpu[1]), f"stochastic {where}"
                codes, scales = cpu_ref
                for out_dtype in OUT_DTYPES:
                    base = torch.randn(numel, generator=gen).to(out_dtype)
                    for accumulate in (False, True):
                        want = dequantize_blockwise_ref(
                            codes, scales, bits, block, numel, base.clone(), accumulate, fmt
                        )
                        on_gpu = base.cuda()
                        o = dequantize_blockwise(codes.cuda(), scales.cuda(), bits, block, numel, on_gpu, accumulate,
                                                 fmt=fmt, backend="triton")  # fmt: skip
                        r = dequantize_blockwise(codes.cuda(), scales.cuda(), bits, block, numel, base.cuda(),
                                                 accumulate, fmt=fmt, backend="ref")  # fmt: skip
                        assert _same(o, want), f"dequantize acc={accumulate} out={out_dtype} triton " + where
                        assert _same(r, want), f"dequantize acc={accumulate} out={out_dtype} CUDA ref " + where


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_gpu_rows_and_fused_feedback_match_the_cpu_loop():
    """[Note: rows per launch] on a real GPU: one launch for all rows (encode with every
    residual, decode into rows, the rank-order decode-sum) == the loop of single-row ops on the
    CPU reference, bitwise; the fused non-finite count == the loop's."""
    pytest.importorskip("triton")
    from overlap.kernels import rows as rows_ops

    gen = torch.Generator().manual_seed(4)
    block, numel, num_rows, skip = 256, 5000, 4, 2
    nb = num_blocks_for(numel, block)
    for bits, fmt in FORMATS:
        n_codes = code_numel(numel, bits, block)
        code_dtype = torch.int8 if bits == 8 and fmt == "int" else torch.uint8
        x = torch.stack([_gpu_input(numel, torch.float32, gen) for _ in range(num_rows)])
        for mode in ("none", "fp32", "bf16", "int8") + (("stochastic",) if fmt == "int" else ()):
            residual: object = None
            if mode in ("fp32", "bf16"):
                residual = (torch.randn(num_rows - 1, numel, generator=gen) * 0.01).to(
                    getattr(torch, "float32" if mode == "fp32" else "bfloat16")
                )
            elif mode == "int8":
                residual = (torch.randint(-127, 128, (num_rows - 1, nb * block), generator=gen, dtype=torch.int8),
                            torch.rand(num_rows - 1, nb, generator=gen) * 1e-4)  # fmt: skip
            noise = torch.rand(num_rows - 1, nb * block, generator=gen) if mode == "stochastic" else None
            outs = {}
            for device in ("cpu", "cuda"):
                codes = torch.zeros(num_rows, n_codes, dtype=code_dtype, device=device)
                scales = torch.zeros(num_rows, nb, device=device)
                res = None
                if residual is not None:
                    res = tuple(t.to(device) for t in residual) if isinstance(residual, tuple) else residual.to(device)  # type: ignore[union-attr]
                count = torch.zeros((), dtype=torch.int64, device=device)
                kw = {"fmt": fmt, "skip": skip, "noise": None if noise is None else noise.to(device), "residual": res,
                      "count": count}  # fmt: skip
                if device == "cpu":
                    rows_ops.encode_rows_loop(x, codes, scales, bits, block, backend="ref", **kw)  # type: ignore[arg-type]
                else:
                    from overlap.kernels import triton_kernels

                    triton_kernels.encode_rows(x.cuda(), codes, scales, bits, block, **kw)  # type: ignore[arg-type]
                outs[device] = (
                    codes,
                    scales,
                    *((res if isinstance(res, tuple) else (res,)) if res is not None else ()),
                    count,
                )
            for a, b in zip(outs["cpu"], outs["cuda"]):
                assert _same(a, b), f"encode_rows {fmt}{bits} {mode}"
        codes, scales = outs["cpu"][0], outs["cpu"][1]
        for out_dtype in OUT_DTYPES:
            want = rows_ops.decode_rows(codes, scales, bits, block, numel, torch.empty(num_rows, numel, dtype=out_dtype),
                                        fmt=fmt, backend="ref")  # fmt: skip
            got = rows_ops.decode_rows(codes.cuda(), scales.cuda(), bits, block, numel,
                                       torch.empty(num_rows, numel, dtype=out_dtype, device="cuda"), fmt=fmt)  # fmt: skip
            assert _same(got, want), f"decode_rows {fmt}{bits} {out_dtype}"
            own = x[skip].to(out_dtype)
            for peers in (slice(None), [r for r in range(num_rows) if r != skip]):
                want = rows_ops.decode_sum_rows(codes[peers], scales[peers], own, skip, num_rows, bits, block,
                                                torch.empty(numel, dtype=out_dtype), fmt=fmt, backend="ref")  # fmt: skip
                got = rows_ops.decode_sum_rows(codes[peers].cuda(), scales[peers].cuda(), own.cuda(), skip, num_rows, bits,
                                               block, torch.empty(numel, dtype=out_dtype, device="cuda"), fmt=fmt)  # fmt: skip
                assert _same(got, want), f"decode_sum_rows {fmt}{bits} {out_dtype}"


def test_codec_launches_per_bucket_do_not_grow_with_world_size(tmp_path):
    """[Note: rows per launch]: a compressed bucket's encode and decode are a fixed handful of
    device kernels, one Triton launch each, at 2, 4 and 8 ranks, with and without error feedback
    (benchmarks/codec_launches.py counts them on the CUDA dispatch under Triton's interpreter;
    the per-row path was 18, 38 and 78 without feedback, 21, 47 and 99 with it)."""
    triton_or_skip()
    out = tmp_path / "launches.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": _pythonpath()}
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "codec_launches.py"), "--out", str(out)],
        check=False, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    import json

    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 6
    for row in rows:
        assert row["ops"].get("triton:_encode_kernel") == 1 and row["ops"].get("triton:_decode_sum_kernel") == 1, row
        assert row["reduce_encode"] + row["reduce_decode"] <= 9 and row["gather"] <= 2, row
    assert len({(r["reduce_encode"], r["reduce_decode"], r["gather"]) for r in rows}) == 1, rows


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


# ------------------------------------------------------------------------------ fused copy-in / out
# [Note: fused copy layout] in overlap/kernels/copy.py. Compared on the bits (int views): -0.0 vs
# +0.0 and rounding ties count. NaN is checked separately (its bits are not specified).
COPY_PAIRS = [  # (flat dtype, tensors' dtype)
    (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.float32),
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float16),
    (torch.float16, torch.float32),
]
_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT_VIEW[t.dtype])


def _copy_values(numel: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random values plus the cases casts get wrong: ties, denormals, +-inf, -0, overflow to inf."""
    x = torch.randn(numel, generator=gen) * torch.rand(numel, generator=gen).pow(4) * 50
    special = torch.tensor(
        [1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 3e-41, -1e-39, float("inf"), -float("inf"), -0.0,
         3.4e38, 70000.0, 2**-20]
    )  # fmt: skip
    idx = torch.randint(max(numel, 1), (min(numel, 2 * len(special)),), generator=gen)
    x[idx] = special.repeat(2)[: len(idx)]
    return x.to(dtype)


def _copy_layouts(
    gen: torch.Generator, count: int, max_cols: int
) -> list[tuple[list[int], list[int], int, list[int] | None]]:
    """(sizes, valid numels, num_rows, data_cols): empty segments, padded ones, odd sizes, and
    (every other layout) padding columns in every row, as the runtime's padded chunks have."""
    layouts: list[tuple[list[int], list[int], int, list[int] | None]] = [
        ([0], [0], 1, None), ([5], [5], 1, None), ([6, 0, 9], [4, 0, 9], 3, None),
        ([4096, 48], [4000, 48], 2, None), ([32, 96, 0], [26, 90, 0], 2, [13, 45, 0]),
    ]  # fmt: skip
    for k in range(count):
        num_rows = [1, 2, 3, 4][int(torch.randint(4, (1,), generator=gen))]
        num = int(torch.randint(1, 30, (1,), generator=gen))
        cols = torch.randint(0, max_cols, (num,), generator=gen)
        cols[torch.rand(num, generator=gen) < 0.15] = 0
        sizes = [int(c) * num_rows for c in cols]
        data = None
        if k % 2:
            data = [int(torch.randint(0, int(c) + 1, (1,), generator=gen)) for c in cols]
        capacity = sizes if data is None else [num_rows * d for d in data]
        pad = torch.rand(num, generator=gen) < 0.4
        valid = [max(0, s - int(torch.randint(0, num_rows * 3, (1,), generator=gen))) if p else s
                 for s, p in zip(capacity, pad.tolist())]  # fmt: skip
        layouts.append((sizes, valid, num_rows, data))
    return layouts


def _check_copy_matches(backend: Backend, layouts, pairs, gen: torch.Generator, device: str = "cpu") -> None:
    from overlap.kernels import bind_copy_out, copy_in, copy_out

    for sizes, valid, num_rows, data in layouts:
        for flat_dtype, dtype in pairs:
            where = f"{backend} {flat_dtype}<->{dtype} rows={num_rows} sizes={sizes} valid={valid} data={data}"
            flat = _copy_values(sum(sizes), flat_dtype, gen).to(device)
            ref = [torch.full((n,), 7.0, dtype=dtype, device=device) for n in valid]
            got = [t.clone() for t in ref]
            copy_out(flat, ref, sizes=sizes, num_rows=num_rows, data_cols=data, backend="ref")
            copy_out(flat, got, sizes=sizes, num_rows=num_rows, data_cols=data, backend=backend)
            for i, (r, g) in enumerate(zip(ref, got)):
                assert torch.equal(_bits(r), _bits(g)), f"copy_out tensor {i}: " + where
            # the same from separate row buffers, each longer than a row ([Note: gather of a pair])
            rows = [torch.cat([row, row.new_zeros(3)]) for row in flat.view(num_rows, -1)]
            by_rows = [torch.full_like(t, 7.0) for t in ref]
            cols = [s // num_rows for s in sizes] if data is None else data
            bind_copy_out(flat_dtype, flat.device, by_rows, sizes, cols, num_rows, rows=True)(rows)
            for i, (r, g) in enumerate(zip(ref, by_rows)):
                assert torch.equal(_bits(r), _bits(g)), f"copy_out from rows, tensor {i}: " + where
            # copy-in: sources of mixed dtypes, some None (zeros); the sentinel must be overwritten
            srcs: list[torch.Tensor | None] = []
            for i, n in enumerate(valid):
                src_dtype = dtype if i % 3 else flat_dtype
                srcs.append(None if i % 5 == 4 else _copy_values(n, src_dtype, gen).to(device))
            ref_flat = torch.full((sum(sizes),), 7.0, dtype=flat_dtype, device=device)
            got_flat = ref_flat.clone()
            copy_in(srcs, ref_flat, sizes=sizes, num_rows=num_rows, data_cols=data, backend="ref")
            copy_in(srcs, got_flat, sizes=sizes, num_rows=num_rows, data_cols=data, backend=backend)
            assert torch.equal(_bits(ref_flat), _bits(got_flat)), "copy_in: " + where


def test_copy_reference_definition():
    from overlap.kernels import copy_in_ref, copy_out_ref

    # two rows, segments of 2 and 1 columns: flat = [[a0 a1 b0] [a2 a3 b1]]
    flat = torch.tensor([0.0, 1.0, 10.0, 2.0, 3.0, 11.0])
    a, b = torch.empty(3), torch.empty(2)  # a drops its padding element a3
    copy_out_ref(flat, [a, b], sizes=[4, 2], num_rows=2)
    assert a.tolist() == [0.0, 1.0, 2.0] and b.tolist() == [10.0, 11.0]
    out = torch.full((6,), -1.0)
    copy_in_ref([a, b], out, sizes=[4, 2], num_rows=2)
    assert out.tolist() == [0.0, 1.0, 10.0, 2.0, 0.0, 11.0]
    copy_in_ref([None, b.bfloat16()], out, sizes=[4, 2], num_rows=2)
    assert out.tolist() == [0.0, 0.0, 10.0, 0.0, 0.0, 11.0]
    # data_cols: a's rows hold 1 data column and 1 padding column: flat = [[a0 pad b0] [a1 pad b1]]
    a2 = torch.empty(2)
    copy_out_ref(flat, [a2, b], sizes=[4, 2], num_rows=2, data_cols=[1, 1])
    assert a2.tolist() == [0.0, 2.0] and b.tolist() == [10.0, 11.0]
    copy_in_ref([torch.tensor([5.0]), b], out, sizes=[4, 2], num_rows=2, data_cols=[1, 1])
    assert out.tolist() == [5.0, 0.0, 10.0, 0.0, 0.0, 11.0]  # a's second row: past its end


def test_copy_cpp_matches_reference_bitwise():
    _cpp_or_skip()
    gen = torch.Generator().manual_seed(10)
    _check_copy_matches("cpp", _copy_layouts(gen, 10, 3000), COPY_PAIRS, gen)


def test_copy_cpp_large_parallel_matches_reference():
    """Many parallel tasks whose ranges start and end inside segments and rows."""
    _cpp_or_skip()
    gen = torch.Generator().manual_seed(11)
    layouts = [
        ([2 * c for c in (1_000_003, 7, 0, 65_536, 333_333)], [2_000_000, 14, 0, 131_072, 666_666], 2, None),
        ([2 * c for c in (1_000_016, 16, 65_536)], [2_000_006, 14, 131_072], 2, [1_000_003, 7, 65_536]),
    ]
    _check_copy_matches("cpp", layouts, [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)], gen)


def test_copy_nan_stays_nan_and_versions_bump():
    from overlap.kernels import copy_in, copy_out

    backends: list[Backend] = ["ref"] + (["cpp"] if cpu.load_extension() is not None else [])
    for backend in backends:
        flat = torch.tensor([1.0, float("nan"), -float("nan"), 2.0])
        out = torch.empty(4, dtype=torch.bfloat16)
        copy_out(flat, [out], backend=backend)
        assert torch.isnan(out[1:3]).all() and out[0] == 1 and out[3] == 2, backend
        assert out._version > 0, backend  # in-place writes are visible to autograd's checks
        back = torch.empty(4)
        copy_in([out], back, backend=backend)
        assert torch.isnan(back[1:3]).all() and back._version > 0, backend


@pytest.mark.parametrize("align", [1, 16])
def test_copy_matches_runtime_layout(align):
    """The runtime's copy-out (split along dim 1, each chunk without its padding into the
    parameter's padded full tensor) and gradient copy-in (each gradient cut into world_size
    chunks, padded, with the used flags) of a unit ([Note: flat layout]) equal one copy_out /
    copy_in call, with padded chunks (align 16) and packed ones (align 1)."""
    from overlap.engine.units import ParamInfo, make_layout
    from overlap.kernels import copy_in, copy_out

    shapes = [(48, 20), (48,), (7, 3), (1,), (5, 4, 3), (3,)]
    n = 4
    params = [ParamInfo(f"p{i}", ((f"m{i}", "w"),), torch.Size(s), i != 3) for i, s in enumerate(shapes)]
    layout = make_layout(0, "unit0", ("m",), params, n, align_numel=align)
    sizes = [n * s.padded_chunk_numel for s in layout.slots]
    data = [s.chunk_numel for s in layout.slots]
    gen = torch.Generator().manual_seed(12)
    backends: list[Backend] = ["ref"] + (["cpp"] if cpu.load_extension() is not None else [])
    for backend in backends:
        for gather_dtype, param_dtype in [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)]:
            gathered = torch.randn(layout.unsharded_numel, generator=gen).to(gather_dtype)
            expected = torch.zeros(layout.unsharded_numel, dtype=param_dtype)
            blocks = gathered.view(n, -1).split(layout.chunk_sizes, dim=1)
            for s, block in zip(layout.slots, blocks):
                expected[s.unsharded_offset : s.unsharded_offset + n * s.chunk_numel] = block[
                    :, : s.chunk_numel
                ].reshape(-1)
            unsharded = torch.zeros(layout.unsharded_numel, dtype=param_dtype)
            outs = [unsharded[s.unsharded_offset : s.unsharded_offset + n * s.chunk_numel] for s in layout.slots]
            copy_out(gathered, outs, sizes=sizes, data_cols=data, num_rows=n, backend=backend)
            assert torch.equal(_bits(unsharded), _bits(expected)), backend
            for s, param, block in zip(layout.slots, outs, blocks):  # each rank's rows of every parameter
                full = param.view(n * s.rows_per_rank, *s.shape[1:])[: s.shape[0] if s.shape else 1]
                for r in range(n):
                    rows = slice(r * s.rows_per_rank, (r + 1) * s.rows_per_rank)
                    chunk = block[r, : s.chunk_numel].to(param_dtype)
                    assert torch.equal(full[rows].reshape(-1), chunk[: full[rows].numel()]), (backend, s.fqn)
        for grad_dtype, reduce_dtype in [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)]:
            grads = [torch.randn(s.shape, generator=gen).to(grad_dtype) if s.fqn != "p4" else None
                     for s in layout.grad_slots]  # fmt: skip
            used = [g is not None for g in grads]
            columns = []
            for slot, grad in zip(layout.grad_slots, grads):
                column = torch.zeros(n, slot.padded_chunk_numel, dtype=reduce_dtype)
                if grad is not None:
                    flat_grad = torch.nn.functional.pad(grad.reshape(-1), (0, n * slot.chunk_numel - grad.numel()))
                    column[:, : slot.chunk_numel] = flat_grad.view(n, -1)
                columns.append(column)
            flags = torch.tensor(used, dtype=reduce_dtype).expand(n, -1)
            width = layout.grad_shard_numel + len(used)
            expected = torch.empty(n, width, dtype=reduce_dtype)
            torch.cat([*columns, flags], dim=1, out=expected)
            full = torch.full((n, width), 7.0, dtype=reduce_dtype)
            grad_sizes = [n * s.padded_chunk_numel for s in layout.grad_slots] + [n * len(used)]
            grad_data = [s.chunk_numel for s in layout.grad_slots] + [len(used)]
            copy_in([*grads, flags.reshape(-1)], full, sizes=grad_sizes, data_cols=grad_data, num_rows=n,
                    backend=backend)  # fmt: skip
            assert torch.equal(_bits(full), _bits(expected)), backend


def test_layout_pads_chunks_to_the_alignment():
    """[Note: flat layout]: every chunk starts at a multiple of 16 elements in the shard, the
    gradient shard and the unsharded buffer; chunk_numel stays rows_per_rank * row_numel."""
    from overlap.engine.units import CHUNK_ALIGN_NUMEL, ParamInfo, make_layout

    shapes = [(50257, 8), (50257,), (7, 3), (64, 64), (1,)]
    params = [ParamInfo(f"p{i}", ((f"m{i}", "w"),), torch.Size(s), i != 2) for i, s in enumerate(shapes)]
    packed = make_layout(0, "u", ("m",), params, 8)
    padded = make_layout(0, "u", ("m",), params, 8, align_numel=CHUNK_ALIGN_NUMEL)
    assert [s.chunk_numel for s in packed.slots] == [s.chunk_numel for s in padded.slots]
    assert [s.chunk_numel for s in packed.slots] == [s.padded_chunk_numel for s in packed.slots]
    assert packed.slots[1].chunk_numel == 6283  # odd: packed, everything after it is misaligned
    assert [s.padded_chunk_numel for s in padded.slots] == [50272, 6288, 16, 512, 16]
    for s in padded.slots:
        assert s.shard_offset % 16 == 0 and s.unsharded_offset % 16 == 0
        assert s.padded_chunk_numel % 16 == 0 and s.padded_chunk_numel - s.chunk_numel < 16
        assert s.grad_offset % 16 == 0 or not s.requires_grad
    assert padded.shard_numel == sum(padded.chunk_sizes) and padded.shard_numel % 16 == 0
    assert padded.grad_shard_numel == padded.shard_numel - 16  # p2 is frozen
    assert padded.unsharded_numel == 8 * padded.shard_numel
    with pytest.raises(ValueError, match="align_numel"):
        make_layout(0, "u", ("m",), params, 8, align_numel=0)


def test_copy_argument_errors_and_dispatch():
    from overlap.kernels import copy_in, copy_out, select_copy_backend

    flat = torch.randn(10)
    with pytest.raises(ValueError, match="flat has 10 elements"):
        copy_out(flat, [torch.empty(4), torch.empty(4)])
    with pytest.raises(ValueError, match="multiple of num_rows"):
        copy_out(flat, [torch.empty(5), torch.empty(5)], num_rows=2, sizes=[5, 5])
    with pytest.raises(ValueError, match="contiguous"):
        copy_out(flat, [torch.empty(5, 2).t()])
    with pytest.raises(ValueError, match="more than sizes"):
        copy_in([torch.randn(6), torch.randn(4)], flat, sizes=[5, 5])
    with pytest.raises(ValueError, match="needs explicit `sizes`"):
        copy_in([None, torch.randn(4)], flat)
    with pytest.raises(TypeError, match="floating"):
        copy_in([torch.arange(10)], flat)
    with pytest.raises(ValueError, match="data_cols"):
        copy_out(flat, [torch.empty(4), torch.empty(4)], sizes=[6, 4], num_rows=2, data_cols=[4, 2])
    with pytest.raises(ValueError, match="data_cols"):
        copy_in([torch.randn(4)], flat, sizes=[10], data_cols=[5, 5])
    with pytest.raises(ValueError, match="more than sizes"):  # 2 rows of 2 data columns hold 4
        copy_in([torch.randn(5), None], flat, sizes=[6, 4], num_rows=2, data_cols=[2, 2])
    # dtypes the compiled backends do not take: auto uses the reference, forcing one is an error
    expected = "cpp" if cpu.load_extension() is not None else "ref"
    assert select_copy_backend(torch.device("cpu"), [torch.float32, torch.bfloat16]) == expected
    assert select_copy_backend(torch.device("cpu"), [torch.float64, torch.float32]) == "ref"
    outs = [torch.empty(3, dtype=torch.float64), torch.empty(7, dtype=torch.float64)]
    copy_out(flat, outs)
    assert torch.equal(torch.cat(outs), flat.double())
    with pytest.raises(ValueError, match="fp32/bf16/fp16"):
        copy_out(flat, outs, backend="cpp")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_copy_triton_gpu_matches_reference():
    pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(13)
    layouts = _copy_layouts(gen, 6, 5000) + [([2 * c for c in (1_000_000, 17, 4096)], [2_000_000, 30, 8192], 2, None)]
    _check_copy_matches("triton", layouts, COPY_PAIRS, gen, device="cuda")


@pytest.mark.parametrize(
    "bits,fmt,stochastic", [(8, "int", False), (8, "int", True), (4, "int", False), (4, "int", True), (8, "fp8", False)]
)  # fp8 has no stochastic rounding
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_error_feedback_matches_the_composition(bits, fmt, dtype, stochastic):
    """C++ quantize_feedback == add, quantize, dequantize, subtract (the reference kernels),
    bitwise: codes, scales and the updated residual; and decode + residual == x + old residual."""
    from overlap.kernels import dequantize_blockwise, quantize_feedback_blockwise

    _cpp_or_skip()  # fails instead under OVERLAP_REQUIRE_EXT=1, as CI sets it
    block = 64
    for numel in (1, 63, 64, 1000, 4099):
        x = (torch.randn(numel) * 3).to(dtype)
        x[: numel // 7] *= 1e-3  # blocks of very different scales
        r0 = torch.randn(numel) * 0.01
        outs = {}
        for backend in ("ref", "cpp"):
            r = r0.clone()
            g = torch.Generator().manual_seed(7)
            codes, scales = quantize_feedback_blockwise(x, r, bits, block, stochastic, g, fmt=fmt, backend=backend)
            outs[backend] = (codes, scales, r)
        for a, b in zip(outs["ref"], outs["cpp"]):
            assert torch.equal(a, b), (numel, backend)
        if not stochastic:
            codes, scales, r = outs["cpp"]
            decoded = dequantize_blockwise(codes, scales, bits, block, numel, fmt=fmt)
            assert torch.equal(decoded + r, x.float() + r0), numel


@pytest.mark.parametrize(
    "bits,fmt,stochastic", [(8, "int", False), (8, "int", True), (4, "int", False), (4, "int", True), (8, "fp8", False)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_int8_residual_feedback_matches_the_composition(bits, fmt, dtype, stochastic):
    """C++ quantize_feedback_int8res == decode the int8 residual, quantize_feedback, re-encode
    the residual (the reference kernels), bitwise: codes, scales and both residual tensors; and
    the residual it leaves is the int8 encoding of exactly what the codes dropped."""
    from overlap.kernels import (
        dequantize_blockwise,
        quantize_blockwise,
        quantize_feedback_blockwise,
        quantize_feedback_int8res_blockwise,
    )

    _cpp_or_skip()  # fails instead under OVERLAP_REQUIRE_EXT=1, as CI sets it
    block = 64
    for numel in (1, 63, 64, 1000, 4099):
        x = (torch.randn(numel) * 3).to(dtype)
        x[: numel // 7] *= 1e-3  # blocks of very different scales
        res0 = quantize_blockwise(torch.randn(numel) * 0.01, 8, block, backend="ref")
        outs = {}
        for backend in ("ref", "cpp"):
            res_codes, res_scales = res0[0].clone(), res0[1].clone()
            g = torch.Generator().manual_seed(7)
            codes, scales = quantize_feedback_int8res_blockwise(
                x, res_codes, res_scales, bits, block, stochastic, g, fmt=fmt, backend=backend
            )
            outs[backend] = (codes, scales, res_codes, res_scales)
        for a, b in zip(outs["ref"], outs["cpp"]):
            assert torch.equal(a, b), (numel, a, b)
        if not stochastic:
            codes, scales, res_codes, res_scales = outs["cpp"]
            dropped = dequantize_blockwise(res0[0], res0[1], 8, block, numel)  # the old residual
            assert torch.equal(quantize_feedback_blockwise(x, dropped, bits, block, fmt=fmt)[0], codes)
            expected = quantize_blockwise(dropped, 8, block)  # what the codes dropped, re-encoded
            assert torch.equal(expected[0], res_codes) and torch.equal(expected[1], res_scales), numel
    with pytest.raises(ValueError, match="int8 codes"):
        quantize_feedback_int8res_blockwise(torch.randn(100), torch.zeros(100, dtype=torch.int8), torch.zeros(1), 8, 64)


@pytest.mark.parametrize("backend", ["ref", "cpp"])
def test_feedback_leaves_no_residual_for_a_nonfinite_block(backend):
    """[Note: error feedback residual]: a block holding Inf/NaN is sent as NaN and leaves a zero
    residual (fp32 and int8 residual, every format), so the next step's encode of a clean
    gradient is clean; the other blocks keep theirs. (Triton: tests/unit/triton_interpreter_check.py
    and the GPU tests compare it with these.)"""
    from overlap.kernels import quantize_feedback_blockwise, quantize_feedback_int8res_blockwise

    if backend == "cpp":
        _cpp_or_skip()
    block, numel = 64, 200
    for bits, fmt in FORMATS:
        x = torch.randn(numel)
        x[70] = float("nan")
        x[150] = float("inf")
        r = torch.randn(numel) * 0.01
        _, scales = quantize_feedback_blockwise(x, r, bits, block, fmt=fmt, backend=backend)
        assert scales[1:3].isnan().all() and not scales[[0, 3]].isnan().any()
        assert torch.equal(r[64:192], torch.zeros(128)) and torch.isfinite(r).all() and r[:64].abs().sum() > 0
        _, clean = quantize_feedback_blockwise(torch.randn(numel), r, bits, block, fmt=fmt, backend=backend)
        assert torch.isfinite(clean).all()
        rc, rs = quantize_blockwise_ref(torch.randn(numel) * 0.01, 8, block)
        quantize_feedback_int8res_blockwise(x, rc, rs, bits, block, fmt=fmt, backend=backend)
        assert torch.isfinite(rs).all() and (rs[1:3] == 0).all() and (rc[64:192] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_sum_rows_matches_add_then_divide(dtype):
    """C++ sum_rows == torch.add left to right, then div_ of the gradient part, bitwise (every
    rounding of the reduced dtypes included), for 2-4 rows and any split point."""
    from overlap.kernels import sum_rows, sum_rows_ref

    _cpp_or_skip()  # fails instead under OVERLAP_REQUIRE_EXT=1, as CI sets it
    gen = torch.Generator().manual_seed(3)
    spread = 1.0 if dtype == torch.float16 else 4.0  # fp16: stay finite (NaN != NaN)
    for num_rows in (2, 3, 4):
        for numel in (1, 999, 70_001):  # the last spans several parallel chunks
            rows = [(torch.randn(numel, generator=gen) * torch.randn(numel, generator=gen).mul(spread).exp()).to(dtype)
                    for _ in range(num_rows)]  # fmt: skip
            for divide_numel in (0, numel // 2, numel):
                expected = rows[0] + rows[1]
                for row in rows[2:]:
                    expected = expected + row
                expected[:divide_numel] /= num_rows
                assert torch.equal(sum_rows_ref(rows, divide_numel, num_rows), expected)
                got = sum_rows(rows, divide_numel, num_rows, backend="cpp")
                assert torch.equal(got, expected), (num_rows, numel, divide_numel)
    with pytest.raises(ValueError, match="one shape and dtype"):
        sum_rows([torch.zeros(3), torch.zeros(4)])


def test_sum_rows_into_out():
    """`out=`: the same sum written into the caller's tensor (returned), by either backend; an
    `out` of another shape or dtype, or one that shares a row's storage, is refused."""
    from overlap.kernels import sum_rows

    _cpp_or_skip()
    gen = torch.Generator().manual_seed(4)
    rows = [torch.randn(70_001, generator=gen) for _ in range(3)]
    expected = sum_rows(rows, 35_000, 3)
    for backend in ("cpp", "ref"):
        out = torch.full_like(rows[0], float("nan"))
        assert sum_rows(rows, 35_000, 3, backend=backend, out=out) is out
        assert torch.equal(out, expected), backend
    for bad in (torch.empty(70_000), torch.empty(70_001, dtype=torch.float64)):
        with pytest.raises(ValueError, match="out must be contiguous"):
            sum_rows(rows, out=bad)
    with pytest.raises(ValueError, match="share storage"):
        sum_rows(rows, out=rows[1])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_gpu_launches_do_not_sync():
    """On a real GPU, the steady-state launches never synchronize the host ([Note: copy tables]):
    torch's sync debug mode turns any synchronizing call into an error. Fresh copy-in sources
    (a new table, sent from pinned memory) do not sync either."""
    pytest.importorskip("triton")
    from overlap.engine.units import CHUNK_ALIGN_NUMEL, ParamInfo, make_layout
    from overlap.kernels import copy_in, copy_out

    n = 2
    shapes = [(4096, 64), (4096,), (7, 3), (50257,)]
    params = [ParamInfo(f"p{i}", ((f"m{i}", "w"),), torch.Size(s), True) for i, s in enumerate(shapes)]
    layout = make_layout(0, "u", ("m",), params, n, align_numel=CHUNK_ALIGN_NUMEL)
    sizes = [n * s.padded_chunk_numel for s in layout.slots]
    data = [s.chunk_numel for s in layout.slots]
    gathered = torch.randn(layout.unsharded_numel, device="cuda")
    x = torch.randn(100_000, device="cuda")

    def step(grads: list[torch.Tensor]) -> None:
        for dtype in (torch.bfloat16, torch.float32):
            unsharded = torch.empty(layout.unsharded_numel, dtype=dtype, device="cuda")
            outs = [unsharded[s.unsharded_offset : s.unsharded_offset + n * s.chunk_numel] for s in layout.slots]
            copy_out(gathered, outs, sizes=sizes, data_cols=data, num_rows=n)
        full = torch.empty(sum(sizes), device="cuda")
        copy_in(grads, full, sizes=sizes, data_cols=data, num_rows=n)
        for bits, fmt in FORMATS:
            codes, scales = quantize_blockwise(x, bits, 256, fmt=fmt)
            dequantize_blockwise(codes, scales, bits, 256, x.numel(), x.clone(), True, fmt=fmt)

    def new_grads() -> list[torch.Tensor]:
        return [torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in shapes]

    grads = new_grads()
    step(grads)  # compiles, fills the table cache
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(grads)
        step(new_grads())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
