"""The runtime's copy-out and copy-in layouts, mirrored, and one copy as the runtime issues it:
what the numerics and bandwidth parts run (the worlds check the mirror against the runtime)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from overlap.kernels import copy_in, copy_in_ref, copy_out, copy_out_ref

from .internals import CHUNK_ALIGN_NUMEL, TAG_NUMEL, ParamInfo, UnitLayout, _plan, _segments, flag_cols, make_layout


def runtime_copy_out_layout(layout: UnitLayout, n: int) -> tuple[list[int], list[int], int]:
    """(sizes, data_cols, tag columns) of the runtime's copy-out of `layout` gathered over `n`
    ranks: per parameter its padded chunk and its data columns, then the tag slot each rank's row
    ends in (tagged at world size > 1). Mirrors Runtime._copy_out: keep in step with it."""
    tag = TAG_NUMEL if n > 1 else 0
    sizes = [n * s.padded_chunk_numel for s in layout.slots] + ([n * tag] if tag else [])
    cols = [s.chunk_numel for s in layout.slots] + ([tag] if tag else [])
    return sizes, cols, tag


def runtime_copy_in_layout(layout: UnitLayout, n: int) -> tuple[list[int], list[int]]:
    """(sizes, data_cols) of the runtime's gradient copy-in of `layout` over `n` ranks (no codec):
    per trainable parameter its padded chunk, then the used-flag column of each parameter, padded
    to the chunk alignment. Mirrors Reductions.reduce: keep in step with it."""
    slots = layout.grad_slots
    sizes = [n * s.padded_chunk_numel for s in slots] + [n * flag_cols(len(slots))]
    return sizes, [s.chunk_numel for s in slots] + [len(slots)]


def numerics_layout(n: int) -> UnitLayout:
    """A unit of odd parameters laid out over `n` ranks as wrap does: padded chunks, a 1-element
    parameter, rows not divisible by `n`, a segment wider than one copy tile."""
    shapes = [(96, 33), (97,), (5, 7), (1,), (40, 64), (301,), (1500,)]
    params = [ParamInfo(f"p{i}", ((f"m{i}", "w"),), torch.Size(s), True) for i, s in enumerate(shapes)]
    return make_layout(0, "numerics", ("numerics",), params, n, CHUNK_ALIGN_NUMEL)


def block_layout(numel: int, n: int) -> UnitLayout:
    """One GPT block's parameters (~numel elements, d a multiple of 64) laid out over `n` ranks."""
    d = max(64, round((numel / 12) ** 0.5 / 64) * 64)
    shapes = [(3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,), (d,), (d,)]
    params = [ParamInfo(f"p{i}", ((f"m{i}", "w"),), torch.Size(s), True) for i, s in enumerate(shapes)]
    return make_layout(0, "block", ("block",), params, n, CHUNK_ALIGN_NUMEL)


