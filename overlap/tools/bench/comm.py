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
"""

from __future__ import annotations

import mmap
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Literal, NamedTuple, get_args

import torch
import torch.distributed as dist
from tqdm import tqdm

from overlap.kernels import cpu
from overlap.tools.flags import JSON_FLAG, LINK_FLAG, command, flag
from overlap.tools.worlds.collectives import all_gather_single, iters_for, reduce_scatter_single
from overlap.tools.worlds.launch import DEFAULT_TIMEOUT_S, current_device
from overlap.tools.worlds.link import LinkSpec, active_link
from overlap.tools.worlds.runner import run_bench
from overlap.transport import collectives as comm
from overlap.transport import shm
from overlap.transport.host import keep_freed_cpu_memory
from overlap.transport.shm_segments import MAX_RANKS, MAX_RING_BYTES, ShmSegments

Op = Literal["all_gather", "reduce_scatter", "all_reduce", "all_to_all"]
OPS: tuple[Op, ...] = get_args(Op)
Transport = Literal["backend", "shm"]
SHM_OPS: tuple[Op, ...] = ("all_gather", "reduce_scatter")
"""What the shared-memory transport carries (transport/shm.py); the rest is the backend's."""
DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64", "int8", "uint8")
_SUMMED_BY_SHM = ("float32", "float64", "float16", "bfloat16")  # csrc/reduce.cpp's sum_rows
_CHUNKED: frozenset[Op] = frozenset({"all_gather", "reduce_scatter", "all_to_all"})


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


def count_for(op: Op, num_bytes: int, element_size: int, world_size: int) -> int:
    """Elements per buffer: a multiple of the world size for chunked ops (0: too small)."""
    count = num_bytes // element_size
    return count - count % world_size if op in _CHUNKED else count


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


@dataclass(frozen=True, kw_only=True)
class CommRow:
    """One measured case, averaged over ranks."""

    op: Op
    bytes: int
    count: int
    dtype: str
    inplace: bool
    time_us: float
    algbw_gbps: float
    busbw_gbps: float
    num_wrong: int
    """Ranks whose output differed from the expected values."""
    copy_time_us: float | None = None
    """transport "shm": one memcpy of `bytes` between two private buffers, every rank at once,
    timed beside the case (the floor); None for the backend's rows."""
    copy_gbps: float | None = None
    """`bytes` / `copy_time_us`, in GB/s (None for the backend's rows)."""
    copy_pct: float | None = None
    """`algbw_gbps` as a percentage of `copy_gbps` (None for the backend's rows)."""


@dataclass(frozen=True, kw_only=True)
class CommReport:
    backend: str
    world_size: int
    link: str | None
    rows: list[CommRow]
    transport: Transport = "backend"

    def avg_busbw_gbps(self, op: Op | None = None) -> float:
        """Mean busbw over the rows (of `op`), as nccl-tests' closing line."""
        values = [r.busbw_gbps for r in self.rows if op is None or r.op == op]
        return statistics.fmean(values) if values else float("nan")

    def to_json(self) -> dict[str, object]:
        return {
            "backend": self.backend,
            "world_size": self.world_size,
            "link": self.link,
            "transport": self.transport,
            "rows": [asdict(r) for r in self.rows],
            "avg_busbw_gbps": self.avg_busbw_gbps(),
        }


# ---------------------------------------------------------------------------------------------
# one case


@dataclass(frozen=True)
class CommCase:
    """The buffers of one collective; `inp` aliases `out` for the in-place variants."""

    op: Op
    inp: torch.Tensor
    out: torch.Tensor

    def launch(self, async_op: bool = False) -> dist.Work | None:
        match self.op:
            case "all_gather":
                return all_gather_single(self.out, self.inp, async_op=async_op)
            case "reduce_scatter":
                return reduce_scatter_single(self.out, self.inp, async_op=async_op)
            case "all_reduce":
                return dist.all_reduce(self.out, async_op=async_op)
            case "all_to_all":
                return dist.all_to_all_single(self.out, self.inp, async_op=async_op)
        raise AssertionError(f"rank {dist.get_rank()}: unknown op {self.op}")


