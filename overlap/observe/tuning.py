"""What `autotune` did, for `overlap report`: its decisions as text, and a picture of the knobs and
the step (with its exposed communication) per training step. Reads the `autotune.json` that
engine/autotune.py writes into `autotune_dir` (or `trace_dir`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FILE = "autotune.json"
KNOBS = (
    "prefetch_depth",
    "reduce_scatter_bucket_bytes",
    "keep_for_backward_bytes",
    "max_reduce_inputs",
    "max_inflight_allgather_bytes",
)


def find(paths: list[Path]) -> list[Path]:
    """The autotune.json files among `paths` (folders, or the files themselves)."""
    found = []
    for path in paths:
        candidate = path / FILE if path.is_dir() else path
        if candidate.name == FILE and candidate.exists():
            found.append(candidate)
    return found


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def format_decisions(data: dict[str, Any]) -> str:
    lines = [f"autotune: {'settled' if data['settled'] else 'still searching'}; knobs now {data['knobs']}"]
    for d in data["decisions"]:
        lines.append(f"  step {d['step']:>5}  {d['action']:<8} {d['reason']}")
    return "\n".join(lines)


def plot(data: dict[str, Any], path: Path) -> Path:
    """Top: step time and exposed all-gather / reduce-scatter waits per training step, with the
    decisions marked (kept: green, reverted: grey). Below: each knob that moved, per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    history = data["history"]
    steps = [h["step"] for h in history]
    moved = [k for k in KNOBS if len({h[k] for h in history}) > 1] or ["prefetch_depth"]
    fig, axes = plt.subplots(
        1 + len(moved),
        1,
        figsize=(11, 3 + 1.3 * len(moved)),
        sharex=True,
        gridspec_kw={"height_ratios": [3] + [1] * len(moved)},
    )
    top = axes[0]
    top.plot(steps, [h["step_ms"] for h in history], color="#4C72B0", label="step")
    top.plot(steps, [h["gather_wait_ms"] for h in history], color="#55A868", label="exposed all-gather")
    top.plot(steps, [h["reduce_wait_ms"] for h in history], color="#C44E52", label="exposed reduce-scatter")
    colors = {"keep": "#2CA02C", "revert": "#999999", "settle": "#000000", "retune": "#FF7F0E"}
    for d in data["decisions"]:
        if d["action"] in colors:
            top.axvline(d["step"], color=colors[d["action"]], linewidth=0.8, alpha=0.7)
    later = sorted(h["step_ms"] for h in history[3:]) or [1.0]
    top.set_ylim(0, 1.5 * later[int(0.95 * (len(later) - 1))])  # the first steps (allocations, checks) off the scale
    top.set_ylabel("ms (this rank)")
    top.set_title(
        "autotune: step and exposed communication; decisions kept (green), reverted (grey), settled (black)", fontsize=9
    )
    top.legend(fontsize=8, loc="upper right")
    top.grid(alpha=0.3)
    for ax, knob in zip(axes[1:], moved):
        values = [h[knob] if h[knob] is not None else float("nan") for h in history]
        scale, unit = (2**20, " MiB") if knob.endswith("bytes") else (1, "")
        ax.step(steps, [v / scale for v in values], where="post", color="#8172B2")
        ax.set_ylabel(f"{knob}{unit}", fontsize=8)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("training step")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
