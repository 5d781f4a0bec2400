"""The Triton kernels of the fused copy-out / copy-in with cast: a program finds its segment in
the launch's table and moves one tile of one row ([Note: copy tables], [Note: copy alignment],
[Note: second base] in triton_copy.py, which builds the tables and launches these).
"""

from __future__ import annotations

from typing import Any

import torch

try:
    import triton  # type: ignore[import-not-found, import-untyped, unused-ignore]
    import triton.language as tl  # type: ignore[import-not-found, import-untyped, unused-ignore]
except ImportError:  # the package works without triton: dispatch falls back
    triton = None
    tl = None

_TL_DTYPES: dict[torch.dtype, Any] = {}
_copy_out_kernel: Any = None
_copy_in_kernel: Any = None

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
            if tl.bfloat16 == DST:
                b = f.to(tl.uint32, bitcast=True)
                r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
                r = tl.where(f != f, 0x7FC0, r)
                out = r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
            else:
                out = f.to(DST)
        return out

    @triton.jit
    def _locate(table_ptr, base_ptr, aux_ptr, BLOCK: tl.constexpr):
        """This program's segment (largest i with first_tile[i] <= pid, [Note: copy tables]): its
        tensor's base pointer ([Note: second base]), its fields, and the tile's row and first column."""
        pid = tl.program_id(0).to(tl.int64)
        num_slots = tl.load(table_ptr)
        depth = tl.load(table_ptr + 1)
        starts = table_ptr + 2  # HEADER
        seg = pid * 0
        half = num_slots // 2
        for _ in range(depth):  # binary lifting; unused slots are int64 max
            cand = seg + half
            seg = tl.where(tl.load(starts + cand) <= pid, cand, seg)
            half = half // 2
        local = pid - tl.load(starts + seg)
        fields = starts + num_slots + seg * 8  # NUM_FIELDS
        tiles_per_row = tl.load(fields + 5)
        row = local // tiles_per_row
        col0 = (local - row * tiles_per_row) * BLOCK
        ptr = tl.where(tl.load(fields + 7) == 0, base_ptr, aux_ptr)
        offset, col_off, cols = tl.load(fields), tl.load(fields + 1), tl.load(fields + 2)
        data_cols, valid, unit = tl.load(fields + 3), tl.load(fields + 4), tl.load(fields + 6)
        return ptr, offset, col_off, cols, data_cols, valid, unit, row, col0

    @triton.jit
    def _out_tile(flat_ptr, out_ptr, src_base, dst_base, col0, data_cols, valid, BLOCK: tl.constexpr):
        j = tl.arange(0, BLOCK)
        mask = (col0 + j < data_cols) & (dst_base + j < valid)
        v = tl.load(flat_ptr + src_base + j, mask=mask)
        tl.store(out_ptr + dst_base + j, _cast(v, out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _in_tile(src_ptr, flat_ptr, src_base, dst_base, col0, cols, data_cols, valid, BLOCK: tl.constexpr):
        j = tl.arange(0, BLOCK)
        in_segment = col0 + j < cols
        is_data = (col0 + j < data_cols) & (src_base + j < valid)
        v = tl.load(src_ptr + src_base + j, mask=is_data, other=0.0)
        tl.store(flat_ptr + dst_base + j, _cast(v, flat_ptr.dtype.element_ty), mask=in_segment)

    @triton.jit
    def _copy_out_kernel(flat_ptr, base_ptr, aux_ptr, table_ptr, row_stride, BLOCK: tl.constexpr):
        out_ptr, offset, col_off, _, data_cols, valid, unit, row, col0 = _locate(table_ptr, base_ptr, aux_ptr, BLOCK)
        if unit == 16:  # aligned: the values count 16 elements ([Note: copy alignment])
            _out_tile(flat_ptr, out_ptr + offset * 16, row * row_stride + col_off * 16 + col0,
                      row * (data_cols * 16) + col0, col0, data_cols * 16, valid * 16, BLOCK)  # fmt: skip
        else:
            _out_tile(flat_ptr, out_ptr + offset, row * row_stride + col_off + col0, row * data_cols + col0,
                      col0, data_cols, valid, BLOCK)  # fmt: skip

    @triton.jit
    def _copy_in_kernel(flat_ptr, base_ptr, aux_ptr, table_ptr, row_stride, BLOCK: tl.constexpr):
        src_ptr, offset, col_off, cols, data_cols, valid, unit, row, col0 = _locate(table_ptr, base_ptr, aux_ptr, BLOCK)
        if unit == 16:  # aligned: the values count 16 elements ([Note: copy alignment])
            _in_tile(src_ptr + offset * 16, flat_ptr, row * (data_cols * 16) + col0,
                     row * row_stride + col_off * 16 + col0, col0, cols * 16, data_cols * 16, valid * 16, BLOCK)  # fmt: skip
        else:
            _in_tile(src_ptr + offset, flat_ptr, row * data_cols + col0, row * row_stride + col_off + col0, col0,
                     cols, data_cols, valid, BLOCK)  # fmt: skip
