"""Triton kernels for the fused copy-out / copy-in with cast ([Note: fused copy layout], copy.py).

One launch moves every tensor of one dtype. The many tensors are reached from one of them, the
launch's *base* tensor (the lowest address), passed as a pointer argument: a small int64 table
on the device gives each segment its element offset from the base and its geometry. The job is
cut into tiles of BLOCK columns of one row of one segment; a program finds its segment by
binary search over the segments' first tiles (a short table, no per-tile metadata).

[Note: copy tables]
The table depends only on the layout and on the tensors' offsets from their base, not on
where the buffers are: the runtime's unsharded parameters are views of one buffer at fixed
offsets (its storage is freed and reallocated every step), so a unit's copy-out finds its table
in the cache every step and launches with no host-to-device traffic at all. Copy-in sources are
fresh gradients, whose relative offsets usually repeat (the caching allocator hands out the same
blocks) but need not: a table that is not cached is built on the host once and uploaded from
pinned memory with `non_blocking=True`, on the launch's stream. That never blocks the host: the
caching host allocator records an event on the copy and does not reuse the pinned block before
it has completed (ATen's own `split_with_sizes_copy` / `_chunk_cat` send their metadata the same
way). Tables are cached per (device, stream): a table is written and read on one stream, so
evicting one (LRU, `TABLE_CACHE_SIZE` entries of a few hundred bytes) frees it in stream order.
tests/triton_interpreter_check.py checks that a repeated layout builds and uploads nothing.

[Note: copy alignment]
Segments whose offsets and extents (the flat buffer's row stride and the segment's first
column, the tensor's offset from the base, its data columns and elements) are all multiples of
16 elements, with 16-byte aligned buffers, go to a variant compiled with `tl.multiple_of`
hints, so that the compiler emits 16-byte vector loads and stores; the others go to a second
launch of the same kernel without hints. The variant is a constexpr, not a run-time branch:
`tl.multiple_of` annotates the op that defined its argument, so a hint inside a run-time branch
would leak to the other branch. Results are identical either way. The runtime's layout pads
every chunk to 16 elements ([Note: flat layout] in overlap/engine/units.py), so one odd-sized
parameter only sends its own segment to the scalar variant.

Casts to bf16 round on the bits (round half to even, NaN kept NaN): the GPU's cast does the
same, but the interpreter truncates, and one definition keeps both testable against torch.
Tested on CPU under TRITON_INTERPRET=1 (tests/triton_interpreter_check.py) and compiled for
sm_90 and sm_80 (tests/test_triton_compile.py).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

import torch

from overlap.kernels.triton_launch import LAUNCH_OPTIONS, available, on_device

try:
    import triton  # type: ignore[import-not-found, import-untyped, unused-ignore]
    import triton.language as tl  # type: ignore[import-not-found, import-untyped, unused-ignore]
except ImportError:  # the package works without triton: dispatch falls back
    triton = None
    tl = None

__all__ = ["available", "copy_in", "copy_out"]

BLOCK = 1024  # columns per tile: 4 warps x 32 lanes x 8 elements
NUM_FIELDS = 6  # per segment: offset from the base, first column, columns, data columns, elements, tiles per row
TABLE_CACHE_SIZE = 1024
_ALIGN_ELEMS = 16  # multiples of 16 elements: 16-byte vectors for every supported dtype
_INT64_MAX = torch.iinfo(torch.int64).max


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
        """This program's segment (largest i with first_tile[i] <= pid): its offset from the
        base, first column, columns, data columns, elements, and the tile's row and first column."""
        pid = tl.program_id(0).to(tl.int64)
        seg = pid * 0
        for s in tl.static_range(LOG_SEGS):  # binary lifting; padding entries are int64 max
            cand = seg + (1 << (LOG_SEGS - 1 - s))
            seg = tl.where(tl.load(table_ptr + cand) <= pid, cand, seg)
        local = pid - tl.load(table_ptr + seg)
        fields = table_ptr + NUM_STARTS + seg * 6  # NUM_FIELDS
        offset = tl.load(fields)
        col_off = tl.load(fields + 1)
        cols = tl.load(fields + 2)
        data_cols = tl.load(fields + 3)
        valid = tl.load(fields + 4)
        tiles_per_row = tl.load(fields + 5)
        row = local // tiles_per_row
        col0 = (local - row * tiles_per_row) * BLOCK
        return offset, col_off, cols, data_cols, valid, row, col0

    @triton.jit
    def _copy_out_kernel(
        flat_ptr, base_ptr, table_ptr, row_stride,
        LOG_SEGS: tl.constexpr, NUM_STARTS: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr,
    ):  # fmt: skip
        offset, col_off, cols, data_cols, valid, row, col0 = _locate(table_ptr, LOG_SEGS, NUM_STARTS, BLOCK)
        src_base = row * row_stride + col_off + col0
        dst_base = row * data_cols + col0
        # The hints stay inline in both kernels: returned from a helper @triton.jit function
        # they are lost (tests/test_triton_compile.py then finds scalar loads).
        if ALIGNED:  # the host checked every segment of this launch ([Note: copy alignment])
            offset = tl.multiple_of(offset, 16)
            src_base = tl.multiple_of(src_base, 16)
            dst_base = tl.multiple_of(dst_base, 16)
            data_cols = tl.multiple_of(data_cols, 16)
            valid = tl.multiple_of(valid, 16)
        out_ptr = base_ptr + offset
        j = tl.arange(0, BLOCK)
        mask = (col0 + j < data_cols) & (dst_base + j < valid)
        v = tl.load(flat_ptr + src_base + j, mask=mask)
        tl.store(out_ptr + dst_base + j, _cast(v, base_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _copy_in_kernel(
        flat_ptr, base_ptr, table_ptr, row_stride,
        LOG_SEGS: tl.constexpr, NUM_STARTS: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr,
    ):  # fmt: skip
        offset, col_off, cols, data_cols, valid, row, col0 = _locate(table_ptr, LOG_SEGS, NUM_STARTS, BLOCK)
        dst_base = row * row_stride + col_off + col0
        src_base = row * data_cols + col0
        if ALIGNED:  # the host checked every segment of this launch ([Note: copy alignment])
            offset = tl.multiple_of(offset, 16)
            src_base = tl.multiple_of(src_base, 16)
            dst_base = tl.multiple_of(dst_base, 16)
            cols = tl.multiple_of(cols, 16)
            data_cols = tl.multiple_of(data_cols, 16)
            valid = tl.multiple_of(valid, 16)
        src_ptr = base_ptr + offset
        j = tl.arange(0, BLOCK)
        in_segment = col0 + j < cols
        is_data = (col0 + j < data_cols) & (src_base + j < valid)
        v = tl.load(src_ptr + src_base + j, mask=is_data, other=0.0)
        tl.store(flat_ptr + dst_base + j, _cast(v, flat_ptr.dtype.element_ty), mask=in_segment)


class _Segment(NamedTuple):
    """One tensor's column block, as the host sees it for one call."""

    tensor: int  # index into the call's tensors; -1 for zeros (a None or empty copy-in source)
    col_off: int
    cols: int
    data_cols: int
    valid: int  # tensor elements


class _Launch(NamedTuple):
    """One cached kernel launch: the table on the device and its compile-time shape."""

    table: torch.Tensor  # int64: first tile per segment (padded to NUM_STARTS), then NUM_FIELDS each
    base: int  # index of the base tensor in the call's tensors; -1: the flat buffer
    log_segs: int
    num_starts: int
    num_tiles: int
    aligned: bool


_cache: OrderedDict[tuple[object, ...], list[_Launch]] = OrderedDict()
_cache_lock = threading.Lock()


def _stream_key(device: torch.device) -> tuple[object, ...]:
    if device.type == "cuda":
        return (device, torch.cuda.current_stream(device).cuda_stream)
    return (device,)


def _upload(values: list[int], device: torch.device) -> torch.Tensor:
    """A table on `device`, sent without blocking the host ([Note: copy tables])."""
    host = torch.tensor(values, dtype=torch.int64, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def _plan(
    kind: str,
    flat: torch.Tensor,
    tensors: Sequence[torch.Tensor | None],
    segments: list[_Segment],
    row_stride: int,
    num_rows: int,
) -> list[_Launch]:
    """The launches for this call: cached per layout and relative offsets ([Note: copy tables]).

    One launch per distinct tensor dtype and alignment class; zero segments (copy-in only) ride
    with the first dtype. Builds and uploads tables only on a cache miss."""
    by_dtype: dict[torch.dtype, list[_Segment]] = {}
    zeros = []
    for seg in segments:
        if seg.tensor < 0:
            zeros.append(seg)
        else:
            by_dtype.setdefault(tensors[seg.tensor].dtype, []).append(seg)  # type: ignore[union-attr]
    if zeros:
        first = next(iter(by_dtype), flat.dtype)
        by_dtype[first] = by_dtype.get(first, []) + zeros
    flat_aligned = flat.data_ptr() % 16 == 0 and row_stride % _ALIGN_ELEMS == 0
    key: list[object] = [kind, *_stream_key(flat.device), flat.dtype, num_rows, row_stride, flat_aligned]
    groups = []
    for dtype, segs in by_dtype.items():
        present = [s.tensor for s in segs if s.tensor >= 0]
        base = min(present, key=lambda i: tensors[i].data_ptr()) if present else -1  # type: ignore[union-attr]
        base_tensor = flat if base < 0 else tensors[base]
        assert base_tensor is not None
        base_ptr, itemsize = base_tensor.data_ptr(), base_tensor.element_size()
        offsets = []
        for s in segs:
            delta = 0 if s.tensor < 0 else tensors[s.tensor].data_ptr() - base_ptr  # type: ignore[union-attr]
            assert delta % itemsize == 0, "tensors of one dtype lie at multiples of its size"
            offsets.append(delta // itemsize)
        key += [dtype, base_ptr % 16 == 0, len(segs)]
        for s, off in zip(segs, offsets):
            key += [off, *s]
        groups.append((base, base_ptr % 16 == 0, segs, offsets))
    key_t = tuple(key)
    with _cache_lock:
        launches = _cache.get(key_t)
        if launches is not None:
            _cache.move_to_end(key_t)
            return launches
    launches = []
    for base, base_aligned, segs, offsets in groups:
        for aligned in (True, False):
            part = [
                (s, off)
                for s, off in zip(segs, offsets)
                if (flat_aligned and base_aligned and _extents_aligned(s, off)) == aligned
            ]
            if part:
                launches.append(_build_launch(kind, part, base, aligned, num_rows, flat.device))
    with _cache_lock:
        _cache[key_t] = launches
        while len(_cache) > TABLE_CACHE_SIZE:
            _cache.popitem(last=False)
    return launches


def _extents_aligned(seg: _Segment, offset: int) -> bool:
    return all(e % _ALIGN_ELEMS == 0 for e in (offset, seg.col_off, seg.cols, seg.data_cols, seg.valid))


def _build_launch(
    kind: str, part: list[tuple[_Segment, int]], base: int, aligned: bool, num_rows: int, device: torch.device
) -> _Launch:
    """The table of one launch: each segment's first tile (padded to a power of two with int64
    max for the binary search), then NUM_FIELDS values per segment."""
    starts: list[int] = []
    fields: list[int] = []
    num_tiles = 0
    for seg, offset in part:
        # copy-in writes every column (zeros in the padding); copy-out only reads the data
        width = seg.cols if kind == "in" else seg.data_cols
        tiles_per_row = -(-width // BLOCK)
        starts.append(num_tiles)
        fields += [offset, seg.col_off, seg.cols, seg.data_cols, seg.valid, tiles_per_row]
        num_tiles += num_rows * tiles_per_row
    log_segs = (len(starts) - 1).bit_length()
    num_starts = 1 << log_segs
    starts += [_INT64_MAX] * (num_starts - len(starts))
    return _Launch(_upload(starts + fields, device), base, log_segs, num_starts, num_tiles, aligned)


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


def _segments(
    kind: str, tensors: Sequence[torch.Tensor | None], sizes: Sequence[int], data_cols: Sequence[int], num_rows: int
) -> list[_Segment]:
    """The segments with work: copy-out skips empty outs, copy-in writes zeros for None sources."""
    segments, col_off = [], 0
    for i, (t, size, data) in enumerate(zip(tensors, sizes, data_cols)):
        cols = size // num_rows
        has_data = t is not None and t.numel() > 0
        if cols and (has_data or kind == "in"):
            segments.append(_Segment(i if has_data else -1, col_off, cols, data, t.numel() if has_data else 0))  # type: ignore[union-attr]
        col_off += cols
    return segments


def _run(
    kind: str,
    flat: torch.Tensor,
    tensors: Sequence[torch.Tensor | None],
    sizes: Sequence[int],
    data_cols: Sequence[int],
    num_rows: int,
) -> None:
    _check(flat, tensors, sizes, num_rows)
    row_stride = flat.numel() // num_rows if flat.numel() else 0
    kernel = _copy_out_kernel if kind == "out" else _copy_in_kernel
    with on_device(flat):
        segments = _segments(kind, tensors, sizes, data_cols, num_rows)
        if not segments:
            return
        for launch in _plan(kind, flat, tensors, segments, row_stride, num_rows):
            base = flat if launch.base < 0 else tensors[launch.base]
            kernel[(launch.num_tiles,)](
                flat, base, launch.table, row_stride,
                LOG_SEGS=launch.log_segs, NUM_STARTS=launch.num_starts, BLOCK=BLOCK, ALIGNED=launch.aligned,
                **LAUNCH_OPTIONS,
            )  # fmt: skip


def copy_out(
    flat: torch.Tensor, outs: Sequence[torch.Tensor], sizes: Sequence[int], data_cols: Sequence[int], num_rows: int
) -> None:
    """Split `flat` into `outs` ([Note: fused copy layout]); one launch per distinct out dtype
    (and alignment class)."""
    _run("out", flat, outs, sizes, data_cols, num_rows)


def copy_in(
    srcs: Sequence[torch.Tensor | None],
    flat: torch.Tensor,
    sizes: Sequence[int],
    data_cols: Sequence[int],
    num_rows: int,
) -> torch.Tensor:
    """Pack `srcs` into `flat` with zero padding ([Note: fused copy layout]); one launch per
    distinct source dtype and alignment class (zero-only segments ride with the first)."""
    _run("in", flat, srcs, sizes, data_cols, num_rows)
    return flat
