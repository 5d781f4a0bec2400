"""Run by tests/unit/test_kernels.py in a fresh process with TRITON_INTERPRET=1: the Triton kernels
(interpreted on the CPU) against the torch reference, bitwise, on shapes that are not multiples
of the block: blockwise quantize / dequantize, and the fused copy-out / copy-in with cast.
Then the no-host-sync property of the wrappers ([Note: copy tables] in triton_copy.py): a
repeated call builds and uploads nothing. Exits non-zero with the failing case."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

from helpers.kernel_inputs import random_input

from overlap.kernels import copy_in, copy_in_ref, copy_out, copy_out_ref
from overlap.kernels import triton_kernels as tk
from overlap.kernels.quantize import (
    dequantize_blockwise,
    quantize_blockwise,
    quantize_feedback_blockwise,
    quantize_feedback_int8res_blockwise,
)
from overlap.kernels.reference import code_numel, dequantize_blockwise_ref, num_blocks_for, quantize_blockwise_ref
from overlap.kernels.rows import decode_rows, decode_sum_rows, encode_rows_loop

OUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _call_bound(bound: Callable, srcs: Any, full: torch.Tensor) -> Any:
    return bound(srcs, full)


_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
COPY_PAIRS = [  # (flat dtype, tensors' dtype)
    (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.float32),
    (torch.float32, torch.float32),
    (torch.float16, torch.bfloat16),
]
# (columns per segment, data columns per segment (None: all), padding per segment, num_rows):
# odd and empty segments, a segment wider than one tile, padding columns in every row (as the
# runtime's padded chunks), and all-multiples-of-16 layouts that take the aligned branch
COPY_LAYOUTS = [
    ([5, 0, 1, 33, 1100, 2], None, [0, 0, 1, 4, 7, 0], 1),
    ([3, 17, 0, 64], None, [1, 0, 0, 5], 3),
    ([16, 1040, 32], None, [0, 0, 0], 2),
    ([16, 32, 1056, 16], [13, 32, 1043, 0], [5, 0, 3, 0], 2),
    ([32, 48, 16], [32, 48, 16], [0, 16, 0], 4),
    ([0], None, [0], 1),
]


def copy_values(numel: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(numel, generator=gen) * 40
    special = torch.tensor([1.0 + 3 * 2**-8, -(1.0 + 2**-8), 3e-41, float("inf"), -0.0, 3.4e38])
    k = min(numel, len(special))
    x[torch.randperm(numel, generator=gen)[:k]] = special[:k]
    return x.to(dtype)


def check_copy(gen: torch.Generator) -> int:
    cases = 0
    for cols, data_cols, pads, rows in COPY_LAYOUTS:
        sizes = [c * rows for c in cols]
        data = cols if data_cols is None else data_cols
        valid = [rows * d - p for d, p in zip(data, pads)]
        for flat_dtype, dtype in COPY_PAIRS:
            where = f"triton copy {flat_dtype}<->{dtype} rows={rows} cols={cols} data_cols={data_cols}"
            flat = copy_values(sum(sizes), flat_dtype, gen)
            ref = [torch.full((n,), 7.0, dtype=dtype) for n in valid]
            got = [t.clone() for t in ref]
            copy_out_ref(flat, ref, sizes, rows, data_cols)
            copy_out(flat, got, sizes=sizes, num_rows=rows, data_cols=data_cols, backend="triton")
            for r, g in zip(ref, got):
                assert torch.equal(r.view(_INT_VIEW[dtype]), g.view(_INT_VIEW[dtype])), "copy_out " + where
            # mixed source dtypes (two launches) and a None source (zeros)
            srcs = [
                None if i == 1 else copy_values(n, dtype if i % 2 else flat_dtype, gen) for i, n in enumerate(valid)
            ]
            ref_flat = torch.full((sum(sizes),), 7.0, dtype=flat_dtype)
            got_flat = ref_flat.clone()
            copy_in_ref(srcs, ref_flat, sizes, rows, data_cols)
            copy_in(srcs, got_flat, sizes=sizes, num_rows=rows, data_cols=data_cols, backend="triton")
            iv = _INT_VIEW[flat_dtype]
            assert torch.equal(ref_flat.view(iv), got_flat.view(iv)), "copy_in " + where
            cases += 1
    return cases


class CountLaunches:
    """Wraps a jitted kernel: `kernel[grid](...)` launches it and counts the launch."""

    def __init__(self, kernel: Any) -> None:
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid: Any) -> Any:
        self.launches += 1
        return self.kernel[grid]


def reallocate_elsewhere(t: torch.Tensor) -> None:
    """Free `t`'s storage and allocate it again at another address, as the runtime does with a
    unit's unsharded buffer every step."""
    address, nbytes = t.data_ptr(), t.untyped_storage().nbytes()
    held = []
    for _ in range(16):
        t.untyped_storage().resize_(0)
        held.append(torch.empty(nbytes, dtype=torch.uint8))  # may take the block just freed
        t.untyped_storage().resize_(nbytes)
        if t.data_ptr() != address:
            return
    raise AssertionError("the allocator kept returning the same block")


