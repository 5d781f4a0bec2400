"""`overlap bench comm`: collective bandwidth over torch.distributed, printed as nccl-tests does.

    overlap bench comm                                   # 2 local gloo ranks, 8 B .. 256 MiB
    overlap bench comm --ops all_gather --dtype bfloat16 --json out/comm.json
    overlap bench comm --link 1gbit                      # ranks behind an emulated 1 Gbit/s link
    overlap bench comm --transport shm                   # all_gather, reduce_scatter through shared memory
    overlap bench comm --transport shm --min-bytes 1048576 --max-bytes 67108864 --json out/shm.json
    torchrun --nproc-per-node 8 -m overlap bench comm    # NCCL across the node's GPUs

Sizes are the per-rank bytes nccl-tests counts: the gathered output of all_gather, the input of
reduce_scatter, the buffer of all_reduce and of all_to_all. algbw = size / time. busbw = algbw x
a factor that makes the figure comparable with the link's bandwidth whatever the world size
(nccl-tests' PERFORMANCE.md): (n-1)/n for all_gather, reduce_scatter and all_to_all, 2(n-1)/n
for all_reduce (a reduce-scatter then an all-gather).

[Note: comm bench timing]
Each timed collective is called with async_op=False. On gloo that blocks until it is done, so the
loop runs them one after another, as NCCL does on its stream; issuing them all async would let
gloo's two worker threads run two at once and report a bandwidth no single collective reaches.
On NCCL the calls only enqueue, and one synchronize ends the loop. A case's time is its loop time
/ iters, averaged over ranks (nccl-tests' default). `benchmarks/comm_bare.py` runs `measure`
interleaved with a bare torch.distributed loop to show the harness adds nothing.
Before timing, each case is checked once: per-rank fill values, one collective, the output
compared with what it must be; then the buffers are zeroed, so repeated in-place all_reduces
cannot overflow. Shown as n/a: out-of-place all_reduce (torch has only the in-place form; a copy
plus all_reduce would time the copy) and in-place all_to_all (gloo returns wrong data when the
input aliases the output; torch does not promise that aliasing works).

[Note: comm bench over shared memory]
`--transport shm` measures what the engine moves between ranks on one host when
`OverlapConfig.shared_memory` is on (transport/shm.py): all_gather and reduce_scatter through a
`ShmSegments` over the default group, its ring sized as the engine sizes it for a unit of the
largest case (`shm.ring_bytes_for_collective`), called as the strategies call it. An all-gather's output is
allocated in the ring (`ShmSegments.output`; a private tensor where it has no room), and dropped
after the wait as the runtime drops it. A reduce-scatter's input is written into the room reserved
for the post (`ShmSegments.reserve`) before the clock starts: the copy-in every transport has,
outside the collective; the sum is read through the result's finish (`comm.wait`). Each call is
clocked from issue to the end of its wait, after the same correctness check as above. Only the
out-of-place forms apply (an output lives where the transport allocates it); all_reduce and
all_to_all, integer reduce_scatters (its sum is csrc/reduce.cpp's, floating types only), `--link`
(its ranks have network namespaces of their own), CUDA ranks and ranks that are not all on one
host are refused. The ranks' allocator keeps freed blocks for reuse, as `wrap` sets it
(`keep_freed_cpu_memory`): a sum's output is allocated as in training.
Beside each case every rank copies the same bytes at once between two private buffers (one
memcpy, csrc/shm.cpp's): the reference for the memory traffic. An all-gather copies each row of
its output once (S bytes read and written, as the memcpy does); a reduce-scatter reads S and
writes S/n. `% copy` is the collective's algbw as a share of the copy's, a reference rather
than a bound: flag waits (a peer not yet posted, or not running), posts and bookkeeping pull it
down; a reduce-scatter's smaller writes, and the streaming stores of the posts ([Note: streaming
posts] in csrc/shm.cpp) on buffers larger than the cache, can lift it past 100%. The copy runs on
the same processes and cores, right after its case, so load on a shared machine falls on both
alike. `benchmarks/shm_bandwidth.py` interleaves the same calls with gloo's over rounds and
reports median and spread. Every page of every ring is faulted in once before the sweep, as
after a training run's first steps (`_map_every_page`).

This module holds the configuration, the measurement and the per-rank sweep; one case's buffers,
check and timed loop are in comm_cases.py, the shared-memory transport's calls and segments in
comm_shm.py, the rows, the report and its tables in comm_report.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import get_args

import torch
import torch.distributed as dist
from tqdm import tqdm

from overlap.tools.bench.comm_cases import OPS, Op, Transport, _is_correct, _loop_us, build_case, count_for
from overlap.tools.bench.comm_cases import CommCase as CommCase  # re-exported: importable from here as before
from overlap.tools.bench.comm_report import CommReport, CommRow, format_table
from overlap.tools.bench.comm_shm import ShmCase, _copy_floor_us, _shm_calls_us, open_segments
from overlap.tools.bench.comm_shm import shm_all_gather as shm_all_gather  # re-exported: benchmarks/shm_bandwidth.py
from overlap.tools.bench.comm_shm import shm_reduce_scatter as shm_reduce_scatter
from overlap.tools.bench.comm_shm import shm_stage as shm_stage
from overlap.tools.flags import JSON_FLAG, LINK_FLAG, command, flag
from overlap.tools.worlds.collectives import iters_for
from overlap.tools.worlds.launch import current_device
from overlap.tools.worlds.link import LinkSpec, active_link
from overlap.tools.worlds.runner import run_bench
from overlap.transport import shm as shm  # re-exported: `comm.shm`, the module whose host_identity tests patch
from overlap.transport.shm_segments import MAX_RANKS, MAX_RING_BYTES, ShmSegments

SHM_OPS: tuple[Op, ...] = ("all_gather", "reduce_scatter")
"""What the shared-memory transport carries (transport/shm.py); the rest is the backend's."""
DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64", "int8", "uint8")
_SUMMED_BY_SHM = ("float32", "float64", "float16", "bfloat16")  # csrc/reduce.cpp's sum_rows


