"""Device kernels per bucket of a compressed reduce-scatter and all-gather, by world size.

Counts what one bucket costs on CUDA in launches (a per-row path would launch about six small
kernels per row): every ATen op that does device work plus every Triton launch, on the
Triton path the CUDA dispatch takes, run on the CPU under Triton's interpreter. The collective
itself is replaced by a loopback (what this rank sends is what it receives), so no process group
is needed and the world size is free. Run against any checkout to compare (PYTHONPATH=that
checkout); prints a table and writes JSON.

    TRITON_INTERPRET=1 python benchmarks/codec_launches.py --out /tmp/launches.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
import torch
from torch.utils._python_dispatch import TorchDispatchMode

if "PYTHONPATH" not in os.environ:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch.utils._python_dispatch
import triton

from overlap.compression import FeedbackResidual, Int8Codec, make_residual_format
from overlap.kernels import quantize
from overlap.transport import coded
from overlap.transport import collectives as comm

NO_KERNEL = {  # views, metadata and allocation: no device work
    "view", "_unsafe_view", "slice", "select", "as_strided", "unbind", "expand", "alias", "detach", "empty",
    "empty_strided", "t", "transpose", "permute", "unsqueeze", "squeeze", "reshape", "split", "split_with_sizes",
    "lift_fresh", "_reshape_alias", "view_as_real", "_local_scalar_dense", "is_nonzero", "chunk", "narrow",
    "empty_like", "new_empty", "new_empty_strided", "resolve_conj", "resolve_neg", "contiguous",
}  # fmt: skip


class Launches(TorchDispatchMode):
    """Counts ATen ops that launch device work (outside Triton's interpreter) and Triton launches."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __enter__(self) -> Launches:
        _TRITON.append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        _TRITON.remove(self)
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if name not in NO_KERNEL:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


_TRITON: list[Launches] = []  # the modes counting now


def counted(modes: list[Launches]) -> None:
    """Patch the interpreter's launch to count one launch in each active mode, and to hide its
    internal copies from them."""
    from triton.runtime.interpreter import InterpretedFunction

    original = InterpretedFunction.run

    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not modes:
            return original(self, *args, **kwargs)
        modes[-1].ops["triton:" + self.fn.__name__] += 1
        with torch.utils._python_dispatch._disable_current_modes():
            return original(self, *args, **kwargs)

    InterpretedFunction.run = run  # type: ignore[method-assign]


def one_bucket(world_size: int, numel: int, feedback: bool) -> dict[str, Any]:
    me = 0
    codec = Int8Codec(256)
    grads = torch.randn(world_size, numel)
    tail = torch.ones(world_size, 16)
    residual = None
    if feedback:
        residual = FeedbackResidual.zeros(
            make_residual_format(torch.float32, codec), me, world_size, numel, grads.device
        )
    comm.wait(coded.reduce_scatter_encoded(grads, tail, None, world_size, codec, residual))  # warm: caches
    mode = Launches()
    with mode:
        result = coded.reduce_scatter_encoded(grads, tail, None, world_size, codec, residual)
        encode = sum(mode.ops.values())
        comm.wait(result)
    decode = sum(mode.ops.values()) - encode
    shard = torch.randn(numel)
    gather = Launches()
    with gather:
        send = coded.encode_shard(shard, codec, tag_room=False)
        comm.wait(coded.all_gather_encoded(send, numel, None, world_size, torch.float32, codec))
    return {"world_size": world_size, "error_feedback": feedback, "reduce_encode": encode,
            "reduce_decode": decode, "gather": sum(gather.ops.values()),
            "ops": dict(mode.ops), "gather_ops": dict(gather.ops)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--numel", type=int, default=4096)
    args = parser.parse_args()
    quantize.select_backend = lambda *a, **k: "triton"  # the CUDA dispatch, on CPU tensors
    original_select = getattr(sys.modules.get("overlap.kernels.rows"), "select_backend", None)
    if original_select is not None:
        sys.modules["overlap.kernels.rows"].select_backend = quantize.select_backend  # type: ignore[attr-defined]
    # a loopback for the collective (not counted): no process group, any world size
    comm.dist.get_rank = lambda group=None: 0  # type: ignore[assignment]

    def exchange(send: torch.Tensor, world_size: int, group: Any, slack: Any, rank: Any = None) -> Any:
        with torch.utils._python_dispatch._disable_current_modes():
            return send.clone(), None, None

    def all_gather(out: torch.Tensor, send: torch.Tensor, group: Any = None, async_op: bool = True) -> None:
        with torch.utils._python_dispatch._disable_current_modes():
            out.view(-1, send.numel()).copy_(send)

    comm._exchange = exchange  # type: ignore[assignment]
    comm._all_gather = all_gather  # type: ignore[assignment]
    comm._receive_first = lambda group, send: False  # type: ignore[assignment]  # NCCL's way: the native all-gather
    rows = []
    counted(_TRITON)
    for feedback in (False, True):
        for world_size in (2, 4, 8):
            row = one_bucket(world_size, args.numel, feedback)
            rows.append(row)
            print(f"W={world_size} EF={'yes' if feedback else 'no ':3} reduce-scatter: encode {row['reduce_encode']:3d} "
                  f"decode {row['reduce_decode']:3d}  all-gather: {row['gather']:3d}", flush=True)  # fmt: skip
    if args.out is not None:
        args.out.write_text(json.dumps({"triton": triton.__version__, "numel": args.numel, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
