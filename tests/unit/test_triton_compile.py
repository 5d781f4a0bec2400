"""Every Triton kernel variant the library can launch compiles through Triton's real CUDA
backend, to PTX and a cubin, for sm_90 and sm_80, on a machine without a GPU.

The interpreter (tests/unit/triton_interpreter_check.py) checks results; this checks what it cannot
see: globals a jitted function may not read, types, lowering per architecture, fp fusion, and
alignment hints. Variants ([Note: rows per launch] in overlap/kernels/triton_kernels.py): encode
{int8, int4, fp8} x {round-to-nearest, stochastic (int only)} x input {fp32, bf16, fp16}, each
also with error feedback fused (fp32, bf16 and int8 residuals; fp32 and bf16 inputs), counted
(an atomic add) and uncounted, 32- and 64-bit indices; decode {int8, int4, fp8} x {accumulate,
store} x output {fp32, bf16, fp16}; the decode-sum of a reduce-scatter into each reduce dtype;
copy-out / copy-in x flat dtype x tensor dtype x {aligned, unaligned}. Each compiles with the
library's launch options ([Note: Triton launches] in overlap/kernels/triton_launch.py): no
fused multiply-add and no flush-to-zero in any PTX.
fp8 needs sm_89: those variants must fail to compile for sm_80, exactly where the library's
dispatch stops choosing Triton for fp8.

Fails (never skips) when triton is installed and a compile breaks. Compiles are cached on disk
by Triton; cold, the file takes about half a minute on two cores.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Any, NamedTuple

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed (extra `triton`; CI installs it)")
if os.environ.get("TRITON_INTERPRET", "") not in ("", "0"):  # jit returns interpreted functions then
    pytest.skip("TRITON_INTERPRET is set in this process: nothing to compile", allow_module_level=True)

from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from overlap.kernels import quantize, triton_copy, triton_kernels, triton_launch
from overlap.kernels.reference import qmax_for
from overlap.kernels.triton_launch import FP8_MIN_CAPABILITY, LAUNCH_OPTIONS

ARCHS = (90, 80)
_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_ROUND_MAGIC_PTX = "0f4B400000"  # 1.5 * 2^23 as a PTX fp32 literal


class Variant(NamedTuple):
    name: str
    kernel: Any
    signature: dict[str, str]  # non-constexpr parameters
    constexprs: dict[str, Any]
    fp8: bool = False
    ints16: bool = False  # integer arguments specialized as multiples of 16 (compile_ptx)


def _label(bits: int, fmt: str) -> str:
    return "fp8" if fmt == "fp8" else f"int{bits}"


_FORMATS = ((8, "int", 256), (4, "int", 128), (8, "fp8", 256))
_RESIDUALS = {"fp32 residual": (1, "*fp32"), "bf16 residual": (1, "*bf16"), "int8 residual": (2, "*i8")}


def _encode_variant(bits: int, fmt: str, block: int, stochastic: bool, ty: str, residual: str | None = None,
                    count: bool = True, index: str = "i32") -> Variant:  # fmt: skip
    codes = "*i8" if bits == 8 and fmt == "int" else "*u8"
    mode, res_ty = _RESIDUALS[residual] if residual else (0, f"*{ty}")
    signature = {"x_ptr": f"*{ty}", "x_stride": index, "noise_ptr": "*fp32" if stochastic else f"*{ty}",
                 "noise_stride": index, "codes_ptr": codes, "codes_stride": index, "scales_ptr": "*fp32",
                 "scales_stride": index, "res_ptr": res_ty, "res_stride": index,
                 "res_scales_ptr": "*fp32", "res_scales_stride": index, "count_ptr": "*i64" if count else "*fp32",
                 "numel": index, "num_blocks": index, "skip": "i32"}  # fmt: skip
    constexprs = {"QMAX": qmax_for(bits, fmt), "BLOCK": block, "BLOCKS": triton_kernels.blocks_per_program(block),  # type: ignore[arg-type]
                  "BITS": bits, "FMT": 1 if fmt == "fp8" else 0, "STOCHASTIC": stochastic, "RESIDUAL": mode,
                  "COUNT": count}  # fmt: skip
    name = (f"encode {_label(bits, fmt)} {'stochastic' if stochastic else 'nearest'} {ty}"
            f"{' ' + residual if residual else ''}{'' if count else ' uncounted'}{' ' + index if index != 'i32' else ''}")  # fmt: skip
    return Variant(name, triton_kernels._encode_kernel, signature, constexprs, fmt == "fp8")


def _quantize_variants() -> list[Variant]:
    """The encode kernel: every format, rounding and input dtype (counted, as the codecs run
    it), every error-feedback residual, and the uncounted and 64-bit-index specializations."""
    out = []
    for bits, fmt, block in _FORMATS:
        for stochastic in (False, True) if fmt == "int" else (False,):
            for ty in _TYPES.values():
                out.append(_encode_variant(bits, fmt, block, stochastic, ty))
            for residual in _RESIDUALS:
                for ty in ("fp32", "bf16"):
                    out.append(_encode_variant(bits, fmt, block, stochastic, ty, residual))
    out.append(_encode_variant(8, "int", 256, False, "fp32", count=False))
    out.append(_encode_variant(8, "int", 256, False, "fp32", "fp32 residual", index="i64"))
    out.append(_encode_variant(4, "int", 2, False, "fp32"))  # the smallest block: one byte of codes
    return out


def _dequantize_variants() -> list[Variant]:
    """The decode kernel (store / accumulate, into every dtype; counted as a gather runs it) and
    the decode-sum of a reduce-scatter (into the reduce dtypes)."""
    out = []
    for bits, fmt, block in _FORMATS:
        codes = "*i8" if bits == 8 and fmt == "int" else "*u8"
        blocks = triton_kernels.blocks_per_program(block)
        label = _label(bits, fmt)
        for accumulate in (False, True):
            for ty in _TYPES.values():
                count = not accumulate
                signature = {"codes_ptr": codes, "codes_stride": "i32", "scales_ptr": "*fp32", "scales_stride": "i32",
                             "out_ptr": f"*{ty}", "out_stride": "i32", "count_ptr": "*i64" if count else "*fp32",
                             "numel": "i32", "num_blocks": "i32"}  # fmt: skip
                constexprs = {"BLOCK": block, "BLOCKS": blocks, "BITS": bits, "FMT": 1 if fmt == "fp8" else 0,
                              "ACCUMULATE": accumulate, "COUNT": count}  # fmt: skip
                name = f"decode {label} {'accumulate' if accumulate else 'store counted'} {ty}"
                out.append(Variant(name, triton_kernels._decode_kernel, signature, constexprs, fmt == "fp8"))
        for ty in _TYPES.values():
            signature = {"codes_ptr": codes, "codes_stride": "i32", "scales_ptr": "*fp32", "scales_stride": "i32",
                         "own_ptr": f"*{ty}", "out_ptr": f"*{ty}", "numel": "i32", "num_blocks": "i32",
                         "num_rows": "i32", "skip": "i32", "gap": "i32"}  # fmt: skip
            constexprs = {"BLOCK": block, "BLOCKS": blocks, "BITS": bits, "FMT": 1 if fmt == "fp8" else 0}
            out.append(Variant(f"decode_sum {label} {ty}", triton_kernels._decode_sum_kernel, signature, constexprs,
                               fmt == "fp8"))  # fmt: skip
    return out


def _copy_variants() -> list[Variant]:
    """Copy-out / copy-in per pair of dtypes: one kernel for every layout, its segment count and
    each segment's alignment read from the table ([Note: copy tables], [Note: copy alignment] in
    overlap/kernels/triton_copy.py). The launcher specializes the row stride on a multiple of 16,
    as the runtime's rows are (tests/unit/test_alignment.py); a row stride that is not compiles too."""
    out = []
    for kind, kernel in (("copy_out", triton_copy._copy_out_kernel), ("copy_in", triton_copy._copy_in_kernel)):
        for flat in _TYPES.values():
            for tensors in _TYPES.values():
                signature = {"flat_ptr": f"*{flat}", "base_ptr": f"*{tensors}", "aux_ptr": f"*{tensors}",
                             "table_ptr": "*i64", "row_stride": "i32"}  # fmt: skip
                name = f"{kind} flat {flat} tensors {tensors}"
                out.append(Variant(name, kernel, signature, {"BLOCK": triton_copy.BLOCK}, ints16=True))
        odd = Variant(
            f"{kind} row stride not a multiple of 16", kernel, out[-1].signature, {"BLOCK": triton_copy.BLOCK}
        )
        out.append(odd)
    return out


