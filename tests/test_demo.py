"""The demo's pieces: the GPT, the stdlib byte data, the local-world launcher, and `overlap demo`
end to end (a few steps in a subprocess, as a user would run it)."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from overlap.data import ByteDataset, get_batch, load_stdlib_bytes, rank_generator
from overlap.launch import run_local_world
from overlap.models import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[1]
TINY = GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=64)


def test_gpt_initial_loss_is_uniform_over_bytes() -> None:
    """Near-zero initial logits mean the first loss is ln(256): a broken init shows here first."""
    torch.manual_seed(0)
    idx = torch.randint(256, (4, 32))
    logits, loss = GPT(TINY)(idx, idx)
    assert logits.shape == (4, 32, 256)
    assert loss is not None and abs(loss.item() - math.log(256)) < 0.15


def test_gpt_init_is_deterministic_and_blocks_are_units() -> None:
    torch.manual_seed(1)
    a = GPT(TINY)
    torch.manual_seed(1)
    b = GPT(TINY)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert len(a.blocks) == TINY.n_layer and isinstance(a.blocks, torch.nn.ModuleList)
    assert a.lm_head.weight is not a.wte.weight  # untied until the engine handles sharing


def test_gpt_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(n_embd=65, n_head=2)
    with pytest.raises(ValueError, match="block_size"):
        GPT(TINY)(torch.zeros(1, 33, dtype=torch.long))


def test_batches_are_in_range_shifted_and_rank_specific() -> None:
    data = load_stdlib_bytes(max_bytes=1 << 20)
    assert data.dtype == torch.uint8 and len(data) == 1 << 20
    x, y = get_batch(data, 8, 32, rank_generator(0, 0))
    assert x.shape == y.shape == (8, 32) and x.dtype == y.dtype == torch.int64
    assert int(x.min()) >= 0 and int(x.max()) < 256
    assert torch.equal(x[:, 1:], y[:, :-1])
    x1, _ = get_batch(data, 8, 32, rank_generator(0, 1))
    assert not torch.equal(x, x1)
    again, _ = get_batch(data, 8, 32, rank_generator(0, 0))
    assert torch.equal(x, again)


def test_split_is_ninety_ten_and_deterministic() -> None:
    a = ByteDataset.from_stdlib(max_bytes=1 << 20)
    b = ByteDataset.from_stdlib(max_bytes=1 << 20)
    assert len(a.train) + len(a.val) == 1 << 20
    assert len(a.val) == pytest.approx(0.1 * (1 << 20), abs=1)
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)


def _sum_of_ranks(rank: int, world_size: int, offset: int) -> tuple[int, int]:
    t = torch.tensor([rank + offset])
    dist.all_reduce(t)
    return int(t), torch.get_num_threads()


def _fail_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("injected failure")
    dist.barrier()


def test_local_world_returns_results_and_names_the_failing_rank() -> None:
    assert run_local_world(_sum_of_ranks, 2, 10, threads_per_rank=1) == [(21, 1), (21, 1)]
    with pytest.raises(RuntimeError, match=r"rank 1 of 2 failed[\s\S]*injected failure"):
        run_local_world(_fail_on_rank_one, 2, timeout_s=20, deadline_s=50)


@pytest.mark.timeout(90)
def test_demo_cli_runs_and_loss_is_finite() -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    cmd = [
        sys.executable,
        "-m",
        "overlap",
        "demo",
        "--steps",
        "3",
        "--layers",
        "2",
        "--dim",
        "64",
        "--heads",
        "2",
        "--block-size",
        "32",
        "--batch-size",
        "4",
        "--log-every",
        "1",
        "--eval-batches",
        "2",
        "--nproc",
        "2",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    match = re.search(r"train loss (\S+) -> (\S+) \| val loss (\S+)", proc.stdout)
    assert match, proc.stdout
    first, last, val = (float(g) for g in match.groups())
    assert all(math.isfinite(v) for v in (first, last, val))
    assert abs(first - math.log(256)) < 0.2
    assert proc.stdout.count("step ") >= 3  # a progress line per step with --log-every 1
