"""Peak memory per rank of torchtitan's Trainer with FSDP2 and with overlap as its data-parallel
step, each in a fresh world of fresh processes (CPU, gloo; the CPU shims of tests/integrations/torchtitan).

    python benchmarks/torchtitan_memory.py                       # qwen3_moe_debug, 2 ranks
    python benchmarks/torchtitan_memory.py --model llama3 --steps 3 --json out/titan_mem.json
    python benchmarks/torchtitan_memory.py --overlap-config '{"cpu_keep_freed_memory": false}'
    python benchmarks/torchtitan_memory.py --impls overlap --overlap-config '{"shared_memory": "off"}'

The model is torchtitan's debug config as it is (its defaults: chunked loss, selective AC, bf16
parameters with fp32 reduction), with SDPA attention and synthetic tokens. The peak is the rank
process's peak resident set size (`ru_maxrss`: on the CPU every tensor lives there), shown whole
and above the process's size just before the Trainer is built (torch, torchtitan and the process
group already in), which is what the model, its optimizer state, the gathered parameters and the
activations add; "of it by init" is that peak through the Trainer's build (parallelize, wrap,
`to_empty`, `init_weights`) before the first step.

Shared memory between ranks counts in the RSS of every rank that touches it: overlap's
shared-memory transport (transport/shm.py) maps each rank's ring into every rank, so a page of a
ring is in both ranks' RSS and once in the host's memory. So the ranks are also sampled from here
every `--sample-ms` (/proc/<pid>/status and smaps_rollup): the peaks of RssAnon (private memory),
RssShmem (shared memory touched) and PSS (shared pages divided among the processes mapping them;
at any instant the ranks' PSS adds up to what the host holds for them: "world PSS", the peak of
that sum, is the world's cost to the host). Sampled peaks can miss a spike between samples; the
peak RSS is exact. "own" is overlap's buffers at their high-water
(`overlap.memory_stats`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "integrations", "torchtitan")
)

from titan_launch import run_world

MIB = 2**20
SAMPLED = ("RssAnon", "RssShmem", "Pss")


def _ranks_of(parent: int) -> dict[int, int]:
    """{pid: rank} of `parent`'s child processes that run titan_rank.py."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != parent:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except (OSError, ValueError, IndexError):
            continue  # gone, or not ours to read
        if b"RANK" in env:
            found[int(entry)] = int(env[b"RANK"])
    return found


def _sample(pid: int) -> dict[str, int]:
    """RssAnon and RssShmem (status) and Pss (smaps_rollup) of `pid`, bytes."""
    values = {}
    for path in (f"/proc/{pid}/status", f"/proc/{pid}/smaps_rollup"):
        with open(path) as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in SAMPLED:
                    values[key] = int(rest.split()[0]) * 1024
    return values


class Sampler(threading.Thread):
    """The peaks of `SAMPLED` per rank of this process's rank children, every `interval_s`."""

    def __init__(self, interval_s: float) -> None:
        super().__init__(daemon=True)
        self.interval_s, self.stop = interval_s, threading.Event()
        self.peaks: dict[int, dict[str, int]] = {}
        self.world_pss = 0  # the peak of the ranks' PSS summed at one sample

    def run(self) -> None:
        while not self.stop.wait(self.interval_s):
            pss = 0
            for pid, rank in _ranks_of(os.getpid()).items():
                try:
                    values = _sample(pid)
                except OSError:
                    continue
                peak = self.peaks.setdefault(rank, dict.fromkeys(SAMPLED, 0))
                for key, value in values.items():
                    peak[key] = max(peak[key], value)
                pss += values.get("Pss", 0)
            self.world_pss = max(self.world_pss, pss)


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
    sampler = Sampler(args.sample_ms / 1000)
    sampler.start()
    try:
        ranks = run_world(args.ranks, [run], timeout_s=args.timeout_s)
    finally:
        sampler.stop.set()
        sampler.join()
    return [
        {
            "peak_mib": r[impl]["peak_rss_bytes"] / MIB,
            "added_mib": (r[impl]["peak_rss_bytes"] - r[impl]["baseline_rss_bytes"]) / MIB,
            "build_added_mib": (r[impl]["build_peak_rss_bytes"] - r[impl]["baseline_rss_bytes"]) / MIB,
            "seconds": r[impl]["seconds"],
            "final_loss": r[impl]["steps"][-1]["loss"],
            "own_peak_mib": r[impl].get("overlap_peak_bytes", {}).get("total", 0) / MIB,
            **{f"{k}_peak_mib": v / MIB for k, v in sampler.peaks.get(rank, {}).items()},
            "world_pss_peak_mib": sampler.world_pss / MIB,
        }
        for rank, r in enumerate(ranks)
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
    parser.add_argument("--impls", default="fsdp2,overlap", help="which to run, in this order")
    parser.add_argument("--sample-ms", type=float, default=100.0, help="how often the ranks' memory is sampled")
    parser.add_argument("--json", default=None, help="write the per-rank numbers here")
    args = parser.parse_args()
    results = {impl: measure(impl, args) for impl in args.impls.split(",")}
    print(
        f"{args.model}, {args.ranks} ranks, {args.steps} steps, seq {args.seq_len} x {args.local_batch_size}, "
        f"{args.param_dtype} parameters"
    )
    print(f"overlap config: {args.overlap_config}; sampled every {args.sample_ms:g} ms")
    print(
        f"{'impl':8} {'rank':>4} {'peak RSS MiB':>13} {'above start MiB':>16} {'of it by init':>14} "
        f"{'anon MiB':>9} {'shmem MiB':>10} {'PSS MiB':>8} {'own MiB':>8} {'s':>6} {'last loss':>10}"
    )
    for impl, ranks in results.items():
        for rank, r in enumerate(ranks):
            sampled = "".join(f" {r.get(f'{k}_peak_mib', 0):>{w}.0f}" for k, w in zip(SAMPLED, (9, 10, 8)))
            print(
                f"{impl:8} {rank:>4} {r['peak_mib']:>13.0f} {r['added_mib']:>16.0f} {r['build_added_mib']:>14.0f}"
                f"{sampled} {r['own_peak_mib']:>8.0f} {r['seconds']:>6.0f} {r['final_loss']:>10.4f}"
            )
        print(f"{impl:8} world PSS {ranks[0]['world_pss_peak_mib']:.0f} MiB")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