VARIANTS = _quantize_variants() + _dequantize_variants() + _copy_variants()


def _shard(variants: list[Variant]) -> list[Variant]:
    """`OVERLAP_COMPILE_SHARD=i/n`: every n-th variant from the i-th, so that n processes
    compile them all at once (benchmarks/gpu_check.py's first part, on the device's Triton)."""
    spec = os.environ.get("OVERLAP_COMPILE_SHARD", "")
    if not spec:
        return variants
    index, count = (int(v) for v in spec.split("/"))
    return variants[index::count]


def compile_ptx(variant: Variant, arch: int, options: dict[str, Any] = LAUNCH_OPTIONS, ints16: bool = False) -> str:
    """PTX of `variant` for sm_`arch`, after lowering all the way to a cubin. Pointers are
    specialized as 16-byte aligned, as Triton's launcher does for tensors from torch; with
    `ints16`, the integer arguments as multiples of 16 too, as it does for such values."""
    signature = variant.signature | dict.fromkeys(variant.constexprs, "constexpr")
    attrs = {(i,): [["tt.divisibility", 16]] for i, ty in enumerate(variant.signature.values())
             if ty.startswith("*") or (ints16 and ty in ("i32", "i64"))}  # fmt: skip
    source = ASTSource(fn=variant.kernel, signature=signature, constexprs=variant.constexprs, attrs=attrs)
    with warnings.catch_warnings():  # triton 3.9 announces its fp fusion default change
        warnings.simplefilter("ignore", UserWarning)
        compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=dict(options))
    assert compiled.asm.get("cubin"), f"{variant.name}: no cubin for sm_{arch}"
    return compiled.asm["ptx"]


