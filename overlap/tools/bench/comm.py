"""`overlap bench comm`: collective bandwidth over torch.distributed, printed as nccl-tests does.

    overlap bench comm                                   # 2 local gloo ranks, 8 B .. 256 MiB
    overlap bench comm --ops all_gather --dtype bfloat16 --json out/comm.json
    overlap bench comm --link 1gbit                      # ranks behind an emulated 1 Gbit/s link
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
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Literal, get_args

import torch
import torch.distributed as dist
from tqdm import tqdm

from overlap.tools.flags import JSON_FLAG, LINK_FLAG, command, flag
from overlap.tools.worlds.collectives import all_gather_single, iters_for, reduce_scatter_single
from overlap.tools.worlds.launch import current_device
from overlap.tools.worlds.link import LinkSpec, active_link
from overlap.tools.worlds.runner import run_bench

Op = Literal["all_gather", "reduce_scatter", "all_reduce", "all_to_all"]
OPS: tuple[Op, ...] = get_args(Op)
DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64", "int8", "uint8")
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


def variants(op: Op) -> tuple[bool, ...]:
    """The `inplace` values `op` is measured with; see [Note: comm bench timing]."""
    if op == "all_reduce":
        return (True,)
    if op == "all_to_all":
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

    ops: tuple[Op, ...] = field(default=OPS, metadata=flag(help=f"comma-separated, from {OPS}"))
    min_bytes: int = 8
    max_bytes: int = 256 * 2**20
    dtype: str = field(default="float32", metadata=flag(choices=DTYPES))
    """A torch dtype name from DTYPES."""
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
        bad = [op for op in self.ops if op not in OPS]
        if bad or not self.ops:
            raise ValueError(f"CommBenchConfig.ops: unknown {bad}; choose from {OPS}")
        if self.dtype not in DTYPES:
            raise ValueError(f"CommBenchConfig.dtype: {self.dtype!r} is not one of {DTYPES}")
        if not 1 <= self.min_bytes <= self.max_bytes:
            raise ValueError("CommBenchConfig: need 1 <= min_bytes <= max_bytes")
        if self.iters < 1 or self.warmup < 0:
            raise ValueError("CommBenchConfig: need iters >= 1 and warmup >= 0")
        if self.link is not None:
            LinkSpec.parse(self.link)  # fail here, not in the ranks

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


@dataclass(frozen=True, kw_only=True)
class CommReport:
    backend: str
    world_size: int
    link: str | None
    rows: list[CommRow]

    def avg_busbw_gbps(self, op: Op | None = None) -> float:
        """Mean busbw over the rows (of `op`), as nccl-tests' closing line."""
        values = [r.busbw_gbps for r in self.rows if op is None or r.op == op]
        return statistics.fmean(values) if values else float("nan")

    def to_json(self) -> dict[str, object]:
        return {
            "backend": self.backend,
            "world_size": self.world_size,
            "link": self.link,
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


def _is_correct(case: CommCase, device: torch.device) -> bool:
    expected = _fill_and_expect(case)
    case.launch()
    _sync(device)
    if case.out.dtype in (torch.float16, torch.bfloat16):  # partial sums may round
        return torch.allclose(case.out, expected, rtol=1e-2, atol=0.0)
    return torch.equal(case.out, expected)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    op: Op, num_bytes: int, dtype: torch.dtype, inplace: bool, *, iters: int, warmup: int, device: torch.device
) -> CommRow | None:
    """Check, then time one case on every rank of the default group (a collective call: all
    ranks, same arguments, same order); None when `num_bytes` holds less than one element per
    rank. See [Note: comm bench timing]."""
    n = dist.get_world_size()
    element_size = torch.empty((), dtype=dtype).element_size()
    count = count_for(op, num_bytes, element_size, n)
    if count == 0:
        return None
    case = build_case(op, count, inplace, dtype, device)
    wrong = 0.0 if _is_correct(case, device) else 1.0
    case.inp.zero_()
    for _ in range(warmup):
        case.launch()
    _sync(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        case.launch()
    _sync(device)
    time_us = (time.perf_counter() - start) / iters * 1e6
    totals = torch.tensor([time_us, wrong], dtype=torch.float64, device=device)
    dist.all_reduce(totals)
    time_us = totals[0].item() / n
    size = count * element_size
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
    )


# ---------------------------------------------------------------------------------------------
# sweep, table, entry points


def format_table(report: CommReport, op: Op) -> str:
    """`op`'s rows as nccl-tests prints them: out-of-place and in-place side by side."""
    redop = "sum" if op in ("reduce_scatter", "all_reduce") else "none"
    link = f", link {report.link}" if report.link else ""
    lines = [
        f"# {op}: {report.world_size} ranks, {report.backend}{link}",
        f"#{'':>40}{'out-of-place':>30}{'in-place':>35}",
        f"#{'size':>11}{'count':>13}{'type':>9}{'redop':>7}" + f"{'time':>10}{'algbw':>8}{'busbw':>8}{'#wrong':>7}" * 2,
        f"#{'(B)':>11}{'(elements)':>13}{'':>16}" + f"{'(us)':>10}{'(GB/s)':>8}{'(GB/s)':>8}{'':>7}" * 2,
    ]
    by_size: dict[int, dict[bool, CommRow]] = {}
    for row in report.rows:
        if row.op == op:
            by_size.setdefault(row.bytes, {})[row.inplace] = row
    for size, pair in by_size.items():
        first = next(iter(pair.values()))
        cells = ""
        for inplace in (False, True):
            r = pair.get(inplace)
            cells += (
                f"{'n/a':>10}{'':>8}{'':>8}{'':>7}"
                if r is None
                else f"{r.time_us:>10.1f}{r.algbw_gbps:>8.3f}{r.busbw_gbps:>8.3f}{r.num_wrong:>7}"
            )
        lines.append(f"{size:>12}{first.count:>13}{first.dtype:>9}{redop:>7}{cells}")
    num_wrong = sum(r.num_wrong for r in report.rows if r.op == op)
    lines.append(f"# Out of bounds values : {num_wrong} {'OK' if num_wrong == 0 else 'FAILED'}")
    lines.append(f"# Avg bus bandwidth    : {report.avg_busbw_gbps(op):.4f} GB/s")
    return "\n".join(lines)


def comm_rank(rank: int, world_size: int, cfg: CommBenchConfig) -> CommReport | None:
    """The sweep on one rank (all ranks call it); rank 0 prints the tables and returns the
    report, the others return None."""
    device = current_device()
    plan = [
        (op, size, inplace)
        for op in cfg.ops
        for size in sweep_sizes(cfg.min_bytes, cfg.max_bytes)
        for inplace in variants(op)
    ]
    report = CommReport(backend=dist.get_backend(), world_size=world_size, link=active_link(), rows=[])
    bar = tqdm(plan, desc="bench comm", disable=rank != 0, dynamic_ncols=True, leave=False)
    for i, (op, size, inplace) in enumerate(bar):
        bar.set_postfix_str(f"{op} {size} B")
        iters, warmup = iters_for(size, cfg.iters, cfg.warmup, cfg.budget_bytes)
        row = measure(op, size, cfg.torch_dtype, inplace, iters=iters, warmup=warmup, device=device)
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
