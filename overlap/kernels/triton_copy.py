"""Triton kernels for the fused copy-out / copy-in with cast ([Note: fused copy layout], copy.py).

One launch moves every tensor of one dtype: the many tensors travel as a table of addresses
(int64, cast back to typed pointers in the kernel, as the grouped-GEMM tutorial does). The job is
cut into tiles of BLOCK columns of one row of one segment; a program finds its segment by binary
search over the segments' first tiles (a short table, no per-tile metadata), so a launch costs
one small host-to-device copy whatever the buffer size.

Alignment: segments whose addresses and extents are all multiples of 16 elements (the usual
case: parameter chunks of any real width) go to a variant compiled with `tl.multiple_of` hints,
so that the compiler may emit 16-byte vector loads and stores; any other segments go to a second
launch of the same kernel without hints. The variant is a constexpr, not a run-time branch:
`tl.multiple_of` annotates the op that defined its argument, so a hint inside a run-time branch
would leak to the other branch. Results are identical either way.

Casts to bf16 round on the bits (round half to even, NaN kept NaN): the GPU's cast does the
same, but the interpreter truncates, and one definition keeps both testable against torch.
Tested on CPU under TRITON_INTERPRET=1 (tests/triton_interpreter_check.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

try:
    import triton  # type: ignore[import-not-found, import-untyped, unused-ignore]
    import triton.language as tl  # type: ignore[import-not-found, import-untyped, unused-ignore]
except ImportError:  # the package works without triton: dispatch falls back
    triton = None
    tl = None

BLOCK = 1024  # columns per tile: 4 warps x 32 lanes x 8 elements
NUM_FIELDS = 5  # per segment: address, first column, columns, valid elements, tiles per row
_ALIGN_ELEMS = 16  # multiples of 16 elements: 16-byte vectors for every supported dtype


def available() -> bool:
    return triton is not None


if triton is not None:
    _TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

    @triton.jit
    def _cast(v, DST: tl.constexpr):
        if v.dtype == DST:
            out = v
        else:
            if v.dtype == tl.bfloat16:  # exact widening on the bits (no denormal flush anywhere)
                f = (v.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
            else:
                f = v.to(tl.float32)
            if DST == tl.bfloat16:
                b = f.to(tl.uint32, bitcast=True)
                r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
                r = tl.where(f != f, 0x7FC0, r)  # noqa: PLR0124  (NaN test)
                out = r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
            else:
                out = f.to(DST)
        return out

    @triton.jit
    def _locate(table_ptr, LOG_SEGS: tl.constexpr, NUM_STARTS: tl.constexpr, BLOCK: tl.constexpr):
        """This program's segment (largest i with first_tile[i] <= pid): its address, first
        column, columns, valid elements, and the tile's row and first column."""
        pid = tl.program_id(0).to(tl.int64)
        seg = pid * 0
        for s in tl.static_range(LOG_SEGS):  # binary lifting; padding entries are int64 max
            cand = seg + (1 << (LOG_SEGS - 1 - s))
            seg = tl.where(tl.load(table_ptr + cand) <= pid, cand, seg)
        local = pid - tl.load(table_ptr + seg)
        fields = table_ptr + NUM_STARTS + seg * 5  # NUM_FIELDS
        addr = tl.load(fields)
        col_off = tl.load(fields + 1)
        cols = tl.load(fields + 2)
        valid = tl.load(fields + 3)
        tiles_per_row = tl.load(fields + 4)
        row = local // tiles_per_row
        col0 = (local - row * tiles_per_row) * BLOCK
        return addr, col_off, cols, valid, row, col0

    @triton.jit
    def _copy_out_kernel(
        flat_ptr, table_ptr, row_stride,
        OUT_DTYPE: tl.constexpr, LOG_SEGS: tl.constexpr, NUM_STARTS: tl.constexpr, BLOCK: tl.constexpr,
        ALIGNED: tl.constexpr,
    ):  # fmt: skip
        addr, col_off, cols, valid, row, col0 = _locate(table_ptr, LOG_SEGS, NUM_STARTS, BLOCK)
        src_base = row * row_stride + col_off + col0
        dst_base = row * cols + col0
        # The hints stay inline in both kernels: returned from a helper @triton.jit function
        # they are lost (test_copy_triton_compiles_for_sm90 then finds scalar loads).
        if ALIGNED:  # the host checked every segment of this launch (see _launches)
            addr = tl.multiple_of(addr, 16)
            src_base = tl.multiple_of(src_base, 16)
            dst_base = tl.multiple_of(dst_base, 16)
            cols = tl.multiple_of(cols, 16)
            valid = tl.multiple_of(valid, 16)
        out_ptr = addr.to(tl.pointer_type(OUT_DTYPE))
        if ALIGNED:
            out_ptr = tl.multiple_of(out_ptr, 16)
        j = tl.arange(0, BLOCK)
        mask = (col0 + j < cols) & (dst_base + j < valid)
        v = tl.load(flat_ptr + src_base + j, mask=mask)
        tl.store(out_ptr + dst_base + j, _cast(v, OUT_DTYPE), mask=mask)

    @triton.jit
    def _copy_in_kernel(
        flat_ptr, table_ptr, row_stride,
        SRC_DTYPE: tl.constexpr, LOG_SEGS: tl.constexpr, NUM_STARTS: tl.constexpr, BLOCK: tl.constexpr,
        ALIGNED: tl.constexpr,
    ):  # fmt: skip
        addr, col_off, cols, valid, row, col0 = _locate(table_ptr, LOG_SEGS, NUM_STARTS, BLOCK)
        dst_base = row * row_stride + col_off + col0
        src_base = row * cols + col0
        if ALIGNED:  # the host checked every segment of this launch (see _launches)
            addr = tl.multiple_of(addr, 16)
            src_base = tl.multiple_of(src_base, 16)
            dst_base = tl.multiple_of(dst_base, 16)
            cols = tl.multiple_of(cols, 16)
            valid = tl.multiple_of(valid, 16)
        src_ptr = addr.to(tl.pointer_type(SRC_DTYPE))
        if ALIGNED:
            src_ptr = tl.multiple_of(src_ptr, 16)
        j = tl.arange(0, BLOCK)
        in_segment = col0 + j < cols
        v = tl.load(src_ptr + src_base + j, mask=in_segment & (src_base + j < valid), other=0.0)
        tl.store(flat_ptr + dst_base + j, _cast(v, flat_ptr.dtype.element_ty), mask=in_segment)