def _blocks(values: list[int], block_numel: int, like: torch.Tensor) -> torch.Tensor:
    """`values[j]` repeated `block_numel` times, block after block."""
    small = torch.tensor(values, dtype=like.dtype, device=like.device)
    return small.repeat_interleave(block_numel)


def build_case(op: Op, count: int, inplace: bool, dtype: torch.dtype, device: torch.device) -> CommCase:
    n, r = dist.get_world_size(), dist.get_rank()
    chunk = count // n if op in _CHUNKED else count
    big = torch.zeros(count, dtype=dtype, device=device)
    if op == "all_reduce":
        return CommCase(op, big, big)
    small = big.narrow(0, r * chunk, chunk) if inplace else torch.zeros(chunk, dtype=dtype, device=device)
    if op == "all_gather":
        return CommCase(op, small, big)
    if op == "reduce_scatter":
        return CommCase(op, big, small)
    return CommCase(op, big, torch.zeros_like(big))  # all_to_all


def _fill_and_expect(case: CommCase) -> torch.Tensor:
    """Write this rank's known values into the input; return the output the collective must
    produce (small integers, exact in every dtype for a few ranks)."""
    n, r = dist.get_world_size(), dist.get_rank()
    chunk = case.out.numel() // n if case.op != "reduce_scatter" else case.out.numel()
    match case.op:
        case "all_gather":
            case.inp.fill_(r + 1)
            return _blocks([j + 1 for j in range(n)], chunk, case.out)
        case "reduce_scatter":
            case.inp.copy_(_blocks([(r + 1) * (j + 1) for j in range(n)], chunk, case.inp))
            return torch.full_like(case.out, (r + 1) * n * (n + 1) // 2)
        case "all_reduce":
            case.inp.fill_(r + 1)
            return torch.full_like(case.out, n * (n + 1) // 2)
        case "all_to_all":
            case.inp.copy_(_blocks([r * n + j + 1 for j in range(n)], chunk, case.inp))
            return _blocks([j * n + r + 1 for j in range(n)], chunk, case.out)
    raise AssertionError(f"rank {r}: unknown op {case.op}")


def _is_correct(case: CommCase, device: torch.device, launch: Callable[[], torch.Tensor] | None = None) -> bool:
    """Fill `case`, run it once (`launch`, which returns the output, or `case.launch`) and
    compare the output with what it must be."""
    expected = _fill_and_expect(case)
    if launch is None:
        case.launch()
        out = case.out
    else:
        out = launch()
    _sync(device)
    if out.dtype in (torch.float16, torch.bfloat16):  # partial sums may round
        return torch.allclose(out, expected, rtol=1e-2, atol=0.0)
    return torch.equal(out, expected)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _loop_us(call: Callable[[], object], iters: int, warmup: int, device: torch.device) -> float:
    """Microseconds per `call` in a loop of `iters` after `warmup` calls and a barrier."""
    for _ in range(warmup):
        call()
    _sync(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    _sync(device)
    return (time.perf_counter() - start) / iters * 1e6


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


# ---------------------------------------------------------------------------------------------
# through shared memory


def shm_all_gather(segments: ShmSegments, send: torch.Tensor, spare: torch.Tensor) -> torch.Tensor:
    """One all-gather of `send` as `ShmAllGather` runs it: into an output allocated in this
    rank's ring (`ShmSegments.output`, [Note: all-gather output in the ring] in transport/shm.py),
    or into `spare` (private, `spare.numel()` elements) where the ring has no room now. Returns
    the output after the wait; drop it then, as the runtime does (the ring reuses those bytes
    once it is freed)."""
    out = segments.output(spare.numel(), spare.dtype)
    return comm.wait(segments.all_gather(send, spare if out is None else out))


def shm_stage(segments: ShmSegments, full: torch.Tensor) -> torch.Tensor:
    """A reduce-scatter's copy-in: the rank-major `full` written into the room reserved for this
    rank's next post (`ShmReduceScatter.allocate` puts the engine's input there)."""
    room = segments.reserve(full.numel() * full.element_size()).view(full.dtype).view(full.shape)
    room.copy_(full)
    return room


def shm_reduce_scatter(segments: ShmSegments, room: torch.Tensor) -> torch.Tensor:
    """One reduce-scatter of `room` (`shm_stage`'s): posted, then the wait sums this rank's row
    of every rank's ring in rank order; returns the sum (`CommResult.finish`)."""
    return comm.wait(segments.reduce_scatter(room.view(-1), None))


class ShmCase(NamedTuple):
    """`case`'s collective through `segments` ([Note: comm bench over shared memory]): it sends
    `case.inp`; an all-gather's `case.out` is its output where the ring has no room."""

    case: CommCase
    segments: ShmSegments

    def stage(self) -> torch.Tensor:
        """What a call takes, made before its clock starts: a reduce-scatter's copy-in."""
        if self.case.op == "reduce_scatter":
            return shm_stage(self.segments, self.case.inp)
        return self.case.inp

    def launch(self, staged: torch.Tensor) -> torch.Tensor:
        """Issue and wait; the output."""
        if self.case.op == "all_gather":
            return shm_all_gather(self.segments, staged, self.case.out)
        return shm_reduce_scatter(self.segments, staged)

    def call(self) -> torch.Tensor:
        return self.launch(self.stage())


def _shm_calls_us(via: ShmCase, iters: int, warmup: int) -> float:
    """Microseconds per call, each clocked from its issue to the end of its wait, the output
    dropped inside the clock and the copy-in outside it."""
    for _ in range(warmup):
        via.call()
    dist.barrier()
    spent = 0.0
    for _ in range(iters):
        staged = via.stage()
        start = time.perf_counter()
        via.launch(staged)
        spent += time.perf_counter() - start
    return spent / iters * 1e6


def _copy_floor_us(segments: ShmSegments, num_bytes: int, iters: int, warmup: int) -> float:
    """Microseconds per memcpy of `num_bytes` between two private buffers kept across calls
    (csrc/shm.cpp's, `ShmSegments.copy`), every rank at once: the floor of a shared-memory case."""
    src, dst = torch.ones(num_bytes, dtype=torch.uint8), torch.zeros(num_bytes, dtype=torch.uint8)
    return _loop_us(lambda: segments.copy(dst, src), iters, max(warmup, 1), torch.device("cpu"))


def open_segments(max_bytes: int, device: torch.device) -> ShmSegments:
    """The default group's segments, with a ring for collectives of up to `max_bytes` (collective
    over the group); ValueError on every rank where the ranks cannot share memory."""
    group = dist.group.WORLD
    assert group is not None, "open_segments: no default process group"
    if not shm.usable(group, device, "auto"):  # collective: every rank gets the same answer
        n = dist.get_world_size(group)
        why = (
            f"the ranks use {device.type} tensors, and it carries CPU tensors only"
            if device.type != "cpu"
            else f"it needs 2 to {MAX_RANKS} ranks, not {n}"
            if not 1 < n <= MAX_RANKS
            else "it needs the compiled kernels (csrc/shm.cpp), which did not build here"
            if cpu.load_extension() is None
            else "the ranks are not all on this host (hostname, boot id, /dev/shm and network namespace must match)"
        )
        raise ValueError(f"overlap bench comm --transport shm: shared memory is not usable: {why}")
    keep_freed_cpu_memory()  # as `wrap` sets it: a reduce-scatter's sum reuses freed blocks
    ring_bytes = shm.ring_bytes_for_collective(max_bytes)  # as the engine sizes it for such a unit
    segments = ShmSegments(group, ring_bytes, timedelta(seconds=DEFAULT_TIMEOUT_S))
    _map_every_page(segments)
    return segments


def _map_every_page(segments: ShmSegments) -> None:
    """Fault in every page of every rank's ring on this rank before the sweep, outside any
    clock: in training the ring's pages are mapped after the first steps, where a case's first
    calls would otherwise land on fresh pages (at 64 MiB a few calls a case, the default budget's,
    spend more in page faults than in copies). This rank writes its own ring and reads a byte of
    every page of its peers'."""
    page = mmap.PAGESIZE
    for rank, ring in enumerate(segments.rings):
        if rank == segments.rank:
            ring.zero_()
        else:
            ring[::page].sum()
    dist.barrier()


# ---------------------------------------------------------------------------------------------
# sweep, table, entry points


_COLLECTIVE_HEAD = (
    f"{'time':>10}{'algbw':>8}{'busbw':>8}{'#wrong':>7}",
    f"{'(us)':>10}{'(GB/s)':>8}{'(GB/s)':>8}{'':>7}",
)
_COPY_HEAD = (f"{'time':>10}{'copy':>8}{'% copy':>8}", f"{'(us)':>10}{'(GB/s)':>8}{'':>8}")


def format_table(report: CommReport, op: Op) -> str:
    """`op`'s rows as nccl-tests prints them: out-of-place and in-place side by side; through
    shared memory, the collective and its memcpy floor side by side."""
    redop = "sum" if op in ("reduce_scatter", "all_reduce") else "none"
    link = f", link {report.link}" if report.link else ""
    if report.transport == "shm":
        title, groups, right = (
            f"{report.backend}, shared memory",
            f"{'shared memory':>30}{'memcpy floor':>28}",
            _COPY_HEAD,
        )
        cells = _shm_cells
    else:
        title, groups, right = report.backend, f"{'out-of-place':>30}{'in-place':>35}", _COLLECTIVE_HEAD
        cells = _backend_cells
    lines = [
        f"# {op}: {report.world_size} ranks, {title}{link}",
        f"#{'':>40}{groups}",
        f"#{'size':>11}{'count':>13}{'type':>9}{'redop':>7}" + _COLLECTIVE_HEAD[0] + right[0],
        f"#{'(B)':>11}{'(elements)':>13}{'':>16}" + _COLLECTIVE_HEAD[1] + right[1],
    ]
    by_size: dict[int, dict[bool, CommRow]] = {}
    for row in report.rows:
        if row.op == op:
            by_size.setdefault(row.bytes, {})[row.inplace] = row
    for size, pair in by_size.items():
        first = next(iter(pair.values()))
        lines.append(f"{size:>12}{first.count:>13}{first.dtype:>9}{redop:>7}{cells(pair)}")
    num_wrong = sum(r.num_wrong for r in report.rows if r.op == op)
    lines.append(f"# Out of bounds values : {num_wrong} {'OK' if num_wrong == 0 else 'FAILED'}")
    lines.append(f"# Avg bus bandwidth    : {report.avg_busbw_gbps(op):.4f} GB/s")
    return "\n".join(lines)


def _collective_cells(r: CommRow) -> str:
    return f"{r.time_us:>10.1f}{r.algbw_gbps:>8.3f}{r.busbw_gbps:>8.3f}{r.num_wrong:>7}"


def _backend_cells(pair: dict[bool, CommRow]) -> str:
    """Out-of-place, then in-place (n/a where `variants` leaves it out)."""
    return "".join(
        f"{'n/a':>10}{'':>8}{'':>8}{'':>7}" if inplace not in pair else _collective_cells(pair[inplace])
        for inplace in (False, True)
    )


def _shm_cells(pair: dict[bool, CommRow]) -> str:
    """The collective, then its memcpy floor and the collective's share of it."""
    r = pair[False]
    return _collective_cells(r) + f"{r.copy_time_us:>10.1f}{r.copy_gbps:>8.3f}{r.copy_pct:>7.0f}%"


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