def bus_factor(op: Op, world_size: int) -> float:
    """busbw / algbw for `op` on `world_size` ranks (nccl-tests' PERFORMANCE.md)."""
    n = world_size
    return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def algbw_gbps(num_bytes: int, time_us: float) -> float:
    """Bytes per second in GB/s (10^9), as nccl-tests prints it."""
    return num_bytes / time_us / 1e3


def busbw_gbps(op: Op, num_bytes: int, time_us: float, world_size: int) -> float:
    return algbw_gbps(num_bytes, time_us) * bus_factor(op, world_size)


def variants(op: Op, transport: Transport = "backend") -> tuple[bool, ...]:
    """The `inplace` values `op` is measured with; see [Note: comm bench timing] and [Note: comm
    bench over shared memory]."""
    if op == "all_reduce":
        return (True,)
    if op == "all_to_all" or transport == "shm":
        return (False,)
    return (False, True)


def sweep_sizes(min_bytes: int, max_bytes: int) -> list[int]:
    """min, 2 min, 4 min, ... up to max_bytes."""
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= 2
    return sizes


@dataclass(frozen=True, kw_only=True)
class CommBenchConfig:
    """One sweep. Defaults: the nccl-tests sweep, about a minute on 2 CPU cores."""

    ops: tuple[Op, ...] | None = field(
        default=None, metadata=flag(help=f"comma-separated, from {OPS} (default: every op the transport carries)")
    )
    """None: every op `transport` carries (`selected_ops`)."""
    min_bytes: int = 8
    max_bytes: int = 256 * 2**20
    dtype: str = field(default="float32", metadata=flag(choices=DTYPES))
    """A torch dtype name from DTYPES."""
    transport: Transport = "backend"
    """How the bytes move: "backend", the process group's collectives; "shm", the shared-memory
    ring of ranks on one host (all_gather and reduce_scatter, as `OverlapConfig.shared_memory`
    runs them), beside one memcpy of the same bytes (see [Note: comm bench over shared memory])."""
    iters: int = 20
    """Timed iterations per case, before `budget_bytes` scales them down."""
    warmup: int = 5
    budget_bytes: int = 256 * 2**20
    """A case moves about this many bytes per rank (at least 2 iterations): keeps the big sizes,
    and the default sweep, short on CPU."""
    nproc: int | None = None
    """Ranks of the spawned local world; None: `default_world()` (2 on CPU). Ignored under torchrun."""
    link: str | None = field(default=None, metadata=LINK_FLAG)
    """Emulated link for the local world, e.g. "1gbit" (see overlap.tools.worlds.link)."""
    json_path: str | None = field(default=None, metadata=JSON_FLAG)

    def __post_init__(self) -> None:
        bad = [op for op in self.ops or () if op not in OPS]
        if bad or self.ops == ():
            raise ValueError(f"CommBenchConfig.ops: unknown {bad}; choose from {OPS}")
        if self.transport not in get_args(Transport):
            raise ValueError(f"CommBenchConfig.transport: {self.transport!r} is not one of {get_args(Transport)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"CommBenchConfig.dtype: {self.dtype!r} is not one of {DTYPES}")
        if not 1 <= self.min_bytes <= self.max_bytes:
            raise ValueError("CommBenchConfig: need 1 <= min_bytes <= max_bytes")
        if self.iters < 1 or self.warmup < 0:
            raise ValueError("CommBenchConfig: need iters >= 1 and warmup >= 0")
        if self.link is not None:
            LinkSpec.parse(self.link)  # fail here, not in the ranks
        if self.transport == "shm":
            self._check_shm()

    def _check_shm(self) -> None:
        """What `transport="shm"` cannot measure, refused before any rank starts (the ranks check
        that they share a host: `open_segments`)."""
        where = "CommBenchConfig.transport='shm' (--transport shm)"
        off = [op for op in self.ops or () if op not in SHM_OPS]
        if off:
            raise ValueError(
                f"{where}: the shared-memory transport carries {' and '.join(SHM_OPS)} only, not {', '.join(off)}; "
                f"measure {', '.join(off)} with --transport backend, or pass --ops {','.join(SHM_OPS)}"
            )
        if "reduce_scatter" in self.selected_ops and self.dtype not in _SUMMED_BY_SHM:
            raise ValueError(
                f"{where}: its reduce_scatter sums {', '.join(_SUMMED_BY_SHM)} only, not {self.dtype}; "
                "pass --ops all_gather or a floating --dtype"
            )
        if self.link is not None:
            raise ValueError(
                f"{where}: ranks behind an emulated link (--link) each have a network namespace of their "
                "own and are not one host's shared-memory ranks (shm.usable refuses them); drop --link"
            )
        if self.nproc is not None and not 2 <= self.nproc <= MAX_RANKS:
            raise ValueError(f"{where}: needs 2 to {MAX_RANKS} ranks on one host, not --nproc {self.nproc}")
        if self.max_bytes > MAX_RING_BYTES // 2:
            raise ValueError(
                f"{where}: a collective moves at most {MAX_RING_BYTES // 2} bytes through the ring (half of "
                f"MAX_RING_BYTES; larger ones take the backend), not --max-bytes {self.max_bytes}"
            )
        if torch.cuda.is_available():
            raise ValueError(
                f"{where}: the ranks run on CUDA devices here (NCCL), and the shared-memory transport carries "
                "CPU tensors only; measure the GPUs with --transport backend"
            )

    @property
    def selected_ops(self) -> tuple[Op, ...]:
        """`ops`, or every op `transport` carries."""
        if self.ops is not None:
            return self.ops
        return SHM_OPS if self.transport == "shm" else OPS

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


def measure(
    op: Op,
    num_bytes: int,
    dtype: torch.dtype,
    inplace: bool,
    *,
    iters: int,
    warmup: int,
    device: torch.device,
    segments: ShmSegments | None = None,
) -> CommRow | None:
    """Check, then time one case on every rank of the default group (a collective call: all
    ranks, same arguments, same order); None when `num_bytes` holds less than one element per
    rank. See [Note: comm bench timing]. With `segments`: through shared memory, beside the copy
    floor ([Note: comm bench over shared memory])."""
    n = dist.get_world_size()
    assert segments is None or (op in SHM_OPS and not inplace), f"rank {dist.get_rank()}: {op} through shm"
    element_size = torch.empty((), dtype=dtype).element_size()
    count = count_for(op, num_bytes, element_size, n)
    if count == 0:
        return None
    case = build_case(op, count, inplace, dtype, device)
    size = count * element_size
    if segments is None:
        wrong = 0.0 if _is_correct(case, device) else 1.0
        case.inp.zero_()
        sums = [_loop_us(case.launch, iters, warmup, device), wrong]
    else:
        via = ShmCase(case, segments)
        wrong = 0.0 if _is_correct(case, device, via.call) else 1.0
        case.inp.zero_()
        sums = [_shm_calls_us(via, iters, warmup), wrong, _copy_floor_us(segments, size, iters, warmup)]
    # once per case, after its timed loop (outside any clock; never in a training step): the ranks'
    # times summed and read back to the host once per case (.item(): a device sync, outside the loop)
    totals = torch.tensor(sums, dtype=torch.float64, device=device)
    dist.all_reduce(totals)
    time_us = totals[0].item() / n
    copy_time_us = totals[2].item() / n if segments is not None else None
    return CommRow(
        op=op,
        bytes=size,
        count=count,
        dtype=str(dtype).removeprefix("torch."),
        inplace=inplace,
        time_us=time_us,
        algbw_gbps=algbw_gbps(size, time_us),
        busbw_gbps=busbw_gbps(op, size, time_us, n),
        num_wrong=int(totals[1].item()),
        copy_time_us=copy_time_us,
        copy_gbps=None if copy_time_us is None else algbw_gbps(size, copy_time_us),
        copy_pct=None if copy_time_us is None else 100 * copy_time_us / time_us,
    )


def comm_rank(rank: int, world_size: int, cfg: CommBenchConfig) -> CommReport | None:
    """The sweep on one rank (all ranks call it); rank 0 prints the tables and returns the
    report, the others return None."""
    device = current_device()
    sizes = sweep_sizes(cfg.min_bytes, cfg.max_bytes)
    plan = [(op, size, inplace) for op in cfg.selected_ops for size in sizes for inplace in variants(op, cfg.transport)]
    segments = open_segments(sizes[-1], device) if cfg.transport == "shm" else None
    report = CommReport(
        backend=dist.get_backend(), world_size=world_size, link=active_link(), rows=[], transport=cfg.transport
    )
    bar = tqdm(plan, desc="bench comm", disable=rank != 0, dynamic_ncols=True, leave=False)
    for i, (op, size, inplace) in enumerate(bar):
        bar.set_postfix_str(f"{op} {size} B")
        iters, warmup = iters_for(size, cfg.iters, cfg.warmup, cfg.budget_bytes)
        row = measure(op, size, cfg.torch_dtype, inplace, iters=iters, warmup=warmup, device=device, segments=segments)
        if row is not None:
            report.rows.append(row)
        if rank == 0 and (i + 1 == len(plan) or plan[i + 1][0] != op):
            tqdm.write(format_table(report, op) + "\n")
    bar.close()
    if rank != 0:
        return None
    print(f"# Avg bus bandwidth (all ops) : {report.avg_busbw_gbps():.4f} GB/s", flush=True)
    return report


def bench_comm(cfg: CommBenchConfig) -> CommReport | None:
    """Run the sweep in torchrun's world, over an emulated link, or in a spawned local world;
    the report on the process holding rank 0 (None elsewhere). Writes `cfg.json_path` there."""
    return run_bench(comm_rank, cfg)


add_arguments, run = command(
    CommBenchConfig,
    bench_comm,
    "overlap bench comm",
    exit_code=lambda report: int(report is not None and any(r.num_wrong for r in report.rows)),
)
