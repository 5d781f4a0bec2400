"""Which collective carries a unit's traffic, as the transports decide it: a codec path's name,
the all-gather's and the reduction's ops ("all_gather", "all_to_all", "reduce_scatter", or
"shm": [Note: shared-memory collectives] in cost.py). The calibration's units (calibration.py)
are built with these."""

from __future__ import annotations

from overlap.transport.backend import ALL_TO_ALL_GATHER_MAX_BYTES
from overlap.transport.shm_segments import MAX_RING_BYTES

NO_CODEC = "none"


def codec_path(param_compression: str | None, grad_compression: str | None) -> str:
    """The key of a codec pair in `Calibration.host`: "none", or "<param codec>/<grad codec>"."""
    if param_compression is None and grad_compression is None:
        return NO_CODEC
    return f"{param_compression}/{grad_compression}"


def shm_carries(shared_memory: bool, compressed: bool, wire_bytes: int) -> bool:
    """Whether shared memory carries a collective of `wire_bytes` (every rank's part): only
    uncompressed ones (a codec's exchange takes gloo) that fit the largest ring's half
    (`ShmSegments.fits`)."""
    return shared_memory and not compressed and wire_bytes <= MAX_RING_BYTES // 2


def gather_op(backend: str, num_ranks: int, compressed: bool, wire_bytes: int, shared_memory: bool = False) -> str:
    """The collective a unit's all-gather goes through, as the transports decide it: "shm"
    where shared memory carries it (`shm_carries`); gloo gathers an uncompressed unit of a
    two-rank group as a pair exchange ([Note: gather of a pair] in
    overlap/transport/collectives.py), compressed units as an exchange ([Note: receive before
    send] in pairwise.py) and small shards through all-to-all (`CommSemantics.auto_gather_impl`);
    all put the bytes of an all-to-all on the wire and are timed by the all-to-all link
    ("all_to_all"). Everything else: "all_gather"."""
    if backend != "gloo":
        return "all_gather"
    if shm_carries(shared_memory, compressed, wire_bytes):
        return "shm"
    if compressed or num_ranks == 2:
        return "all_to_all"
    return "all_to_all" if wire_bytes <= ALL_TO_ALL_GATHER_MAX_BYTES else "all_gather"


def reduce_op(backend: str, compressed: bool, wire_bytes: int, shared_memory: bool = False) -> str:
    """The collective a unit's gradient reduction goes through: "shm" where shared memory
    carries it (`shm_carries`), else the backend's "reduce_scatter" (timed by the reduce link)."""
    return "shm" if backend == "gloo" and shm_carries(shared_memory, compressed, wire_bytes) else "reduce_scatter"


def params_compressed(codec: str) -> bool:
    """Whether the codec path (`codec_path`) compresses the all-gathered parameters."""
    return codec != NO_CODEC and codec.split("/")[0] != "None"


def grads_compressed(codec: str) -> bool:
    """Whether the codec path (`codec_path`) compresses the reduced gradients."""
    return codec != NO_CODEC and codec.split("/")[1] != "None"
