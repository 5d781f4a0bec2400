"""Fused copy-out / copy-in with cast: many tensors to or from one flat buffer in one pass.

[Note: fused copy layout]
A flat buffer of `num_rows * W` elements, viewed as (num_rows, W), is cut along dim 1 into
column blocks, one per tensor: segment i holds `sizes[i]` elements, `cols_i = sizes[i] / num_rows`
columns starting at column `off_i = cols_0 + ... + cols_{i-1}`, and `W = sum(cols_i)`. Tensor i
fills its block row by row, `d_i = data_cols[i]` (default `cols_i`, at most `cols_i`) elements
per row: its element k sits at row `k // d_i`, column `off_i + k % d_i`. Every other position of
the block is padding: columns `d_i..cols_i - 1` of each row, and the rows (or the rest of a row)
past the tensor's last element. With the default `d_i = cols_i`, segment i read row-major
(`flat.view(num_rows, W)[:, off_i : off_i + cols_i].reshape(-1)`) is the tensor's flat contents
followed by padding:

    copy_out(flat, outs)   outs[i].view(-1) = the data positions of segment i, in order
                           (the first outs[i].numel() of them; cast to outs[i].dtype)
    copy_in(srcs, flat)    segment i = srcs[i] at its data positions, 0 at the padding
                           (cast to flat.dtype)

`num_rows = 1` is a plain split / concatenation (`sizes` default to the tensors' numels). With
`num_rows = world_size`, `sizes[i] = world_size * padded_chunk_numel_i` and `data_cols[i] =
chunk_numel_i` this is exactly the runtime's rank-major all-gather output -> parameter-major
unsharded buffer (copy-out) and padded gradients -> rank-major reduce-scatter input (copy-in),
see [Note: flat layout] in overlap/engine/units.py. A `None` source is all zeros (an unused
parameter's gradient).

Casts are torch's (`Tensor.to`): fp32 -> bf16/fp16 round to nearest even, widening is exact;
every backend equals `copy_out_ref` / `copy_in_ref` bitwise for finite and infinite values. NaN
stays NaN, but its sign and payload bits are not specified (torch's own vectorised and scalar
paths differ there).

Backends: Triton on CUDA (triton_copy.py: one launch per distinct dtype of the many-tensor side,
usually one in all), the C++ extension on CPU (csrc/copy.cpp, one parallel pass over the whole job), else the references below. The compiled backends take fp32, bf16 and fp16; other dtypes use the reference.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from overlap.kernels import cpu
from overlap.kernels.quantize import Backend

COMPILED_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})


# ---------------------------------------------------------------------------------- references
def copy_out_ref(flat: torch.Tensor, outs: Sequence[torch.Tensor], sizes: Sequence[int] | None = None,
                 num_rows: int = 1, data_cols: Sequence[int] | None = None) -> None:  # fmt: skip
    """Definition of `copy_out` ([Note: fused copy layout]) in plain torch ops."""
    sizes = _sizes_or_numels(sizes, outs)
    cols = [s // num_rows for s in sizes]
    data = cols if data_cols is None else list(data_cols)
    blocks = flat.reshape(num_rows, -1).split(cols, dim=1)
    with torch.no_grad():
        for out, block, d in zip(outs, blocks, data):
            out.view(-1).copy_(block[:, :d].reshape(-1)[: out.numel()])


def copy_in_ref(srcs: Sequence[torch.Tensor | None], flat: torch.Tensor, sizes: Sequence[int] | None = None,
                num_rows: int = 1, data_cols: Sequence[int] | None = None) -> torch.Tensor:  # fmt: skip
    """Definition of `copy_in` ([Note: fused copy layout]) in plain torch ops; returns `flat`."""
    sizes = _sizes_or_numels(sizes, srcs)
    data = [s // num_rows for s in sizes] if data_cols is None else list(data_cols)
    with torch.no_grad():
        columns = []
        for src, size, d in zip(srcs, sizes, data):
            column = torch.zeros(num_rows, size // num_rows, dtype=flat.dtype, device=flat.device)
            if src is not None:
                rows = torch.zeros(num_rows * d, dtype=flat.dtype, device=flat.device)
                rows[: src.numel()] = src.reshape(-1)
                column[:, :d] = rows.view(num_rows, d)
            columns.append(column)
        if columns:
            torch.cat(columns, dim=1, out=flat.view(num_rows, -1))
    return flat


# ---------------------------------------------------------------------------------- dispatch
def copy_out(flat: torch.Tensor, outs: Sequence[torch.Tensor], *, sizes: Sequence[int] | None = None, num_rows: int = 1,
             data_cols: Sequence[int] | None = None, backend: Backend = "auto",
             validate: bool = True) -> None:  # fmt: skip
    """Split `flat` into the contiguous `outs` in one pass, casting to each out's dtype.

    See [Note: fused copy layout]; `sizes[i]` (default `outs[i].numel()`) is segment i's length
    in `flat`, `data_cols[i]` (default: all its columns) the columns of each row that hold
    data; out i receives the first `outs[i].numel()` data elements. `validate=False` skips the
    layout checks, for a caller repeating a layout it has had checked (the runtime, after the
    first step: they cost microseconds per call, and it makes several per unit and step).
    """
    sizes = [t.numel() for t in outs] if sizes is None else list(sizes)
    flat = flat.contiguous()
    if validate:
        dtypes = _validate("copy_out", flat, outs, sizes, num_rows, data_cols)
    else:
        dtypes = {flat.dtype, *(t.dtype for t in outs)}
    data = [s // num_rows for s in sizes] if data_cols is None else list(data_cols)
    chosen = select_copy_backend(flat.device, dtypes, backend)
    if chosen == "cpp":
        _extension().copy_out(flat, outs, sizes, data, num_rows)
    elif chosen == "triton":
        from overlap.kernels import triton_copy

        triton_copy.copy_out(flat, outs, sizes, data, num_rows)
    else:
        copy_out_ref(flat, outs, sizes, num_rows, data)
        return
    torch.autograd.graph.increment_version(outs)  # raw writes: count them as `copy_` would


def copy_in(srcs: Sequence[torch.Tensor | None], flat: torch.Tensor, *, sizes: Sequence[int] | None = None,
            num_rows: int = 1, data_cols: Sequence[int] | None = None, backend: Backend = "auto",
            validate: bool = True) -> torch.Tensor:  # fmt: skip
    """Pack `srcs` into the contiguous `flat` in one pass, cast to `flat.dtype`, zero-padded.

    See [Note: fused copy layout]; `sizes[i]` (default `srcs[i].numel()`, required for a None
    source) is segment i's length, `data_cols[i]` (default: all its columns) the columns of
    each row that take source elements. Returns `flat`. `validate=False`: as in `copy_out`.
    """
    if sizes is None:
        if any(s is None for s in srcs):
            raise ValueError("overlap.kernels.copy_in: a None source (zeros) needs explicit `sizes`")
        sizes = [s.numel() for s in srcs if s is not None]
    else:
        sizes = list(sizes)
    if not flat.is_contiguous():
        raise ValueError("overlap.kernels.copy_in: flat must be contiguous")
    present = [s if s is None or s.is_contiguous() else s.contiguous() for s in srcs]
    if validate:
        dtypes = _validate("copy_in", flat, present, sizes, num_rows, data_cols)
    else:
        dtypes = {flat.dtype, *(t.dtype for t in present if t is not None)}
    data = [s // num_rows for s in sizes] if data_cols is None else list(data_cols)
    chosen = select_copy_backend(flat.device, dtypes, backend)
    if chosen == "cpp":
        empty = flat.new_empty(0)
        _extension().copy_in([s if s is not None else empty for s in present], sizes, data, flat, num_rows)
    elif chosen == "triton":
        from overlap.kernels import triton_copy

        triton_copy.copy_in(present, flat, sizes, data, num_rows)
    else:
        return copy_in_ref(present, flat, sizes, num_rows, data)
    torch.autograd.graph.increment_version(flat)  # raw writes: count them as `copy_` would
    return flat


# ---------------------------------------------------------------------------------- bound
# [Note: bound copies]
# The runtime repeats the same layouts every step (a unit's copy-out, a bucket's copy-in), several
# times per unit and step, where the dispatch above (lists, dtype sets, the backend choice, the
# op's overload resolution) costs about as much as copying a small unit. `bind_copy_out` and
# `bind_copy_in` take a layout that one call of `copy_out` / `copy_in` has checked and return a
# function that only copies. They do not count versions (`copy_out` bumps the outs' version
# counters): the runtime's destinations are its own buffers, whose versions it manages itself.


def bind_copy_out(
    flat_dtype: torch.dtype,
    device: torch.device,
    outs: Sequence[torch.Tensor],
    sizes: Sequence[int],
    data_cols: Sequence[int],
    num_rows: int,
    *,
    rows: bool = False,
) -> Any:
    """`flat -> copy_out(flat, outs, ...)` for a checked layout ([Note: bound copies]): `flat`
    must be contiguous and of `flat_dtype`. With `rows`, the function takes the flat buffer as
    `num_rows` separate contiguous tensors instead (row r in the first `sum(sizes) // num_rows`
    elements of the r-th; [Note: gather of a pair] in transport/collectives.py), read in place on the CPU."""
    outs, sizes, data = list(outs), list(sizes), list(data_cols)
    chosen = select_copy_backend(device, {flat_dtype, *(t.dtype for t in outs)})
    if chosen == "cpp":
        if rows:
            op_rows = _extension().copy_out_rows.default
            return lambda parts: op_rows(parts, outs, sizes, data)
        op = _extension().copy_out.default
        return lambda flat: op(flat, outs, sizes, data, num_rows)

    bound: Callable[[torch.Tensor], None]
    if chosen == "triton":
        from overlap.kernels import triton_copy

        bound = triton_copy.bind_copy_out(outs, sizes, data, num_rows)  # offsets read once
    else:
        bound = functools.partial(copy_out_ref, outs=outs, sizes=sizes, num_rows=num_rows, data_cols=data)

    if not rows:
        return bound
    width = sum(sizes) // num_rows
    return lambda parts: bound(torch.cat([part[:width] for part in parts]))


def bind_copy_in(
    dtypes: Iterable[torch.dtype], device: torch.device, sizes: Sequence[int], data_cols: Sequence[int], num_rows: int
) -> Any:
    """`(srcs, flat) -> copy_in(srcs, flat, ...)` for a checked layout whose tensors (sources
    present and flat) have `dtypes` ([Note: bound copies]); sources contiguous, None for zeros."""
    sizes, data = list(sizes), list(data_cols)
    chosen = select_copy_backend(device, dtypes)
    if chosen == "cpp":
        op = _extension().copy_in.default

        def run_cpp(srcs: Sequence[torch.Tensor | None], flat: torch.Tensor) -> None:
            empty = flat.new_empty(0)
            op([s if s is not None else empty for s in srcs], sizes, data, flat, num_rows)

        return run_cpp
    if chosen == "triton":
        from overlap.kernels import triton_copy

        return triton_copy.bind_copy_in(sizes, data, num_rows)
    return lambda srcs, flat: copy_in_ref(srcs, flat, sizes, num_rows, data)


def select_copy_backend(device: torch.device, dtypes: Iterable[torch.dtype], backend: Backend = "auto") -> str:
    """The backend `copy_out` / `copy_in` use for tensors of `dtypes` on `device`."""
    dtypes = frozenset(dtypes)
    compilable = dtypes <= COMPILED_DTYPES
    if backend != "auto":
        if backend in ("cpp", "triton") and not compilable:
            raise ValueError(f"overlap.kernels: backend={backend!r} copies fp32/bf16/fp16 only, got {set(dtypes)}")
        return backend
    return _auto_backend(device.type, dtypes)


@functools.lru_cache(maxsize=64)
def _auto_backend(device_type: str, dtypes: frozenset[torch.dtype]) -> str:
    """The automatic choice, fixed for a process once the extension has been tried."""
    compilable = dtypes <= COMPILED_DTYPES
    if not compilable:
        return "ref"
    if device_type == "cuda":
        from overlap.kernels import triton_copy

        return "triton" if triton_copy.available() else "ref"
    if device_type == "cpu" and cpu.load_extension() is not None:
        return "cpp"
    return "ref"


# ---------------------------------------------------------------------------------- checks
def _sizes_or_numels(sizes: Sequence[int] | None, tensors: Sequence[torch.Tensor | None]) -> list[int]:
    if sizes is None:
        return [t.numel() for t in tensors if t is not None]
    return [int(s) for s in sizes]


def _validate(
    op: str,
    flat: torch.Tensor,
    tensors: Sequence[torch.Tensor | None],
    sizes: list[int],
    num_rows: int,
    data_cols: Sequence[int] | None,
) -> set[torch.dtype]:
    """Check the layout and the tensors in one pass (this runs per unit per step); returns
    the dtypes involved."""
    where = f"overlap.kernels.{op}"
    if not isinstance(num_rows, int) or num_rows < 1:
        raise ValueError(f"{where}: num_rows must be a positive int, got {num_rows!r}")
    if len(sizes) != len(tensors):
        raise ValueError(f"{where}: {len(sizes)} sizes for {len(tensors)} tensors")
    if data_cols is not None and len(data_cols) != len(tensors):
        raise ValueError(f"{where}: {len(data_cols)} data_cols for {len(tensors)} tensors")
    if not flat.is_floating_point():
        raise TypeError(f"{where}: flat must be floating, got {flat.dtype}")
    device = flat.device
    dtypes = {flat.dtype}
    total = 0
    for i, (t, size) in enumerate(zip(tensors, sizes)):
        total += size
        if size < 0 or size % num_rows:
            raise ValueError(f"{where}: sizes[{i}]={size} is not a non-negative multiple of num_rows={num_rows}")
        capacity = size
        if data_cols is not None:
            d = data_cols[i]
            if not 0 <= d <= size // num_rows:
                raise ValueError(f"{where}: data_cols[{i}]={d} is not within the segment's {size // num_rows} columns")
            capacity = num_rows * d
        if t is None:
            continue
        dtype = t.dtype
        if dtype not in dtypes:
            if not t.is_floating_point():
                raise TypeError(f"{where}: tensor {i} must be floating, got {dtype}")
            dtypes.add(dtype)
        if t.numel() > capacity:
            raise ValueError(
                f"{where}: tensor {i} has {t.numel()} elements, more than sizes[{i}]={size} "
                f"(num_rows={num_rows} x data_cols) holds"
            )
        if not t.is_contiguous():
            raise ValueError(f"{where}: tensor {i} must be contiguous")
        if t.device != device:
            raise ValueError(f"{where}: tensor {i} is on {t.device}, flat on {device}")
    if flat.numel() != total:
        raise ValueError(f"{where}: flat has {flat.numel()} elements, the segments {total}")
    return dtypes


def _extension() -> Any:
    ext = cpu.load_extension()
    if ext is None:
        raise RuntimeError("overlap.kernels: backend='cpp' requested but the extension is not built")
    return ext
