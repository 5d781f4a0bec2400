"""Convergence with compressed gradients: the package's GPT on the stdlib text, 2 ranks.

    python benchmarks/convergence.py --steps 300 --png docs/convergence.png --json out.json

Runs `overlap demo` (same seed, data and model) uncompressed and with each codec setting, and
reports the final training loss (mean of the last 10 steps) and validation loss of each, relative
to the uncompressed run. This is a numerics measurement, not a speed one: runs are sequential.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from overlap.demo import DemoConfig, demo  # noqa: E402

SETTINGS = {
    "fp32 (uncompressed)": {},
    "int8 grads + error feedback": {"grad_compression": "int8", "error_feedback": True},
    "int4 grads + error feedback": {"grad_compression": "int4", "error_feedback": True},
    "int4 grads, no feedback": {"grad_compression": "int4"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--png", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    base = DemoConfig(steps=args.steps, log_every=10**9)
    results = {}
    for name, knobs in SETTINGS.items():
        r = demo(replace(base, **knobs))
        assert r is not None
        results[name] = r
    ref = results["fp32 (uncompressed)"]
    print(f"\n{'setting':<30} {'final train':>12} {'vs fp32':>9} {'val':>8} {'vs fp32':>9}")
    rows = []
    for name, r in results.items():
        d_train = (r.final_loss - ref.final_loss) / ref.final_loss
        d_val = (r.val_loss - ref.val_loss) / ref.val_loss
        print(f"{name:<30} {r.final_loss:>12.4f} {d_train:>+9.2%} {r.val_loss:>8.4f} {d_val:>+9.2%}")
        rows.append({"setting": name, "final_loss": r.final_loss, "val_loss": r.val_loss,
                     "rel_final": d_train, "rel_val": d_val, "losses": r.losses})
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"steps": args.steps, "runs": rows}, indent=1) + "\n")
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4.5))
        for row in rows:
            losses = row["losses"]
            smooth = [sum(losses[max(0, i - 9) : i + 1]) / len(losses[max(0, i - 9) : i + 1]) for i in range(len(losses))]
            ax.plot(smooth, label=f"{row['setting']} (final {row['final_loss']:.3f})")
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (10-step mean)")
        ax.set_title(f"byte-level GPT on the Python stdlib, 2 ranks, {args.steps} steps")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        args.png.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.png, dpi=110)
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
