"""`overlap report TRACE...`: what a trace says about overlap, as text and as a PNG timeline.

Input: the `trace_rank{r}.json` files that `OverlapConfig.trace_dir` / `OVERLAP_TRACE` write
(a folder or files). For the chosen step (default: the last complete training step) and each
rank it reports

    comm busy     length of the union of all-gather and reduce-scatter spans (issued -> done)
    exposed       length of the union of "wait" spans: the training thread blocked on comm
    hidden        comm busy - exposed, clamped at 0
    efficiency    hidden / comm busy: the share of communication that overlapped compute

and the exposed wait per unit, largest first. Unions, not sums: gloo runs two collectives at
once, and a wait counts once however many collectives it covers.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from overlap.observe import tuning
from overlap.observe.trace import LANES

COMPUTE, GATHER, REDUCE, WAIT = (LANES.index(n) for n in ("compute", "all-gather", "reduce-scatter", "wait"))


def union_ms(spans: list[tuple[float, float]]) -> float:
    """Total length (ms) of the union of [start, end) spans given in µs."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total / 1e3


@dataclass
class RankSummary:
    rank: int
    step: int
    step_ms: float
    compute_ms: float
    comm_busy_ms: float
    exposed_ms: float
    waits_ms: dict[str, float] = field(default_factory=dict)

    @property
    def hidden_ms(self) -> float:
        return max(self.comm_busy_ms - self.exposed_ms, 0.0)

    @property
    def efficiency(self) -> float:
        return self.hidden_ms / self.comm_busy_ms if self.comm_busy_ms > 0 else 1.0


def load_events(paths: list[Path]) -> list[dict[str, Any]]:
    files: list[Path] = []
    for path in paths:
        files += sorted(path.glob("trace_rank*.json")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"no trace files (trace_rank*.json) in {[str(p) for p in paths]}")
    events: list[dict[str, Any]] = []
    for f in files:
        events += [e for e in json.loads(f.read_text())["traceEvents"] if e.get("ph") == "X"]
    return events


def training_steps(events: list[dict[str, Any]]) -> list[int]:
    """Steps that ran a backward (eval-only forwards are steps too, but not what we report):
    a unit's backward span, or a reduce-scatter (a model whose only unit is the root has no
    per-unit backward span)."""
    return sorted(
        {
            e["args"].get("issued_step", e["args"]["step"])
            for e in events
            if e["name"].startswith("backward ") or e["tid"] == REDUCE
        }
    )


def summarize(events: list[dict[str, Any]], step: int | None = None) -> list[RankSummary]:
    steps = training_steps(events)
    if not steps:
        raise ValueError("the trace holds no training step (no backward, no reduce-scatter)")
    if step is None:
        step = steps[-2] if len(steps) > 1 else steps[-1]  # the last may still be writing
    out = []
    for rank in sorted({e["pid"] for e in events}):
        mine = [e for e in events if e["pid"] == rank and e["args"].get("step") == step]
        # a collective is stamped at completion, in the step it completes in; take the ones
        # issued in this step
        comm = [
            e
            for e in events
            if e["pid"] == rank
            and e["tid"] in (GATHER, REDUCE)
            and e["args"].get("issued_step", e["args"].get("step")) == step
        ]
        if not mine:
            continue
        start = min(e["ts"] for e in mine)
        end = max(e["ts"] + e["dur"] for e in mine + comm)
        spans = lambda es: [(e["ts"], e["ts"] + e["dur"]) for e in es]  # noqa: E731
        waits: dict[str, float] = {}
        for e in mine:
            if e["tid"] == WAIT:
                waits[e["name"]] = waits.get(e["name"], 0.0) + e["dur"] / 1e3
        out.append(
            RankSummary(
                rank=rank,
                step=step,
                step_ms=(end - start) / 1e3,
                compute_ms=union_ms(spans([e for e in mine if e["tid"] == COMPUTE])),
                comm_busy_ms=union_ms(spans(comm)),
                exposed_ms=union_ms(spans([e for e in mine if e["tid"] == WAIT])),
                waits_ms=waits,
            )
        )
    return out