Segment = tuple[int, int, int, int]  # (address, first column, columns, valid elements)


def _is_aligned(segment: Segment, flat: torch.Tensor, row_stride: int) -> bool:
    """Every address the kernel forms for this segment is 16-byte aligned at tile starts: the
    `tl.multiple_of` hints of the ALIGNED variant hold (16 elements: 16 bytes or more per dtype)."""
    addr, col_off, cols, valid = segment
    extents = (row_stride, col_off, cols, valid)
    return flat.data_ptr() % 16 == 0 and addr % 16 == 0 and all(e % _ALIGN_ELEMS == 0 for e in extents)


def _launches(
    flat: torch.Tensor, segments: list[Segment], row_stride: int, num_rows: int
) -> list[tuple[torch.Tensor, int, int, int, bool]]:
    """(table, LOG_SEGS, NUM_STARTS, num_tiles, aligned) per launch: one for the segments whose
    alignment hints hold, one for the rest (usually only one of them is non-empty).

    The table holds each segment's first tile (padded to a power of two with int64 max for the
    binary search), then NUM_FIELDS values per segment; one small host-to-device copy, on the
    current stream like the launch that reads it."""
    launches = []
    for aligned in (True, False):
        part = [seg for seg in segments if _is_aligned(seg, flat, row_stride) == aligned]
        if not part:
            continue
        starts: list[int] = []
        fields: list[int] = []
        num_tiles = 0
        for addr, col_off, cols, valid in part:
            tiles_per_row = -(-cols // BLOCK)
            starts.append(num_tiles)
            fields += [addr, col_off, cols, valid, tiles_per_row]
            num_tiles += num_rows * tiles_per_row
        log_segs = (len(starts) - 1).bit_length()
        num_starts = 1 << log_segs
        starts += [torch.iinfo(torch.int64).max] * (num_starts - len(starts))
        table = torch.tensor(starts + fields, dtype=torch.int64).to(flat.device)
        launches.append((table, log_segs, num_starts, num_tiles, aligned))
    return launches


def _check(flat: torch.Tensor, tensors: Sequence[torch.Tensor | None], sizes: Sequence[int], num_rows: int) -> None:
    if triton is None:
        raise RuntimeError("overlap.kernels.triton_copy: triton is not installed")
    if not flat.is_contiguous():
        raise ValueError("overlap triton copy: flat must be contiguous")
    if flat.dtype not in _TL_DTYPES:
        raise TypeError(f"overlap triton copy: dtype {flat.dtype} is not fp32/bf16/fp16")
    if len(tensors) != len(sizes) or flat.numel() != sum(sizes) or any(s % num_rows for s in sizes):
        raise ValueError("overlap triton copy: sizes do not tile flat into num_rows rows")
    for t in tensors:
        if t is None:
            continue
        if not t.is_contiguous() or t.device != flat.device or t.dtype not in _TL_DTYPES:
            raise ValueError("overlap triton copy: tensors must be contiguous fp32/bf16/fp16 on flat's device")


def _column_offsets(sizes: Sequence[int], num_rows: int) -> list[int]:
    offsets, off = [], 0
    for size in sizes:
        offsets.append(off)
        off += size // num_rows
    return offsets


def copy_out(flat: torch.Tensor, outs: Sequence[torch.Tensor], sizes: Sequence[int], num_rows: int) -> None:
    """Split `flat` into `outs` ([Note: fused copy layout]); one launch per distinct out dtype."""
    _check(flat, outs, sizes, num_rows)
    row_stride = flat.numel() // num_rows if flat.numel() else 0
    offsets = _column_offsets(sizes, num_rows)
    for dtype in dict.fromkeys(o.dtype for o in outs):
        segments = [
            (out.data_ptr(), off, size // num_rows, out.numel())
            for out, off, size in zip(outs, offsets, sizes)
            if out.dtype == dtype and out.numel()
        ]
        for table, log_segs, num_starts, num_tiles, aligned in _launches(flat, segments, row_stride, num_rows):
            _copy_out_kernel[(num_tiles,)](
                flat, table, row_stride,
                OUT_DTYPE=_TL_DTYPES[dtype], LOG_SEGS=log_segs, NUM_STARTS=num_starts, BLOCK=BLOCK,
                ALIGNED=aligned,
            )  # fmt: skip


def copy_in(
    srcs: Sequence[torch.Tensor | None], flat: torch.Tensor, sizes: Sequence[int], num_rows: int
) -> torch.Tensor:
    """Pack `srcs` into `flat` with zero padding ([Note: fused copy layout]); one launch per
    distinct source dtype (zero-only segments ride with the first)."""
    _check(flat, srcs, sizes, num_rows)
    row_stride = flat.numel() // num_rows if flat.numel() else 0
    offsets = _column_offsets(sizes, num_rows)
    dtypes = list(dict.fromkeys(s.dtype for s in srcs if s is not None and s.numel())) or [flat.dtype]
    for k, dtype in enumerate(dtypes):
        segments: list[Segment] = []
        for src, off, size in zip(srcs, offsets, sizes):
            if size == 0:
                continue
            if src is not None and src.numel() and src.dtype == dtype:
                segments.append((src.data_ptr(), off, size // num_rows, src.numel()))
            elif k == 0 and (src is None or src.numel() == 0):
                segments.append((flat.data_ptr(), off, size // num_rows, 0))  # zeros: never read
        for table, log_segs, num_starts, num_tiles, aligned in _launches(flat, segments, row_stride, num_rows):
            _copy_in_kernel[(num_tiles,)](
                flat, table, row_stride,
                SRC_DTYPE=_TL_DTYPES[dtype], LOG_SEGS=log_segs, NUM_STARTS=num_starts, BLOCK=BLOCK,
                ALIGNED=aligned,
            )  # fmt: skip
    return flat