def specials(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random values with NaN, +-Inf, -0.0 and a denormal sprinkled in (fp32, then cast)."""
    v = torch.randn(t.numel(), generator=gen) * 10
    for i, s in enumerate((float("nan"), float("inf"), float("-inf"), -0.0, 3e-41, 1e-40)):
        v[(i * 997 + 13) % max(1, v.numel())] = s
    return t.copy_(v.view(t.shape))


@dataclass
class CopyJob:
    """One copy-out or copy-in exactly as the runtime issues it. Copy-out writes views of one
    unsharded buffer (`owner`, at `spans`) and the tag slots; copy-in reads separate gradient
    tensors and the used flags. `to(device)` is the same job, copied, on `device`."""

    kind: str  # "out" | "in"
    flat: torch.Tensor
    tensors: list[torch.Tensor | None]
    sizes: list[int]
    cols: list[int]
    n: int
    owner: torch.Tensor | None = None  # copy-out: the unsharded buffer the outs are views of
    spans: list[tuple[int, int]] = field(default_factory=list)  # copy-out: (offset, numel) per view

    def to(self, device: torch.device) -> CopyJob:
        def moved(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, copy=True)

        if self.owner is None:
            return CopyJob(self.kind, moved(self.flat), [moved(t) for t in self.tensors], self.sizes, self.cols, self.n)  # type: ignore[arg-type]
        owner = moved(self.owner)
        assert owner is not None
        views: list[torch.Tensor | None] = [owner[o : o + k] for o, k in self.spans]
        extra = [moved(t) for t in self.tensors[len(self.spans) :]]
        return CopyJob(self.kind, moved(self.flat), views + extra, self.sizes, self.cols, self.n, owner, self.spans)  # type: ignore[arg-type]

    def run(self, backend: str) -> None:
        if self.kind == "out":
            copy_out(self.flat, self.tensors, sizes=self.sizes, data_cols=self.cols, num_rows=self.n, backend=backend)  # type: ignore[arg-type]
        else:
            copy_in(self.tensors, self.flat, sizes=self.sizes, data_cols=self.cols, num_rows=self.n, backend=backend)  # type: ignore[arg-type]

    def run_ref(self) -> None:
        if self.kind == "out":
            copy_out_ref(self.flat, self.tensors, self.sizes, self.n, self.cols)  # type: ignore[arg-type]
        else:
            copy_in_ref(self.tensors, self.flat, self.sizes, self.n, self.cols)

    def results(self) -> dict[str, torch.Tensor]:
        """What the copy wrote: the reduce buffer, or the unsharded buffer (padding included:
        nothing may write there) and the tags."""
        if self.kind == "in":
            return {"flat": self.flat}
        out = {"unsharded": self.owner if self.owner is not None else self.flat}
        if len(self.tensors) > len(self.spans):
            out["tags"] = self.tensors[-1]  # type: ignore[assignment]
        return out  # type: ignore[return-value]

    def moved_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [self.flat, *self.tensors] if t is not None)

    def plan(self) -> dict[str, Any]:
        """Which Triton copy launches this layout gets ([Note: copy alignment] in triton_copy.py)."""
        row_stride = self.flat.numel() // self.n
        segments = _segments(self.kind, self.tensors, self.sizes, self.cols, self.n)
        launches = _plan(self.kind, self.flat, self.tensors, segments, row_stride, self.n)
        return {"row_stride": row_stride, "row_stride_mod16": row_stride % 16, "segments": len(segments),
                "launches": [launch_plan(x) for x in launches]}  # fmt: skip


def launch_plan(launch: Any) -> dict[str, Any]:
    """One Triton copy launch: aligned (every segment on the vector branch), its tiles, and how
    many of its segments take the vector branch."""
    segments = int(getattr(launch, "num_segments", 1))
    aligned = int(getattr(launch, "num_aligned", segments if launch.aligned else 0))
    return {
        "aligned": bool(launch.aligned),
        "tiles": int(launch.num_tiles),
        "segments": segments,
        "aligned_segments": aligned,
    }


def copy_job(kind: str, layout: UnitLayout, n: int, src: torch.dtype, dst: torch.dtype, gen: torch.Generator | None,
             unused: int | None = None, device: torch.device | str = "cpu") -> CopyJob:  # fmt: skip
    """The runtime's copy-out of `layout`'s gathered rows (dtype `src`) into the unsharded
    parameters (`dst`), or its copy-in of the gradients (`src`; parameter `unused` has none) into
    the reduce buffer (`dst`). Inputs drawn from `gen` with specials (None: left empty), outputs
    poisoned."""
    if kind == "out":
        sizes, cols, tag = runtime_copy_out_layout(layout, n)
        gathered = torch.empty(n, layout.shard_numel + tag, dtype=src, device=device)
        unsharded = torch.full((layout.unsharded_numel,), -7.0, dtype=dst, device=device)
        spans = [(s.unsharded_offset, n * s.chunk_numel) for s in layout.slots]
        outs: list[torch.Tensor | None] = [unsharded[o : o + k] for o, k in spans]
        if gen is not None:
            specials(gathered, gen)
        if tag:  # the tag slot keeps the gathered dtype (Runtime._copy_out); any bits, NaN patterns too
            if gen is not None:
                bits = torch.randint(-(2**62), 2**62, (n, tag * src.itemsize // 8), generator=gen)
                gathered[:, layout.shard_numel :] = bits.view(src).to(device)
            outs.append(torch.full((n * tag,), -7.0, dtype=src, device=device))
        return CopyJob("out", gathered.view(-1), outs, sizes, cols, n, unsharded, spans)
    sizes, cols = runtime_copy_in_layout(layout, n)
    grads: list[torch.Tensor | None] = []
    for i, s in enumerate(layout.grad_slots):
        g = None if i == unused else torch.empty(s.shape, dtype=src, device=device)
        if g is not None and gen is not None:
            specials(g, gen)
        grads.append(g)
    flags = torch.tensor([g is not None for g in grads], dtype=dst).repeat(n).to(device)
    full = torch.full((sum(sizes),), -7.0, dtype=dst, device=device)
    return CopyJob("in", full, [*grads, flags], sizes, cols, n)