def _supported(variant: Variant, arch: int) -> bool:
    return not variant.fp8 or divmod(arch, 10) >= FP8_MIN_CAPABILITY


@pytest.mark.parametrize("variant", _shard(VARIANTS), ids=[v.name for v in _shard(VARIANTS)])
def test_kernel_compiles(variant: Variant) -> None:
    for arch in ARCHS:
        if not _supported(variant, arch):
            continue  # test_fp8_rejected_exactly_where_dispatch_falls_back
        ptx = compile_ptx(variant, arch, ints16=variant.ints16)
        where = f"{variant.name} sm_{arch}"
        # fp fusion off: no multiply-add contraction anywhere (bitwise decode, exact error feedback)
        assert "fma." not in ptx, f"{where}: fused multiply-add in the PTX"
        # denormals kept ([Note: kernel numerics across devices] in overlap/kernels/reference.py);
        # the one exception, floor's `cvt.rmi.ftz` (stochastic rounding), the kernel corrects
        flushed = [line for line in ptx.splitlines() if ".ftz" in line and "cvt.rmi.ftz.f32.f32" not in line]
        assert not flushed, f"{where}: flush-to-zero in the PTX: {flushed[:3]}"
        if variant.kernel is triton_kernels._encode_kernel:
            if not variant.fp8 and not variant.constexprs["STOCHASTIC"]:  # (y + M) - M, not folded away
                assert _ROUND_MAGIC_PTX in ptx, f"{where}: the rounding constant is gone"
            assert "div.rn.f32" in ptx, f"{where}: IEEE division expected"
        if variant.constexprs.get("COUNT"):  # the non-finite count fused: one atomic add per program
            assert "atom.global" in ptx or "red.global" in ptx, f"{where}: no atomic add for the count"
        if variant.kernel in (triton_copy._copy_out_kernel, triton_copy._copy_in_kernel):
            # both branches in one kernel ([Note: copy alignment]): 16-byte accesses for aligned
            # segments (on the flat buffer's side too when its row stride is known to allow them),
            # element-wise ones for the others (the table is read in 8-byte words)
            loads, stores = re.findall(r"ld\.global\.v4\.", ptx), re.findall(r"st\.global\.v4\.", ptx)
            scalar = re.findall(r"(?:ld|st)\.global\.b(?:16|32)\b", ptx)
            assert scalar, f"{where}: no element-wise branch"
            if variant.ints16:
                assert loads and stores, f"{where}: 16-byte loads {len(loads)}, stores {len(stores)}"
            else:
                assert loads or stores, f"{where}: no 16-byte access on the tensors' side"


