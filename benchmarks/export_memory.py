"""Peak host memory of `overlap.full_state_dict(model, rank0_only=True)`, per rank, on CPU / gloo.

    python benchmarks/export_memory.py                          # 8 blocks of 1024 x 4096: 256 MiB
    python benchmarks/export_memory.py --layers 2 --dim 128 --out /tmp/export.json

A model of `--layers` MLP blocks (dim -> 4 dim -> dim, fp32) built on the meta device, so that no
rank ever holds it whole before the export, and wrapped in two worlds, each in fresh processes:
"dp2 x tp2" (4 ranks, `up` colwise and `down` rowwise over tp, overlap over dp) and "dp2" (2 ranks,
plain sharding). Then one export. Per rank:
- kept: the bytes of the dict it returned (rank 0 writes it; the others should keep nothing);
- tracked peak: our accounting, the peak of the bytes of host tensors that ops returned during the
  export and that were still alive (`LiveBytes`: every fresh tensor followed until freed);
- RSS peak: the OS's, VmHWM after the export minus VmRSS before it (free heap handed back with
  malloc_trim and the high-water mark reset through /proc/self/clear_refs first). glibc's mmap
  threshold is fixed at 1 MiB for the ranks (MALLOC_MMAP_THRESHOLD_): its default rises to the
  size of the largest block freed, after which freed tensors stay in the heap and RSS counts
  memory no tensor holds.
Prints a table and writes JSON (with the commit of the overlap imported and the CPU model).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

WORLDS = {"dp2 x tp2": (2, 2), "dp2": (2, 1)}  # name: (dp, tp)
MIB = 1 << 20


class LiveBytes(TorchDispatchMode):
    """The bytes of the host tensors that ops return while active (each storage once, until it
    is freed): live now, and their peak. Views and in-place results share an input's storage and
    are not counted: only what an op allocated."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak_bytes = 0

    @property
    def live_bytes(self) -> int:
        self._live = {ptr: (ref, n) for ptr, (ref, n) in self._live.items() if not ref.expired()}
        return sum(n for _, n in self._live.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not any(r.alias_info is not None for r in func._schema.returns):
            live = self.live_bytes  # drops the freed first: a new storage may reuse an address
            for t in tree_leaves(out):
                if type(t) is torch.Tensor and t.device.type == "cpu":
                    storage = t.untyped_storage()
                    if storage.data_ptr() not in self._live:
                        self._live[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
                        live += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, live)
        return out


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _reset_peak_rss() -> bool:
    """Hand free heap back to the OS and restart VmHWM from VmRSS; False where not allowed."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc_trim(0)
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _model(dim: int, layers: int, mesh: Any, tp: int) -> nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    with torch.device("meta"):
        blocks = [nn.Sequential(nn.Linear(dim, 4 * dim), nn.ReLU(), nn.Linear(4 * dim, dim)) for _ in range(layers)]
    if tp > 1:
        for block in blocks:
            parallelize_module(block, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return nn.Sequential(*blocks)


def export_on_rank(rank: int, world_size: int, dim: int, layers: int, tp: int) -> dict[str, Any]:
    """Wrap the meta model on this rank's world, export once; this rank's measures."""
    from torch.distributed.device_mesh import init_device_mesh

    import overlap

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world_size // tp, tp), mesh_dim_names=("dp", "tp"))
    config = overlap.OverlapConfig(cpu_keep_freed_memory=False)  # freed memory goes back: RSS shows the export
    model = overlap.wrap(_model(dim, layers, mesh, tp), group=mesh["dp"], config=config)
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    share = sum(local(p).numel() * p.element_size() for p in model.parameters())
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    dist.barrier()
    reset = _reset_peak_rss()
    rss_before = _status_kib("VmRSS")
    start = time.perf_counter()
    with LiveBytes() as tracked:
        exported = overlap.full_state_dict(model, rank0_only=True)
    seconds = time.perf_counter() - start
    rss_peak = _status_kib("VmHWM") - rss_before if reset else None
    return {
        "rank": rank,
        "model_bytes": full,
        "share_bytes": share,
        "kept_bytes": sum(t.numel() * t.element_size() for t in exported.values()),
        "tracked_peak_bytes": tracked.peak_bytes,
        "rss_peak_bytes": None if rss_peak is None else rss_peak * 1024,
        "seconds": seconds,
    }


def _commit() -> str:
    import overlap

    root = Path(overlap.__file__).resolve().parent.parent
    git = lambda *a: subprocess.run(["git", "-C", str(root), *a], capture_output=True, text=True).stdout.strip()  # noqa: E731
    return git("rev-parse", "--short", "HEAD") + ("-dirty" if git("status", "--porcelain", "--", "overlap") else "")


def _cpu_model() -> str:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    from overlap.tools.worlds.launch import run_local_world

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--worlds", default=",".join(WORLDS), help=f"comma-separated, of {list(WORLDS)}")
    p.add_argument("--out", default="export_memory.json")
    args = p.parse_args()
    rows = []
    for name in args.worlds.split(","):
        dp, tp = WORLDS[name]
        per_rank = run_local_world(export_on_rank, dp * tp, args.dim, args.layers, tp)
        rows += [{"world": name, **r} for r in per_rank]
    print(
        f"{'world':<10} {'rank':>4} {'model MiB':>9} {'share MiB':>9} {'kept MiB':>8} {'tracked peak MiB':>16} {'RSS peak MiB':>12}"
    )
    for r in rows:
        rss = "n/a" if r["rss_peak_bytes"] is None else f"{r['rss_peak_bytes'] / MIB:.1f}"
        print(
            f"{r['world']:<10} {r['rank']:>4} {r['model_bytes'] / MIB:>9.1f} {r['share_bytes'] / MIB:>9.1f} "
            f"{r['kept_bytes'] / MIB:>8.1f} {r['tracked_peak_bytes'] / MIB:>16.1f} {rss:>12}"
        )
    result = {"commit": _commit(), "cpu": _cpu_model(), "torch": torch.__version__, "args": vars(args), "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"commit {result['commit']}, {result['cpu']}; wrote {args.out}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))  # read by the spawned ranks' glibc
    main()