def format_summary(summaries: list[RankSummary], top: int = 6) -> str:
    lines = [f"step {summaries[0].step}: rank  span ms  compute ms  comm busy ms  exposed ms  hidden ms  efficiency"]
    for s in summaries:
        lines.append(
            f"{'':>8}{s.rank:>5} {s.step_ms:>8.1f} {s.compute_ms:>11.1f} {s.comm_busy_ms:>13.1f} "
            f"{s.exposed_ms:>11.1f} {s.hidden_ms:>10.1f} {s.efficiency:>10.1%}"
        )
    for s in summaries:
        worst = sorted(s.waits_ms.items(), key=lambda kv: -kv[1])[:top]
        if worst:
            lines.append(f"rank {s.rank} largest exposed waits:")
            lines += [f"    {ms:8.2f} ms  {name}" for name, ms in worst]
    return "\n".join(lines)


def plot_timeline(events: list[dict[str, Any]], step: int, path: Path) -> Path:
    """A PNG with one row per (rank, lane) for `step`: compute, all-gather, reduce-scatter, wait."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = sorted({e["pid"] for e in events})
    chosen = [e for e in events if e["args"].get("issued_step", e["args"].get("step")) == step]
    t0 = min(e["ts"] for e in chosen)
    colors = {"forward": "#4C72B0", "backward": "#DD8452", GATHER: "#55A868", REDUCE: "#C44E52", WAIT: "#222222"}
    fig, ax = plt.subplots(figsize=(13, 1.0 + 1.1 * len(ranks) * len(LANES) / 2))
    yticks, ylabels = [], []
    for r_i, rank in enumerate(ranks):
        for lane_i, lane in enumerate(LANES):
            y = (r_i * len(LANES) + lane_i) * 1.2
            yticks.append(y + 0.5)
            ylabels.append(f"rank {rank} {lane}")
            for e in chosen:
                if e["pid"] != rank or e["tid"] != lane_i:
                    continue
                kind = e["name"].split(" ")[0] if lane_i == COMPUTE else lane_i
                start = (e["ts"] - t0) / 1e3
                ax.broken_barh(
                    [(start, max(e["dur"] / 1e3, 0.05))],
                    (y, 1.0),
                    facecolors=colors.get(kind, "#8172B2"),
                    edgecolor="white",
                    linewidth=0.3,
                )
    ax.set_yticks(yticks, ylabels)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step began")
    ax.set_title(
        f"overlap timeline, step {step}: forward (blue) / backward (orange) compute, "
        "all-gather (green), reduce-scatter (red), exposed waits (black)",
        fontsize=9,
    )
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "traces",
        nargs="+",
        type=Path,
        help="trace folder(s) or trace_rank*.json files; a folder's autotune.json (OverlapConfig.autotune) is reported too",
    )
    parser.add_argument("--step", type=int, default=None, help="step to report (default: the last complete one)")
    parser.add_argument(
        "--png",
        type=Path,
        default=None,
        help="write the timeline PNG here (and the tuning picture beside it, *_autotune.png)",
    )


def run(args: argparse.Namespace) -> int:
    tunings = tuning.find(args.traces)
    has_traces = any(
        (p.is_file() and p.name != tuning.FILE) or (p.is_dir() and any(p.glob("trace_rank*.json"))) for p in args.traces
    )
    try:
        if has_traces or not tunings:
            events = load_events(args.traces)
            summaries = summarize(events, args.step)
            print(format_summary(summaries))
            if args.png is not None:
                print(f"wrote {plot_timeline(events, summaries[0].step, args.png)}")
        for i, found in enumerate(tunings):
            data = tuning.load(found)
            print(tuning.format_decisions(data))
            if args.png is not None:
                suffix = "_autotune" if len(tunings) == 1 else f"_autotune{i}"
                print(f"wrote {tuning.plot(data, args.png.with_name(args.png.stem + suffix + '.png'))}")
    except ImportError:
        print("no PNG: matplotlib is not installed (pip install -e '.[plot]')")
        return 1
    return 0
