"""Triton kernels for the fused copy-out / copy-in with cast ([Note: fused copy layout], copy.py).

One launch moves every tensor of one dtype. The many tensors are reached from one of them, the
launch's *base* tensor (the lowest address), passed as a pointer argument: a small int64 table
on the device gives each segment its element offset from the base and its geometry. The job is
cut into tiles of BLOCK columns of one row of one segment; a program finds its segment by
binary search over the segments' first tiles (a short table, no per-tile metadata).

[Note: copy tables]
A table is: the number of search slots (the segment count rounded up to a power of two) and
the search depth, each segment's first tile (the unused slots int64 max), then `NUM_FIELDS`
values per segment. Everything that depends on the segment count is in the table, read at run
time: one compiled kernel per dtype pair serves every layout, and a new bucket layout (wrap, or
autotune moving a bucket) compiles nothing. Triton specializes only the pointers' and the row
stride's divisibility by 16, a handful of variants whatever the layouts.
The table depends only on the layout and on the tensors' offsets from their base, not on where
the buffers are. The runtime's copy-out destinations are views of one buffer at fixed offsets
(its storage is freed and reallocated every step) and the tag slot, reached from a second base
([Note: second base]), so a unit's copy-out finds its table every step and launches with no
host-to-device traffic at all; bound to the runtime's views (`bind_copy_out`), it does not even
read their addresses. Copy-in sources are fresh gradients, whose relative offsets usually
repeat (the caching allocator hands out the same blocks) but need not: a table that is not cached
is built on the host once and uploaded from pinned memory with `non_blocking=True`, on the
launch's stream. That never blocks the host: the caching host allocator records an event on the
copy and does not reuse the pinned block before it has completed (ATen's own
`split_with_sizes_copy` / `_chunk_cat` send their metadata the same way). Tables are cached per
(device, stream): a table is written and read on one stream, so evicting one (LRU,
`TABLE_CACHE_SIZE` entries of a few hundred bytes) frees it in stream order.
tests/unit/triton_interpreter_check.py checks that a repeated layout builds and uploads nothing.

[Note: copy alignment]
A segment whose offset from the base, first column, columns, data columns and elements are all
multiples of 16 elements is *aligned*: the table holds those five values divided by 16, and the
kernel multiplies them back by the constant 16 in a branch of its own, so that the compiler
knows them to be multiples of 16 and, with 16-byte aligned buffers and a row stride that is a
multiple of 16 (both specialized by Triton's launcher), emits 16-byte vector loads and stores.
The other segments take the scalar branch of the same launch: one launch whatever the mix. The
branch is uniform per program (a tile lies in one segment). A `tl.multiple_of` hint would not
do: it annotates the op that defined its argument, so inside a run-time branch it would leak to
the other branch. Results are identical either way. The runtime's layout pads every chunk to 16
elements ([Note: flat layout] in overlap/engine/units.py), so one odd-sized parameter (or the
used flags of a reduction) only sends its own segment to the scalar branch.

Casts to bf16 round on the bits (round half to even, NaN kept NaN): the GPU's cast does the
same, but the interpreter truncates, and one definition keeps both testable against torch.
Tested on CPU under TRITON_INTERPRET=1 (tests/unit/triton_interpreter_check.py) and compiled for
sm_90 and sm_80 (tests/unit/test_triton_compile.py).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from overlap.kernels.triton_copy_jit import _TL_DTYPES, _copy_in_kernel, _copy_out_kernel, triton
from overlap.kernels.triton_launch import LAUNCH_OPTIONS, available, on_device

__all__ = ["available", "bind_copy_in", "bind_copy_out", "copy_in", "copy_out"]

BLOCK = 1024  # columns per tile: 4 warps x 32 lanes x 8 elements
HEADER = 2  # per table: search slots, search depth
NUM_FIELDS = 8  # per segment: offset from its base, first column, columns, data columns, elements, tiles per row,
# unit (16: the first five count 16 elements, [Note: copy alignment]), which base (0: base, 1: aux, [Note: second base])
TABLE_CACHE_SIZE = 1024
_ALIGN_ELEMS = 16  # multiples of 16 elements: 16-byte vectors for every supported dtype
_INT64_MAX = torch.iinfo(torch.int64).max


class _Segment(NamedTuple):
    """One tensor's column block, as the host sees it for one call."""

    tensor: int  # index into the call's tensors; -1 for zeros (a None or empty copy-in source)
    col_off: int
    cols: int
    data_cols: int
    valid: int  # tensor elements