@pytest.mark.parametrize(
    "name",
    [
        "encode int8 nearest fp32",
        "encode int8 nearest bf16 fp32 residual",
        "encode int4 nearest fp32",
        "decode int8 accumulate fp32",
        "decode_sum int8 fp32",
    ],
)
def test_row_kernels_vectorize_on_aligned_sizes(name: str) -> None:
    """[Note: rows per launch]: a program's tile is read and written with 16-byte accesses when
    the sizes and row strides are multiples of 16, as a bucket's are (chunks padded to the
    codec's block): the launcher specializes such integers, as compiled here."""
    variant = next(v for v in VARIANTS if v.name == name)
    ptx = compile_ptx(variant, 90, ints16=True)
    assert re.findall(r"ld\.global\.v4\.", ptx), f"{name}: no 16-byte loads"
    assert re.findall(r"st\.global\.v[24]\.", ptx), f"{name}: no vector stores"


def test_fusion_check_can_fail() -> None:
    """The "fma." check above is meaningful: with Triton's default fusion the accumulating
    decode does contract (the bug the launch options prevent)."""
    variant = next(v for v in VARIANTS if v.name == "decode int8 accumulate fp32")
    fused = compile_ptx(variant, 90, LAUNCH_OPTIONS | {"enable_fp_fusion": True})
    assert "fma." in fused


