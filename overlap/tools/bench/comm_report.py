"""The results of `overlap bench comm`: one row per measured case, the report with its JSON, and
the tables printed as nccl-tests prints them."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

from overlap.tools.bench.comm_cases import Op, Transport


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