class _Launch(NamedTuple):
    """One cached kernel launch: the table on the device and what it covers."""

    table: torch.Tensor  # int64: HEADER, first tile per search slot, then NUM_FIELDS per segment
    base: int  # index of the base tensor in the call's tensors; -1: the flat buffer
    aux: int  # index of the second base ([Note: second base]); the base itself when there is none
    num_tiles: int
    num_segments: int
    num_aligned: int  # segments on the vector branch ([Note: copy alignment])

    @property
    def aligned(self) -> bool:
        """The launch runs the vector branch (for `num_aligned` of its segments)."""
        return self.num_aligned > 0


class _Shape(NamedTuple):
    """A call's segments grouped into launches: per launch its segments and the indices of the
    tensors they copy (in segment order; zero segments have none)."""

    groups: list[tuple[list[_Segment], list[int]]]


class _Placement(NamedTuple):
    """Where each launch's tensors lie: per launch its base and second base, and per tensor (all
    launches in turn) its offset in bytes from its base and which base that is (0: base, 1: aux)."""

    bases: list[int]
    auxes: list[int]
    offsets: list[int]
    which: list[int]


_cache: OrderedDict[tuple[object, ...], list[_Launch]] = OrderedDict()
_cache_lock = threading.Lock()
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what Triton's launcher reads


def _stream_key(device: torch.device) -> object:
    if device.type != "cuda":
        return device
    if _raw_stream is not None:
        return (device, _raw_stream(device.index))
    return (device, torch.cuda.current_stream(device).cuda_stream)


