"""`overlap bench`: bandwidth arithmetic, JSON schemas of tiny real runs, emulated-link namespaces.

The real runs are subprocesses of the CLI (what users run), each with a timeout. Namespace tests
need root and iproute2 and are skipped, saying so, without them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from overlap.tools.bench.comm import (
    OPS,
    algbw_gbps,
    bus_factor,
    busbw_gbps,
    count_for,
    iters_for,
    sweep_sizes,
    variants,
)
from overlap.tools.worlds import link
from overlap.tools.worlds.link import EmulatedLink, LinkError, LinkSpec

pytestmark = pytest.mark.slow  # spawns worlds or runs a command end to end: `-m 'not slow'` leaves it out

RUN_TIMEOUT_S = 120


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "overlap.tools.cli", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert proc.returncode == 0, f"overlap {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


# ---------------------------------------------------------------------------------------------
# arithmetic


def test_bus_factors_follow_nccl_tests() -> None:
    assert bus_factor("all_reduce", 2) == 1.0
    assert bus_factor("all_reduce", 8) == pytest.approx(1.75)
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert bus_factor(op, 2) == 0.5
        assert bus_factor(op, 8) == pytest.approx(0.875)
    assert bus_factor("all_gather", 1) == 0.0  # one rank moves nothing


def test_algbw_and_busbw() -> None:
    # 1 GB in 1 s is 1 GB/s (10^9 bytes, as nccl-tests prints)
    assert algbw_gbps(10**9, 1e6) == pytest.approx(1.0)
    assert algbw_gbps(256 * 2**20, 100_000.0) == pytest.approx(2.68435456)
    assert busbw_gbps("all_reduce", 10**9, 1e6, 4) == pytest.approx(1.5)
    assert busbw_gbps("all_gather", 10**9, 1e6, 4) == pytest.approx(0.75)


def test_sweep_counts_and_iterations() -> None:
    sizes = sweep_sizes(8, 256 * 2**20)
    assert sizes[0] == 8 and sizes[-1] == 256 * 2**20 and len(sizes) == 26
    assert count_for("all_gather", 8, 4, 4) == 0  # 2 elements cannot split over 4 ranks
    assert count_for("all_gather", 40, 4, 4) == 8  # rounded down to a multiple of the world
    assert count_for("all_reduce", 40, 4, 4) == 10
    assert iters_for(1024, 20, 5, 2**28) == (20, 5)
    assert iters_for(2**28, 20, 5, 2**28) == (2, 1)  # big sizes: few iterations, at least 2
    assert variants("all_reduce") == (True,) and variants("all_to_all") == (False,)


def test_link_spec_parse() -> None:
    assert LinkSpec.parse("1gbit") == LinkSpec(rate_bits_per_s=10**9)
    spec = LinkSpec.parse("100mbit,200us")
    assert spec.rate_bits_per_s == 10**8 and spec.delay_us == 200.0
    assert LinkSpec.parse("10gbit,1ms").delay_us == 1000.0
    assert str(spec) == "100mbit,200us" and str(LinkSpec.parse("1gbit")) == "1gbit"
    assert LinkSpec.parse("1gbit").rate_gbps == pytest.approx(0.125)
    for bad in ("fast", "1gb", "1gbit,soon", "1bit"):
        with pytest.raises(ValueError):
            LinkSpec.parse(bad)


def test_link_errors_say_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(link.shutil, "which", lambda _tool: None)
    with pytest.raises(LinkError, match="iproute2"):
        link.check_prerequisites()
    monkeypatch.undo()
    monkeypatch.setattr(link.shutil, "which", lambda tool: f"/usr/sbin/{tool}")
    monkeypatch.setattr(link.os, "geteuid", lambda: 1000)
    with pytest.raises(LinkError, match="root"):
        link.check_prerequisites()


# ---------------------------------------------------------------------------------------------
# tiny real runs


def test_bench_comm_json_schema(tmp_path: Path) -> None:
    out = tmp_path / "comm.json"
    proc = run_cli("bench", "comm", "--nproc", "2", "--max-bytes", "4096", "--iters", "2", "--json", str(out))
    assert "# Avg bus bandwidth" in proc.stdout
    data = json.loads(out.read_text())
    assert data["backend"] == "gloo" and data["world_size"] == 2 and data["link"] is None
    rows = data["rows"]
    assert {r["op"] for r in rows} == set(OPS)
    for r in rows:
        assert {"op", "bytes", "dtype", "time_us", "algbw_gbps", "busbw_gbps", "inplace"} <= set(r)
        assert r["dtype"] == "float32" and r["num_wrong"] == 0 and r["time_us"] > 0
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * bus_factor(r["op"], 2))
    assert max(r["bytes"] for r in rows) == 4096
    assert any(r["inplace"] for r in rows) and not all(r["inplace"] for r in rows)


def test_bench_overlap_json_schema(tmp_path: Path) -> None:
    out = tmp_path / "overlap.json"
    proc = run_cli(
        "bench", "overlap", "--nproc", "2", "--comm-bytes", "65536", "--num-comms", "2",
        "--matmul-dim", "64", "--rounds", "2", "--json", str(out),
    )  # fmt: skip
    assert "hidden comm" in proc.stdout and "compute slowed down" in proc.stdout
    data = json.loads(out.read_text())
    assert set(data["phases_ms"]) == {"compute", "comm", "together", "together_compute"}
    for spread in data["phases_ms"].values():
        assert spread["min"] <= spread["median"] <= spread["max"]
    p = data["phases_ms"]
    hidden = p["compute"]["median"] + p["comm"]["median"] - p["together"]["median"]
    assert data["hidden_ms"] == pytest.approx(hidden)
    assert data["hidden_share"] == pytest.approx(hidden / p["comm"]["median"])
    assert len(data["rounds_ms"]) == 2 and data["config"]["num_matmuls"] >= 1


# ---------------------------------------------------------------------------------------------
# emulated links (root + iproute2)


def _why_no_netns() -> str | None:
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    return None


needs_netns = pytest.mark.skipif(_why_no_netns() is not None, reason=str(_why_no_netns()))


def _ours(prefix: str) -> list[str]:
    return [ns for ns in link.list_namespaces() if ns.startswith(prefix)]


@needs_netns
def test_link_setup_and_teardown() -> None:
    spec = LinkSpec.parse("1gbit")
    with EmulatedLink(spec, 2) as net:
        assert set(_ours(net.prefix)) == {net.bridge_ns, net.rank_ns(0), net.rank_ns(1)}
        addr = subprocess.run(["ip", "-n", net.rank_ns(1), "addr", "show", "eth0"],
                              check=False, capture_output=True, text=True, timeout=10).stdout  # fmt: skip
        assert "10.213.0.2/24" in addr
        qdisc = subprocess.run(["tc", "-n", net.rank_ns(0), "qdisc", "show", "dev", "eth0"],
                               check=False, capture_output=True, text=True, timeout=10).stdout  # fmt: skip
        assert "tbf" in qdisc and "1Gbit" in qdisc
        assert (
            "10.213.0"
            not in subprocess.run(["ip", "route"], check=False, capture_output=True, text=True, timeout=10).stdout
        )  # the root namespace never learns the subnet
    assert _ours(net.prefix) == []
    assert not (Path("/etc/netns") / net.rank_ns(0)).exists()

    with pytest.raises(RuntimeError, match="boom"), EmulatedLink(spec, 1) as net:
        raise RuntimeError("boom")
    assert _ours(net.prefix) == []


@needs_netns
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_link_cleaned_up_on_signal(sig: signal.Signals) -> None:
    # Python leaves SIGINT ignored when it starts with it ignored (a background job, as CI runs
    # the suite): the child would then sleep its 60 s out and exit cleanly, and this test would
    # pass without a signal ever arriving. So the child takes SIGINT back, and the exit must be
    # the signal's (not 0).
    code = (
        "import signal, time\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "from overlap.tools.worlds.link import EmulatedLink, LinkSpec\n"
        "with EmulatedLink(LinkSpec.parse('100mbit'), 2):\n"
        "    print('up', flush=True)\n    time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    # Deadlines for a loaded machine (a busy CI host can take tens of seconds to start Python and
    # build the namespaces): the watchdog bounds the readline, which has no timeout of its own.
    watchdog = threading.Timer(300, proc.kill)
    watchdog.start()
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        assert _ours(f"ovl{proc.pid}")
        proc.send_signal(sig)
        proc.wait(timeout=240)
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, "the child slept its time out: the signal never reached it"
    assert _ours(f"ovl{proc.pid}") == []


@needs_netns
def test_stale_namespaces_are_swept() -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    stale = f"ovl{dead.pid}r0"
    subprocess.run(["ip", "netns", "add", stale], check=True, timeout=10)
    try:
        assert stale in link.sweep_stale_namespaces()
        assert stale not in link.list_namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", stale], check=False, capture_output=True, timeout=10)


@needs_netns
def test_bench_comm_over_link(tmp_path: Path) -> None:
    out = tmp_path / "comm.json"
    run_cli("bench", "comm", "--link", "1gbit", "--nproc", "2", "--ops", "all_reduce",
            "--min-bytes", "1024", "--max-bytes", "4096", "--iters", "2", "--json", str(out))  # fmt: skip
    data = json.loads(out.read_text())
    assert data["link"] == "1gbit" and data["world_size"] == 2
    assert all(r["num_wrong"] == 0 for r in data["rows"])