@pytest.mark.parametrize("arch", [80, 86, 89, 90])
def test_fp8_rejected_exactly_where_dispatch_falls_back(arch: int, monkeypatch) -> None:
    """fp8 kernels compile from sm_89 on and are rejected below; the dispatch picks Triton for
    fp8 exactly where they compile (and the reference elsewhere), int formats everywhere."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: divmod(arch, 10))
    monkeypatch.setattr(triton_launch, "_capability", {})
    monkeypatch.setattr(quantize, "_fp8_fallback_warned", set())
    fp8 = [v for v in VARIANTS if v.fp8 and v.name.endswith("fp32")]
    assert fp8
    compiles = []
    for variant in fp8:
        try:
            compile_ptx(variant, arch)
            compiles.append(True)
        except Exception as exc:  # triton's CompilationError: the type is unsupported
            chain, cause = [], exc  # the fp8 cast fails inside a jitted helper: look down the causes
            while cause is not None:
                chain.append(str(cause).lower())
                cause = cause.__cause__ or cause.__context__
            assert any("fp8" in text for text in chain), f"{variant.name} sm_{arch}: unexpected failure {exc!r}"
            compiles.append(False)
    assert len(set(compiles)) == 1, f"sm_{arch}: fp8 variants disagree: {compiles}"
    device = torch.device("cuda", 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the fallback's one-time warning
        chosen = quantize.select_backend(device, 256, fmt="fp8")
    assert (chosen == "triton") == compiles[0], f"sm_{arch}: dispatch {chosen!r}, compiles {compiles[0]}"
    assert quantize.select_backend(device, 256, fmt="int") == "triton"


class _LaunchRecorder:
    """Stands in for a jitted kernel: records each launch's keyword arguments and whether it
    ran inside the device guard of the tensors it was given."""

    def __init__(self, guard: list[torch.device]) -> None:
        self.guard = guard
        self.launches: list[tuple[dict[str, Any], list[torch.device]]] = []

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.launches.append((kwargs, list(self.guard)))

        return launch


def test_every_launch_uses_the_launch_options_under_the_tensors_device(monkeypatch) -> None:
    """What the compile above assumes of the launches: every wrapper passes LAUNCH_OPTIONS
    (fp fusion off) and launches inside `on_device` of its tensors ([Note: Triton launches])."""
    from contextlib import contextmanager

    guard: list[torch.device] = []

    @contextmanager
    def on_device(t: torch.Tensor):
        guard.append(t.device)
        try:
            yield
        finally:
            guard.pop()

    kernels = {}
    for module, name in ((triton_kernels, "_encode_kernel"), (triton_kernels, "_decode_kernel"),
                         (triton_kernels, "_decode_sum_kernel"), (triton_copy, "_copy_out_kernel"),
                         (triton_copy, "_copy_in_kernel")):  # fmt: skip
        kernels[name] = _LaunchRecorder(guard)
        monkeypatch.setattr(module, name, kernels[name])
    monkeypatch.setattr(triton_kernels, "on_device", on_device)
    monkeypatch.setattr(triton_copy, "on_device", on_device)
    x = torch.randn(1000)
    codes, scales = triton_kernels.quantize_blockwise(x, 8, 256)
    triton_kernels.quantize_blockwise(x, 4, 256, noise=torch.rand(1024))
    triton_kernels.dequantize_blockwise(codes, scales, 8, 256, 1000, x.clone(), True)
    triton_kernels.quantize_feedback_blockwise(x, torch.zeros(1000), 8, 256)
    rows = torch.randn(3, 512)
    wire_codes, wire_scales = torch.empty(3, 512, dtype=torch.int8), torch.empty(3, 2)
    triton_kernels.encode_rows(rows, wire_codes, wire_scales, 8, 256, skip=1, count=torch.zeros((), dtype=torch.int64))
    triton_kernels.decode_sum_rows(wire_codes, wire_scales, rows[1], 1, 3, 8, 256, torch.empty(512))
    flat = torch.randn(64)
    triton_copy.copy_out(flat, [torch.empty(32, dtype=torch.bfloat16), torch.empty(30)], [32, 32], [16, 16], 2)
    triton_copy.copy_in([torch.randn(30), None], flat, [32, 32], [16, 16], 2)
    for name, recorder in kernels.items():
        assert recorder.launches, f"{name} was never launched"
        for kwargs, devices in recorder.launches:
            assert kwargs.items() >= LAUNCH_OPTIONS.items(), f"{name}: launched with {kwargs}"
            assert devices == [torch.device("cpu")], f"{name}: launched outside the tensors' device guard"


def test_copy_layouts_share_one_compiled_kernel(monkeypatch) -> None:
    """[Note: copy tables] in overlap/kernels/triton_copy.py: the segment count and each
    segment's alignment are data, not compile-time constants, so layouts of 1 to 40 segments,
    aligned, unaligned or mixed, launch the same kernel with the same constexprs (Triton compiles
    one variant per constexpr set and argument specialization), once per copy."""
    for kernel in (triton_copy._copy_out_kernel, triton_copy._copy_in_kernel):
        assert [p.name for p in kernel.params if p.is_constexpr] == ["BLOCK"]
    guard: list[torch.device] = []
    recorders = {name: _LaunchRecorder(guard) for name in ("_copy_out_kernel", "_copy_in_kernel")}
    for name, recorder in recorders.items():
        monkeypatch.setattr(triton_copy, name, recorder)
    n = 8
    for num_segments in (1, 3, 17, 40):
        for odd in (0, 1, num_segments):  # segments whose data columns are not a multiple of 16
            cols = [16 * (1 + i % 3) for i in range(num_segments)]
            data = [c - (i < odd) for i, c in enumerate(cols)]
            sizes = [n * c for c in cols]
            flat = torch.zeros(sum(sizes), dtype=torch.bfloat16)
            outs = [torch.empty(n * d, dtype=torch.bfloat16) for d in data]
            triton_copy.copy_out(flat, outs, sizes, data, n)
            triton_copy.copy_in(outs, flat, sizes, data, n)
    for name, recorder in recorders.items():
        assert len(recorder.launches) == 12, f"{name}: {len(recorder.launches)} launches for 12 copies"
        assert len({tuple(sorted(kwargs.items())) for kwargs, _ in recorder.launches}) == 1, name