def _upload(values: list[int], device: torch.device) -> torch.Tensor:
    """A table on `device`, sent without blocking the host ([Note: copy tables])."""
    host = torch.tensor(values, dtype=torch.int64, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def _shape(segments: list[_Segment], tensors: Sequence[torch.Tensor | None], flat_dtype: torch.dtype) -> _Shape:
    """One launch per distinct tensor dtype; zero segments (copy-in only) ride with the first."""
    by_dtype: dict[torch.dtype, list[_Segment]] = {}
    zeros = []
    for seg in segments:
        if seg.tensor < 0:
            zeros.append(seg)
        else:
            by_dtype.setdefault(tensors[seg.tensor].dtype, []).append(seg)  # type: ignore[union-attr]
    if zeros:
        first = next(iter(by_dtype), flat_dtype)
        by_dtype[first] = by_dtype.get(first, []) + zeros
    return _Shape([(segs, [s.tensor for s in segs if s.tensor >= 0]) for segs in by_dtype.values()])


def _place(shape: _Shape, ptrs: Sequence[int]) -> _Placement:
    """Each launch's tensors from its lowest address (`ptrs`, one per tensor; no second base)."""
    placed = _Placement([], [], [], [])
    for _, present in shape.groups:
        base = min(present, key=ptrs.__getitem__) if present else -1
        placed.bases.append(base)
        placed.auxes.append(base)
        placed.offsets.extend(ptrs[i] - ptrs[base] for i in present)
    placed.which.extend([0] * len(placed.offsets))
    return placed


def _place_views(shape: _Shape, tensors: Sequence[torch.Tensor]) -> _Placement | None:
    """[Note: second base]
    Offsets that never change, for tensors that are views of at most two storages per launch:
    each launch reaches the views of one storage from its lowest view (`base`), those of the
    other from its lowest view (`aux`). The runtime's copy-out destinations are its parameters'
    views of the unit's unsharded buffer, whose storage is freed and reallocated every step,
    and the tag slot (`unit.tag_out`, allocated once, [Note: collective fingerprints] in
    transport/fingerprint.py): reached from one base, their distance would change with every
    allocation (a table rebuilt and uploaded per gather); from two, every offset is a difference
    of storage offsets, fixed for good. The tag slot stays a buffer of its own, not slack in
    the unsharded storage, because the tags' copy to the host reads it on the gather stream
    after the compute stream may have freed that storage ([Note: gather event] in
    transport/streams.py). None when some launch spans more than two storages."""
    placed = _Placement([], [], [], [])
    for _, present in shape.groups:
        storages: dict[int, list[int]] = {}
        for i in present:
            storages.setdefault(tensors[i].untyped_storage()._cdata, []).append(i)
        if len(storages) > 2:
            return None
        firsts = [min(views, key=lambda i: tensors[i].storage_offset()) for views in storages.values()]
        placed.bases.append(firsts[0] if firsts else -1)
        placed.auxes.append(firsts[-1] if firsts else -1)
        for i in present:
            which = int(tensors[i].untyped_storage()._cdata != tensors[firsts[0]].untyped_storage()._cdata)
            delta = tensors[i].storage_offset() - tensors[firsts[which]].storage_offset()
            placed.offsets.append(delta * tensors[i].element_size())
            placed.which.append(which)
    return placed


def _build(
    kind: str, shape: _Shape, placed: _Placement, itemsizes: list[int], num_rows: int, device: torch.device
) -> list[_Launch]:
    """The launches of a call whose tables are not cached: built on the host, uploaded."""
    launches, k = [], 0
    for (segs, _), base, aux, itemsize in zip(shape.groups, placed.bases, placed.auxes, itemsizes):
        where = []
        for seg in segs:
            if seg.tensor < 0:
                where.append((0, 0))
                continue
            delta = placed.offsets[k]
            assert delta % itemsize == 0, "tensors of one dtype lie at multiples of its size"
            where.append((delta // itemsize, placed.which[k]))
            k += 1
        launches.append(_build_launch(kind, segs, where, base, aux, num_rows, device))
    return launches


def _build_launch(
    kind: str,
    segs: list[_Segment],
    where: list[tuple[int, int]],
    base: int,
    aux: int,
    num_rows: int,
    device: torch.device,
) -> _Launch:
    """The table of one launch ([Note: copy tables]): aligned segments' extents in units of 16
    elements ([Note: copy alignment])."""
    starts: list[int] = []
    fields: list[int] = []
    num_tiles = num_aligned = 0
    for seg, (offset, which) in zip(segs, where):
        # copy-in writes every column (zeros in the padding); copy-out only reads the data
        width = seg.cols if kind == "in" else seg.data_cols
        tiles_per_row = -(-width // BLOCK)
        starts.append(num_tiles)
        extents = [offset, seg.col_off, seg.cols, seg.data_cols, seg.valid]
        # copy-out never reads `cols`: it does not decide its alignment
        checked = extents if kind == "in" else extents[:2] + extents[3:]
        unit = _ALIGN_ELEMS if all(e % _ALIGN_ELEMS == 0 for e in checked) else 1
        num_aligned += unit > 1
        fields += [e // unit for e in extents] + [tiles_per_row, unit, which]
        num_tiles += num_rows * tiles_per_row
    depth = (len(starts) - 1).bit_length()
    num_slots = 1 << depth
    starts += [_INT64_MAX] * (num_slots - len(starts))
    table = _upload([num_slots, depth, *starts, *fields], device)
    return _Launch(table, base, aux, num_tiles, len(segs), num_aligned)


def _cached(key: tuple[object, ...], make: Callable[[], list[_Launch]]) -> list[_Launch]:
    with _cache_lock:
        launches = _cache.get(key)
        if launches is not None:
            _cache.move_to_end(key)
            return launches
    launches = make()
    with _cache_lock:
        _cache[key] = launches
        while len(_cache) > TABLE_CACHE_SIZE:
            _cache.popitem(last=False)
    return launches


def _itemsizes(shape: _Shape, tensors: Sequence[torch.Tensor | None], flat: torch.Tensor) -> list[int]:
    return [flat.element_size() if not present else tensors[present[0]].element_size()  # type: ignore[union-attr]
            for _, present in shape.groups]  # fmt: skip


def _plan(
    kind: str,
    flat: torch.Tensor,
    tensors: Sequence[torch.Tensor | None],
    segments: list[_Segment],
    row_stride: int,
    num_rows: int,
) -> list[_Launch]:
    """The launches for this call: cached per layout and relative offsets ([Note: copy tables]).
    One launch per distinct tensor dtype, aligned and unaligned segments together ([Note: copy
    alignment]). Builds and uploads tables only on a cache miss. (`row_stride` is a launch
    argument, not part of the table.)"""
    shape = _shape(segments, tensors, flat.dtype)
    placed = _place(shape, [0 if t is None else t.data_ptr() for t in tensors])
    groups = tuple((None, ()) if not p else (tensors[p[0]].dtype, tuple(p)) for _, p in shape.groups)  # type: ignore[union-attr]
    key = (kind, _stream_key(flat.device), flat.dtype, num_rows, groups, *segments, *placed.bases, *placed.offsets)
    return _cached(key, lambda: _build(kind, shape, placed, _itemsizes(shape, tensors, flat), num_rows, flat.device))


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


def _launch(
    kind: str, flat: torch.Tensor, tensors: Sequence[torch.Tensor | None], launches: list[_Launch], row_stride: int
) -> None:
    kernel = _copy_out_kernel if kind == "out" else _copy_in_kernel
    with on_device(flat):
        for launch in launches:
            base = flat if launch.base < 0 else tensors[launch.base]
            aux = base if launch.aux == launch.base else tensors[launch.aux]
            kernel[(launch.num_tiles,)](flat, base, aux, launch.table, row_stride, BLOCK=BLOCK, **LAUNCH_OPTIONS)


def _run(
    kind: str,
    flat: torch.Tensor,
    tensors: Sequence[torch.Tensor | None],
    sizes: Sequence[int],
    data_cols: Sequence[int],
    num_rows: int,
) -> None:
    _check(flat, tensors, sizes, num_rows)
    segments = _segments(kind, tensors, sizes, data_cols, num_rows)
    if not segments:
        return
    row_stride = flat.numel() // num_rows
    _launch(kind, flat, tensors, _plan(kind, flat, tensors, segments, row_stride, num_rows), row_stride)


def copy_out(
    flat: torch.Tensor, outs: Sequence[torch.Tensor], sizes: Sequence[int], data_cols: Sequence[int], num_rows: int
) -> None:
    """Split `flat` into `outs` ([Note: fused copy layout]); one launch per distinct out dtype."""
    _run("out", flat, outs, sizes, data_cols, num_rows)


def copy_in(
    srcs: Sequence[torch.Tensor | None],
    flat: torch.Tensor,
    sizes: Sequence[int],
    data_cols: Sequence[int],
    num_rows: int,
) -> torch.Tensor:
    """Pack `srcs` into `flat` with zero padding ([Note: fused copy layout]); one launch per
    distinct source dtype (zero-only segments ride with the first)."""
    _run("in", flat, srcs, sizes, data_cols, num_rows)
    return flat


# ---------------------------------------------------------------------------------- bound
# The runtime repeats each layout every step ([Note: bound copies] in copy.py). Bound, the checks
# and the segment plan are done once, and a call costs the table lookup and the launch.


def bind_copy_out(
    outs: Sequence[torch.Tensor], sizes: Sequence[int], data_cols: Sequence[int], num_rows: int
) -> Callable[[torch.Tensor], None]:
    """`flat -> copy_out(flat, outs, ...)` for a checked layout and these very `outs`. When they
    are views of at most two storages per dtype ([Note: second base]: the runtime's unsharded
    buffer and its tag slot), their offsets are read once, here, and a call only looks its
    tables up by stream; otherwise per call by their addresses."""
    outs = list(outs)
    segments = _segments("out", outs, sizes, data_cols, num_rows)
    row_stride = sum(sizes) // num_rows
    shape = _shape(segments, outs, outs[0].dtype if outs else torch.float32)
    placed = _place_views(shape, outs)
    by_stream: dict[object, list[_Launch]] = {}

    def bound(flat: torch.Tensor) -> None:
        if not segments:
            return
        if placed is None:
            _launch("out", flat, outs, _plan("out", flat, outs, segments, row_stride, num_rows), row_stride)
            return
        stream = _stream_key(flat.device)
        launches = by_stream.get(stream)
        if launches is None:  # once per stream: [Note: copy tables]
            itemsizes = _itemsizes(shape, outs, flat)
            launches = by_stream[stream] = _build("out", shape, placed, itemsizes, num_rows, flat.device)
        _launch("out", flat, outs, launches, row_stride)

    return bound


def bind_copy_in(
    sizes: Sequence[int], data_cols: Sequence[int], num_rows: int
) -> Callable[[Sequence[torch.Tensor | None], torch.Tensor], torch.Tensor]:
    """`(srcs, flat) -> copy_in(srcs, flat, ...)` for a checked layout: the segments are planned
    once per pattern of source dtypes, sizes and Nones; a call reads the sources' addresses
    (fresh gradients move) and looks the tables up by their relative offsets."""
    sizes, data_cols = list(sizes), list(data_cols)
    row_stride = sum(sizes) // num_rows
    layout = ("in", num_rows, tuple(sizes), tuple(data_cols))
    shapes: dict[tuple[object, ...], tuple[list[_Segment], _Shape]] = {}

    def bound(srcs: Sequence[torch.Tensor | None], flat: torch.Tensor) -> torch.Tensor:
        ptrs = []
        pattern: list[object] = [flat.dtype]
        for t in srcs:
            if t is None:
                ptrs.append(0)
                pattern.append(None)
            else:
                ptrs.append(t.data_ptr())
                pattern += (t.dtype, t.numel())
        pattern_t = tuple(pattern)
        planned = shapes.get(pattern_t)
        if planned is None:
            segments = _segments("in", srcs, sizes, data_cols, num_rows)
            planned = shapes[pattern_t] = (segments, _shape(segments, srcs, flat.dtype))
        segments, shape = planned
        if not segments:
            return flat
        placed = _place(shape, ptrs)
        key = (layout, _stream_key(flat.device), pattern_t, *placed.bases, *placed.offsets)
        launches = _cached(
            key, lambda: _build("in", shape, placed, _itemsizes(shape, srcs, flat), num_rows, flat.device)
        )
        _launch("in", flat, srcs, launches, row_stride)
        return flat

    return bound
