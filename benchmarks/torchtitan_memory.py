"""Peak memory per rank of torchtitan's Trainer with FSDP2 and with overlap as its data-parallel
step, each in a fresh world of fresh processes (CPU, gloo; the CPU shims of tests/integrations/torchtitan).

    python benchmarks/torchtitan_memory.py                       # qwen3_moe_debug, 2 ranks
    python benchmarks/torchtitan_memory.py --model llama3 --steps 3 --json out/titan_mem.json
    python benchmarks/torchtitan_memory.py --overlap-config '{"cpu_keep_freed_memory": false}'

The model is torchtitan's debug config as it is (its defaults: chunked loss, selective AC, bf16
parameters with fp32 reduction), with SDPA attention and synthetic tokens. The peak is the rank
process's peak resident set size (`ru_maxrss`: on the CPU every tensor lives there), shown whole
and above the process's size just before the Trainer is built (torch, torchtitan and the process
group already in), which is what the model, its optimizer state, the gathered parameters and the
activations add; "of it by init" is that peak through the Trainer's build (parallelize, wrap,
`to_empty`, `init_weights`) before the first step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "integrations", "torchtitan")
)

from titan_launch import run_world

MIB = 2**20


def measure(impl: str, args: argparse.Namespace) -> list[dict[str, float]]:
    run = {
        "name": impl,
        "impl": impl,
        "model": args.model,
        "steps": args.steps,
        "seq_len": args.seq_len,
        "local_batch_size": args.local_batch_size,
        "param_dtype": args.param_dtype,
        "overrides": json.loads(args.overlap_config) if impl == "overlap" else {},
    }
    ranks = run_world(args.ranks, [run], timeout_s=args.timeout_s)
    return [
        {
            "peak_mib": r[impl]["peak_rss_bytes"] / MIB,
            "added_mib": (r[impl]["peak_rss_bytes"] - r[impl]["baseline_rss_bytes"]) / MIB,
            "build_added_mib": (r[impl]["build_peak_rss_bytes"] - r[impl]["baseline_rss_bytes"]) / MIB,
            "seconds": r[impl]["seconds"],
            "final_loss": r[impl]["steps"][-1]["loss"],
        }
        for r in ranks
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3_moe", choices=["llama3", "deepseek_v3", "qwen3_moe"])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--local-batch-size", type=int, default=2)
    parser.add_argument("--param-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--overlap-config", default="{}", help="OverlapConfig overrides, JSON")
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    parser.add_argument("--json", default=None, help="write the per-rank numbers here")
    args = parser.parse_args()
    results = {impl: measure(impl, args) for impl in ("fsdp2", "overlap")}
    print(
        f"{args.model}, {args.ranks} ranks, {args.steps} steps, seq {args.seq_len} x {args.local_batch_size}, "
        f"{args.param_dtype} parameters"
    )
    print(
        f"{'impl':8} {'rank':>4} {'peak RSS MiB':>13} {'above start MiB':>16} {'of it by init':>14} {'s':>6} "
        f"{'last loss':>10}"
    )
    for impl, ranks in results.items():
        for rank, r in enumerate(ranks):
            print(
                f"{impl:8} {rank:>4} {r['peak_mib']:>13.0f} {r['added_mib']:>16.0f} {r['build_added_mib']:>14.0f} "
                f"{r['seconds']:>6.0f} {r['final_loss']:>10.4f}"
            )
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
