"""`overlap bench comm --transport shm`: all_gather and reduce_scatter through the shared-memory
ring, each row checked and beside its memcpy floor; what the transport cannot measure refused,
before any rank starts (config) or on every rank (ranks that do not share a host).

The sweep runs in the module's 2-rank world (`world2`: ranks forked once); one CLI call checks
the flag and the one-line refusal users see.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from overlap.tools.bench import comm
from overlap.tools.bench.comm import OPS, SHM_OPS, CommBenchConfig, bus_factor, variants

RUN_TIMEOUT_S = 240  # a loaded 2-core machine: the sweep takes seconds idle


# ---------------------------------------------------------------------------------------------
# what is measured, what is refused before any rank starts


def test_shm_measures_the_ops_it_carries_out_of_place() -> None:
    assert CommBenchConfig().selected_ops == OPS  # no flags: the backend's sweep, as before
    assert CommBenchConfig(transport="shm").selected_ops == SHM_OPS
    assert CommBenchConfig(transport="shm", ops=("all_gather",), dtype="int32").selected_ops == ("all_gather",)
    assert variants("all_gather", "shm") == variants("reduce_scatter", "shm") == (False,)
    assert variants("all_gather") == (False, True)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"ops": ("all_reduce",)}, "carries all_gather and reduce_scatter only, not all_reduce"),
        ({"ops": ("all_gather", "all_to_all")}, "not all_to_all"),
        ({"dtype": "int32"}, "reduce_scatter sums float32"),
        ({"link": "1gbit"}, "emulated link"),
        ({"nproc": 1}, "needs 2 to"),
        ({"max_bytes": 2**30}, "at most"),
    ],
)
def test_shm_refuses_what_it_cannot_measure(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CommBenchConfig(transport="shm", **fields)  # type: ignore[arg-type]


def test_shm_refused_where_the_ranks_run_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match="CUDA devices"):
        CommBenchConfig(transport="shm")
    CommBenchConfig()  # the backend's sweep is NCCL's there


def test_cli_refusal_is_one_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "overlap.tools.cli", "bench", "comm", "--transport", "shm", "--ops", "all_reduce"],
        check=False, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
    )  # fmt: skip
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        "overlap bench comm: CommBenchConfig.transport='shm' (--transport shm): the shared-memory transport "
        "carries all_gather and reduce_scatter only, not all_reduce; measure all_reduce with --transport "
        "backend, or pass --ops all_gather,reduce_scatter"
    ]


# ---------------------------------------------------------------------------------------------
# a sweep in a 2-rank world


def _sweep(rank: int, world_size: int, cfg: CommBenchConfig) -> dict[str, object] | None:
    report = comm.comm_rank(rank, world_size, cfg)
    return None if report is None else report.to_json()


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_shm_sweep_rows_are_right_and_beside_their_copy(world2) -> None:
    cfg = CommBenchConfig(transport="shm", min_bytes=4096, max_bytes=2**20, iters=3, warmup=1, nproc=2)
    data = world2.run(_sweep, cfg=cfg, timeout_s=RUN_TIMEOUT_S)[0]
    assert data["transport"] == "shm" and data["world_size"] == 2 and data["backend"] == "gloo"
    rows = data["rows"]
    for op in SHM_OPS:
        sizes = sorted(r["bytes"] for r in rows if r["op"] == op)
        assert sizes == [4096 * 2**k for k in range(9)], op  # 4 KiB .. 1 MiB, one row each
    for r in rows:
        assert r["num_wrong"] == 0, r
        assert not r["inplace"] and r["algbw_gbps"] > 0 and r["copy_gbps"] > 0 and r["copy_time_us"] > 0, r
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * bus_factor(r["op"], 2))
        assert r["copy_pct"] == pytest.approx(100 * r["algbw_gbps"] / r["copy_gbps"])


def _segments_elsewhere(rank: int, world_size: int) -> str:
    """`open_segments` with rank 1 claiming another host: every rank must refuse."""
    own = comm.shm.host_identity
    if rank == 1:
        comm.shm.host_identity = lambda: "another-host"  # in this rank's process, until the end
    try:
        comm.open_segments(4096, torch.device("cpu"))
    except ValueError as e:
        return str(e)
    finally:
        comm.shm.host_identity = own
    return "not refused"


@pytest.mark.slow
def test_shm_refused_on_every_rank_where_ranks_do_not_share_a_host(world2) -> None:
    for message in world2.run(_segments_elsewhere, timeout_s=RUN_TIMEOUT_S):
        assert "shared memory is not usable: the ranks are not all on this host" in message
