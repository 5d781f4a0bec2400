"""The GPU checks' only imports of overlap's private modules (docs/architecture.md says where
each lives): a move of the engine's modules changes these lines and nothing else in tests/gpu."""

# isort: skip_file
# the collectives and their wait ([Note: injected delays] in delays.py); Free / ReleaseReduce
from overlap.engine.reduction import Reductions
from overlap.engine.reduction import flag_cols  # the padded used-flag columns of a reduction row
from overlap.engine.runtime import Runtime
from overlap.engine.autotune_memory import measured_peak_bytes  # the allocator peak (CUDA) or peak RSS
from overlap.engine.units import CHUNK_ALIGN_NUMEL, ParamInfo, UnitLayout, make_layout
from overlap.kernels import triton_kernels
from overlap.kernels.reference import code_numel
from overlap.kernels.rows import decode_sum_rows, encode_rows, encode_rows_loop
from overlap.kernels.triton_copy import _plan, _segments  # which copy variant a layout gets
from overlap.transport import coded
from overlap.transport import collectives as comm
from overlap.transport.fingerprint import TAG_NUMEL  # the tag slot after each gathered row

__all__ = [
    "CHUNK_ALIGN_NUMEL", "TAG_NUMEL", "ParamInfo", "Reductions", "Runtime", "UnitLayout", "_plan", "_segments",
    "code_numel", "coded", "comm", "decode_sum_rows", "encode_rows", "encode_rows_loop", "flag_cols",
    "make_layout", "measured_peak_bytes", "triton_kernels",
]  # fmt: skip