RUNTIME_SHAPES = [(48, 20), (48,), (7, 3), (1000,), (64, 16), (3,)]  # odd chunks: unaligned segments
RUNTIME_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def check_runtime_copies(gen: torch.Generator) -> int:
    """The runtime's copies of a unit ([Note: flat layout]) at world sizes 1, 2 and 8, tagged from
    2 ranks on (the tag slot a buffer of its own, [Note: second base] in triton_copy.py), with
    unaligned chunks, for every pair of fp32 / bf16 / fp16: unbound and bound, bitwise the torch
    reference (the tags' bits exact), one launch per copy where the dtypes allow ([Note: copy
    alignment]). Bound, a copy-out into a reallocated unsharded buffer builds and uploads nothing."""
    from overlap.engine.units import CHUNK_ALIGN_NUMEL, ParamInfo, make_layout
    from overlap.kernels import triton_copy
    from overlap.transport.fingerprint import TAG_NUMEL

    counters = {"out": CountLaunches(triton_copy._copy_out_kernel), "in": CountLaunches(triton_copy._copy_in_kernel)}
    triton_copy._copy_out_kernel, triton_copy._copy_in_kernel = counters["out"], counters["in"]  # type: ignore[assignment]

    def launched(kind: str, fn: Callable[[], object]) -> int:
        before = counters[kind].launches
        fn()
        return counters[kind].launches - before

    cases = 0
    try:
        for n in (1, 2, 8):
            infos = [ParamInfo(f"p{i}", ((f"m{i}", "w"),), torch.Size(s), True) for i, s in enumerate(RUNTIME_SHAPES)]
            layout = make_layout(0, "u", ("m",), infos, n, align_numel=CHUNK_ALIGN_NUMEL)
            tag = TAG_NUMEL if n > 1 else 0
            sizes = [n * s.padded_chunk_numel for s in layout.slots] + ([n * tag] if tag else [])
            cols = [s.chunk_numel for s in layout.slots] + ([tag] if tag else [])
            assert any(c % 16 for c in cols), "the layout has no unaligned segment"
            for src in RUNTIME_DTYPES:
                for dst in RUNTIME_DTYPES:
                    where = f"ws={n} {src}->{dst}"
                    gathered = copy_values(n * (layout.shard_numel + tag), src, gen)
                    if tag:  # any bits in the tag slots, NaN patterns too
                        bits = torch.randint(-(2**62), 2**62, (n, tag * src.itemsize // 8), generator=gen)
                        gathered.view(n, -1)[:, layout.shard_numel :] = bits.view(src)
                    want = torch.full((layout.unsharded_numel,), 7.0, dtype=dst)
                    want_tags = torch.full((n * tag,), 7.0, dtype=src)
                    views = [(s.unsharded_offset, n * s.chunk_numel) for s in layout.slots]
                    copy_out_ref(
                        gathered, [want[o : o + k] for o, k in views] + ([want_tags] if tag else []), sizes, n, cols
                    )
                    unsharded, tags = torch.full_like(want, 7.0), torch.full_like(want_tags, 3.0)  # padding: as `want`
                    outs = [unsharded[o : o + k] for o, k in views] + ([tags] if tag else [])
                    expected = 1 + (tag > 0 and src != dst)  # the tags keep the gathered dtype
                    count = launched("out", lambda: copy_out(gathered, outs, sizes=sizes, num_rows=n, data_cols=cols,
                                                            backend="triton"))  # fmt: skip
                    assert count == expected, f"copy_out {where}: {count} launches"
                    assert _equal(unsharded, want) and torch.equal(
                        tags.view(_INT_VIEW[src]), want_tags.view(_INT_VIEW[src])
                    ), "copy_out " + where
                    bound = triton_copy.bind_copy_out(outs, sizes, cols, n)
                    for _ in range(2):  # the second time into a reallocated buffer, elsewhere
                        reallocate_elsewhere(unsharded)
                        unsharded.fill_(7.0)
                        tags.fill_(3.0)
                        with record_host_calls() as built:
                            count = launched("out", lambda: bound(gathered))
                        assert count == expected, f"bound copy_out {where}: {count} launches"
                        assert _equal(unsharded, want), "bound copy_out " + where
                        assert torch.equal(tags.view(_INT_VIEW[src]), want_tags.view(_INT_VIEW[src])), (
                            "bound tags " + where
                        )
                    assert not built, f"bound copy_out {where}: a repeated layout built host data: {built}"
                    # copy-in: the gradients (one missing), then the used flags in their dtype
                    grads = [
                        None if i == 2 else copy_values(s.numel, src, gen) for i, s in enumerate(layout.grad_slots)
                    ]
                    num_flags = len(grads)
                    flags = torch.tensor([g is not None for g in grads], dtype=src).repeat(n)
                    flag_cols = -(-num_flags // CHUNK_ALIGN_NUMEL) * CHUNK_ALIGN_NUMEL
                    in_sizes = [n * s.padded_chunk_numel for s in layout.grad_slots] + [n * flag_cols]
                    in_cols = [s.chunk_numel for s in layout.grad_slots] + [num_flags]
                    srcs = [*grads, flags]
                    want_full = torch.full((sum(in_sizes),), 7.0, dtype=dst)
                    copy_in_ref(srcs, want_full, in_sizes, n, in_cols)
                    for name, run in (
                        ("copy_in", lambda f: copy_in(srcs, f, sizes=in_sizes, num_rows=n, data_cols=in_cols, backend="triton")),
                        ("bound copy_in", functools.partial(_call_bound, triton_copy.bind_copy_in(in_sizes, in_cols, n), srcs)),
                    ):  # fmt: skip
                        got_full = torch.full_like(want_full, 3.0)
                        count = launched("in", lambda: run(got_full))
                        assert count == 1, f"{name} {where}: {count} launches"
                        assert torch.equal(got_full.view(_INT_VIEW[dst]), want_full.view(_INT_VIEW[dst])), (
                            f"{name} {where}"
                        )
                    cases += 1
    finally:
        triton_copy._copy_out_kernel, triton_copy._copy_in_kernel = counters["out"].kernel, counters["in"].kernel
    return cases


# ------------------------------------------------------------------------------ no host sync
_OVERLAP = str(Path(__file__).resolve().parents[2] / "overlap")
_WATCHED = (os.path.join(_OVERLAP, "kernels") + os.sep, os.path.join(_OVERLAP, "compression") + os.sep)


@contextmanager
def record_host_calls() -> Iterator[list[tuple[str, str, bool]]]:
    """Record the calls made directly from overlap/kernels/ and overlap/compression/ that build
    host data or could block a CUDA host: (what, where, blocks). `blocks` is what it would do on
    CUDA: a device tensor from host data (`torch.tensor(..., device=)`), a `.to()`/`.cpu()`
    without non_blocking=True, or reading a value (`.item()`, `.tolist()`, `bool()`, ...)."""
    calls: list[tuple[str, str, bool]] = []

    def caller() -> str | None:
        frame = sys._getframe(2)
        name = frame.f_code.co_filename
        return f"{name}:{frame.f_lineno}" if name.startswith(_WATCHED) else None

    def wrap(owner: Any, name: str, blocks: Callable[..., bool]) -> tuple[Any, str, Any]:
        original = getattr(owner, name)

        def patched(*args: Any, **kwargs: Any) -> Any:
            where = caller()
            if where is not None:
                calls.append((name, where, blocks(*args, **kwargs)))
            return original(*args, **kwargs)

        setattr(owner, name, patched)
        return owner, name, original

    def to_blocks(*args: Any, **kwargs: Any) -> bool:
        return not kwargs.get("non_blocking", False) and not any(a is True for a in args[1:])

    patches = [
        wrap(torch, "tensor", lambda *a, **k: k.get("device") not in (None, "cpu", torch.device("cpu"))),
        wrap(torch.Tensor, "to", to_blocks),
        wrap(torch.Tensor, "cpu", lambda *a, **k: True),
    ]
    for name in ("tolist", "item", "__bool__", "__int__", "__float__"):
        patches.append(wrap(torch.Tensor, name, lambda *a, **k: True))
    try:
        yield calls
    finally:
        for owner, name, original in reversed(patches):
            setattr(owner, name, original)


def check_no_host_sync(gen: torch.Generator) -> None:
    """The runtime's copies of a padded unit ([Note: flat layout]) and the quantize kernels, run
    twice: the second run builds and uploads nothing. Fresh gradient tensors (copy-in sources
    are new every step) may need a new table, but only sent without blocking."""
    from overlap.engine.units import CHUNK_ALIGN_NUMEL, ParamInfo, make_layout

    n = 4
    shapes = [(48, 20), (48,), (7, 3), (50, 1), (64, 16), (3,)]
    infos = [ParamInfo(f"p{i}", ((f"m{i}", "w"),), torch.Size(s), True) for i, s in enumerate(shapes)]
    layout = make_layout(0, "unit0", ("m",), infos, n, align_numel=CHUNK_ALIGN_NUMEL)
    sizes = [n * s.padded_chunk_numel for s in layout.slots]
    data = [s.chunk_numel for s in layout.slots]

    def gather_and_copy_out(gathered: torch.Tensor, param_dtype: torch.dtype) -> torch.Tensor:
        unsharded = torch.empty(layout.unsharded_numel, dtype=param_dtype)  # new storage each step
        outs = [unsharded[s.unsharded_offset : s.unsharded_offset + n * s.chunk_numel] for s in layout.slots]
        copy_out(gathered, outs, sizes=sizes, data_cols=data, num_rows=n, backend="triton")
        return unsharded

    def reduce_copy_in(grads: list[torch.Tensor | None]) -> torch.Tensor:
        flags = torch.ones(n * len(grads))
        full = torch.empty(n, sum(sizes) // n + len(grads))
        copy_in([*grads, flags], full, sizes=[*sizes, n * len(grads)], data_cols=[*data, len(grads)], num_rows=n,
                backend="triton")  # fmt: skip
        return full

    def new_grads() -> list[torch.Tensor | None]:
        return [None if i == 2 else torch.randn(s, generator=gen).bfloat16() for i, s in enumerate(shapes)]

    x = torch.randn(3000, generator=gen)
    noise = torch.rand(num_blocks_for(3000, 256) * 256, generator=gen)
    steps: list[tuple[str, Callable[[], object]]] = []
    for param_dtype in (torch.bfloat16, torch.float32):  # a cast, and no cast
        gathered = torch.randn(layout.unsharded_numel, generator=gen).bfloat16()
        steps.append((f"copy_out bf16->{param_dtype}", lambda g=gathered, d=param_dtype: gather_and_copy_out(g, d)))
    grads = new_grads()
    steps.append(("copy_in", lambda: reduce_copy_in(grads)))
    codes, scales = quantize_blockwise(x, 8, 256, backend="triton")
    steps += [
        ("quantize", lambda: quantize_blockwise(x, 8, 256, backend="triton")),
        ("quantize stochastic", lambda: tk.quantize_blockwise(x, 4, 256, noise=noise)),
        (
            "dequantize-accumulate",
            lambda: dequantize_blockwise(codes, scales, 8, 256, 3000, x.clone(), True, backend="triton"),
        ),
    ]
    for name, step in steps:
        with record_host_calls() as first:
            step()
        with record_host_calls() as second:
            step()
        assert not second, f"{name}: the repeated call built or read host data: {second}"
        if name.startswith("copy"):  # the recorder sees the wrappers' host work when there is some
            assert any(what == "tensor" for what, _, _ in first), f"{name}: first call recorded {first}"
    # A new step: fresh gradients. Whatever the copy-in sends is sent without blocking.
    with record_host_calls() as fresh:
        reduce_copy_in(new_grads())
    assert not any(blocks for _, _, blocks in fresh), f"copy_in with new sources would block: {fresh}"
    # Codecs count non-finite blocks on the device ([Note: deferred finite check]): an encode
    # reads nothing back; the once-per-step check does (on the CPU, directly), and the recorder
    # sees that read.
    from overlap.compression import Int8Codec

    codec = Int8Codec(256)
    bad = x.clone()
    bad[7] = float("nan")
    with record_host_calls() as encodes:
        codec.encode(bad)
        codec.encode_feedback(x, torch.zeros(3000))
    assert not encodes, f"codec encode read host data: {encodes}"
    with record_host_calls() as check:
        try:
            codec.raise_if_nonfinite()
        except ValueError:
            pass
        else:
            raise AssertionError("the NaN block was not reported")
    assert any(blocks for _, _, blocks in check), f"the recorder missed the check's read: {check}"


# ------------------------------------------------------------------------------ rows per launch
def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise (as integers: -0.0 is not 0.0), NaN where the other is NaN whatever its payload
    (torch's CPU casts keep a NaN's sign bit, the kernels write the canonical quiet NaN)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    iv = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    if not a.is_floating_point():
        return torch.equal(a, b)
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(iv), b[~nan].view(iv))


def _wire(num_rows: int, numel: int, bits: int, block: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """A (rows, step) uint8 buffer with the codes and scales of each row at an 8-aligned offset
    past a few leading bytes (as a collective's rows), pre-filled with garbage."""
    n_codes, nb = code_numel(numel, bits, block), num_blocks_for(numel, block)
    lead = 8
    at = lead + n_codes + (-n_codes % 4)  # the scales 4-byte aligned
    step = at + 4 * nb + 8
    step += -step % 8
    buf = torch.randint(0, 256, (num_rows, step), generator=gen, dtype=torch.uint8)
    codes = buf[:, lead : lead + n_codes]
    scales = buf[:, at : at + 4 * nb].view(torch.float32)
    return buf, (codes.view(torch.int8) if bits == 8 else codes), scales


def check_rows(gen: torch.Generator) -> int:
    """One launch for all rows ([Note: rows per launch]) equals the loop over the single-row ops
    (`kernels.rows.*_loop`, on the reference): codes, scales, residuals (fp32, bf16, int8),
    the non-finite count, decode into rows with its count, and the rank-order decode-sum with
    and without this rank's row present."""
    cases = 0
    for numel, block in [(1, 2), (70, 16), (333, 64), (1100, 256)]:
        for bits in (8, 4):
            for num_rows, skip in [(1, None), (3, 1), (4, 0), (4, 3)]:
                x = random_input(num_rows * numel, torch.float32, gen).view(num_rows, numel)
                if numel > 3:
                    x[0, 1] = float("nan")
                    x[-1, -1] = float("inf")
                x = x.to(torch.bfloat16) if cases % 3 == 2 else x
                encoded = num_rows - (skip is not None)
                nb = num_blocks_for(numel, block)
                for mode in ("none", "fp32", "bf16", "int8", "stochastic"):
                    where = f"rows int{bits} block={block} numel={numel} rows={num_rows} skip={skip} {mode} {x.dtype}"
                    if mode == "int8":
                        res0: Any = quantize_blockwise_ref(torch.randn(encoded * numel, generator=gen), 8, block)
                        res0 = (torch.stack([quantize_blockwise_ref(torch.randn(numel, generator=gen) * 0.01, 8, block)[0]
                                             for _ in range(encoded)]),
                                torch.stack([torch.rand(nb, generator=gen) * 1e-3 for _ in range(encoded)]))  # fmt: skip
                    elif mode in ("fp32", "bf16"):
                        res0 = (torch.randn(encoded, numel, generator=gen) * 0.01).to(
                            getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[mode])
                        )
                    else:
                        res0 = None
                    noise = torch.rand(encoded, nb * block, generator=gen) if mode == "stochastic" else None
                    outs = []
                    for backend in ("triton", "ref"):
                        buf, codes, scales = _wire(num_rows, numel, bits, block, torch.Generator().manual_seed(5))
                        res = (
                            None
                            if res0 is None
                            else (tuple(t.clone() for t in res0) if isinstance(res0, tuple) else res0.clone())
                        )
                        count = torch.zeros((), dtype=torch.int64)
                        if backend == "triton":
                            tk.encode_rows(
                                x, codes, scales, bits, block, skip=skip, noise=noise, residual=res, count=count
                            )
                        else:
                            encode_rows_loop(x, codes, scales, bits, block, skip=skip, noise=noise, residual=res,
                                             count=count, backend="ref")  # fmt: skip
                        outs.append((buf, res, count))
                    (b1, r1, c1), (b2, r2, c2) = outs
                    assert _equal(b1, b2), "wire " + where
                    assert int(c1) == int(c2), f"count {int(c1)} != {int(c2)} " + where
                    if r1 is not None:
                        for t1, t2 in zip(
                            r1 if isinstance(r1, tuple) else (r1,), r2 if isinstance(r2, tuple) else (r2,)
                        ):
                            assert _equal(t1, t2), "residual " + where
                    cases += 1
                # decode every row into rows (an all-gather), counting NaN scales
                buf, codes, scales = _wire(num_rows, numel, bits, block, gen)
                encode_rows_loop(x, codes, scales, bits, block, backend="ref")
                for out_dtype in OUT_DTYPES:
                    outs = []
                    for backend in ("triton", "ref"):
                        out = torch.full((num_rows, numel), 7.0, dtype=out_dtype)
                        count = torch.zeros((), dtype=torch.int64)
                        decode_rows(codes, scales, bits, block, numel, out, count=count, backend=backend)  # type: ignore[arg-type]
                        outs.append((out, int(count)))
                    assert _equal(outs[0][0], outs[1][0]) and outs[0][1] == outs[1][1], (
                        f"decode_rows {out_dtype} " + where
                    )
                # the decode-sum of a reduce-scatter: this rank's row is `own`, absent or present
                if skip is not None:
                    own = random_input(numel, x.dtype, gen)
                    for present in (True, False):
                        rows_c = codes if present else torch.cat([codes[:skip], codes[skip + 1 :]])
                        rows_s = scales if present else torch.cat([scales[:skip], scales[skip + 1 :]])
                        for out_dtype in OUT_DTYPES:
                            got = tk.decode_sum_rows(rows_c, rows_s, own, skip, num_rows, bits, block,
                                                     torch.empty(numel, dtype=out_dtype))  # fmt: skip
                            want = decode_sum_rows(rows_c, rows_s, own, skip, num_rows, bits, block,
                                                   torch.empty(numel, dtype=out_dtype), backend="ref")  # fmt: skip
                            assert _equal(got, want), f"decode_sum present={present} {out_dtype} " + where
    return cases


def check_fused_feedback(gen: torch.Generator) -> int:
    """The fused error-feedback quantize (Triton, one pass) equals its composition on the
    reference (add, quantize, decode, subtract; int8 residual: decode it first, re-encode it
    after), bitwise: codes, scales and the residual."""
    cases = 0
    block = 64
    for numel in (1, 63, 64, 333):
        for bits in (8, 4):
            for stochastic in (False, True):
                x = (torch.randn(numel, generator=gen) * 3).to(torch.bfloat16 if cases % 2 else torch.float32)
                x[: numel // 7] *= 1e-3
                r0 = torch.randn(numel, generator=gen) * 0.01
                outs = {}
                for backend in ("ref", "triton"):
                    r = r0.clone()
                    g = torch.Generator().manual_seed(7)
                    outs[backend] = (*quantize_feedback_blockwise(x, r, bits, block, stochastic, g, backend=backend), r)
                assert all(_equal(a, b) for a, b in zip(outs["ref"], outs["triton"])), ("fp32 residual", numel, bits)
                res0 = quantize_blockwise_ref(torch.randn(numel, generator=gen) * 0.01, 8, block)
                outs = {}
                for backend in ("ref", "triton"):
                    rc, rs = res0[0].clone(), res0[1].clone()
                    g = torch.Generator().manual_seed(7)
                    outs[backend] = (*quantize_feedback_int8res_blockwise(x, rc, rs, bits, block, stochastic, g,
                                                                          backend=backend), rc, rs)  # fmt: skip
                assert all(_equal(a, b) for a, b in zip(outs["ref"], outs["triton"])), ("int8 residual", numel, bits)
                cases += 2
    return cases


def check_quantize(gen: torch.Generator) -> int:
    """Blockwise quantize (round to nearest and stochastic) and dequantize, with and without
    accumulating, into every output dtype."""
    cases = 0
    for numel, block in [(1, 2), (7, 4), (64, 64), (100, 16), (333, 64), (1000, 128)]:
        nb = num_blocks_for(numel, block)
        for bits in (8, 4):
            for dtype in (torch.float32, torch.bfloat16):
                x = random_input(numel, dtype, gen)
                where = f"triton int{bits} block={block} numel={numel} {dtype}"
                ref = quantize_blockwise_ref(x, bits, block)
                got = tk.quantize_blockwise(x, bits, block)
                assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1]), where
                noise = torch.rand(nb * block, generator=gen)
                sref = quantize_blockwise_ref(x, bits, block, True, noise=noise)
                sgot = tk.quantize_blockwise(x, bits, block, noise=noise)
                assert torch.equal(sref[0], sgot[0]) and torch.equal(sref[1], sgot[1]), "stochastic " + where
                for out_dtype in OUT_DTYPES:
                    base = torch.randn(numel, generator=gen).to(out_dtype)
                    for accumulate in (False, True):
                        r = dequantize_blockwise_ref(*ref, bits, block, numel, base.clone(), accumulate)
                        o = tk.dequantize_blockwise(*ref, bits, block, numel, base.clone(), accumulate)
                        assert torch.equal(r, o), f"dequantize acc={accumulate} out={out_dtype} " + where
                cases += 1
    return cases


PARTS: dict[str, tuple[Callable[[torch.Generator], int | None], ...]] = {
    "kernels": (check_quantize, check_rows, check_fused_feedback, check_copy),
    "runtime": (check_runtime_copies, check_no_host_sync),
}
"""Halves of about equal time (the interpreter runs every program of a grid in Python): the test
runs them as two processes at once."""


def main(parts: list[str]) -> None:
    for part in parts:
        gen = torch.Generator().manual_seed(2)
        done = []
        for check in PARTS[part]:
            cases, name = check(gen), check.__name__.removeprefix("check_")
            done.append(name if cases is None else f"{name} ({cases} cases)")
        print(f"checked {part}: {', '.join(done)}: interpreted Triton == reference")


if __name__ == "__main__":
    unknown = set(sys.argv[1:]) - set(PARTS)
    assert not unknown, f"unknown parts {sorted(unknown)}; choose from {list(PARTS)}"
    main(sys.argv[1:] or list(PARTS))
