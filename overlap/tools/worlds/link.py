"""Emulated network links: run each rank in its own network namespace behind a shaped veth.

On one machine the ranks talk over loopback at memory speed, so communication looks free and no
schedule can show that it hides it. `--link 1gbit` (or `1gbit,200us`) makes every byte cost wire
time instead, the same for every contender in a run:

    rank k: netns ovl<pid>r<k>, eth0 = 10.213.0.<k+1>/24, egress shaped by tc (tbf [+ netem])
              |  veth
    bridge:   netns ovl<pid>br, br0 joining the veth ends of all ranks

[Note: link namespaces]
The bridge lives in a namespace of its own, not in the root namespace, so the host's network is
never touched: no interface, address, route or firewall rule is added there, the private subnet
10.213.0.0/24 is reachable only from our namespaces (traffic cannot leave them, nor collide with
a host network using the same range), and the root namespace's bridge-netfilter settings cannot
filter our frames. Teardown is deleting the namespaces: the kernel destroys the veth pairs and the
bridge with them. Names carry the launcher's pid, so a run killed by SIGKILL leaves namespaces
that the next run recognises (their pid is gone) and deletes. Ranks are processes started with
`ip netns exec`; they are stopped before their namespace is deleted, since a namespace with live
processes in it outlives its name. Each rank shapes its own egress, like a full-duplex NIC; the
bridge side is not shaped.

Rank processes learn their place the way torchrun tells them (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR = rank 0's address, MASTER_PORT) and gloo is pinned to eth0 with GLOO_SOCKET_IFNAME,
so `overlap.launch.init_from_env` joins the world unchanged. CUDA is hidden from them: the link
emulates a CPU cluster's network and NCCL would bypass it through shared memory.
"""

from __future__ import annotations

import atexit
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from overlap.tools.worlds.launch import init_from_env, num_cpu_cores

SUBNET = "10.213.0"
"""A private /24 that exists only inside our namespaces; rank k is SUBNET.(k+1)."""
MASTER_PORT = 29500  # free by construction: rank 0's namespace is new
IFNAME = "eth0"
LINK_ENV = "OVERLAP_LINK"
"""Set in every rank's environment to the link's text, so reports can say what they ran over."""
_NS_RE = re.compile(r"^ovl(\d+)(?:r\d+|br)$")
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}  # as tc
_DELAY_UNITS = {"us": 1.0, "ms": 1e3, "s": 1e6}
_CMD_TIMEOUT_S = 30.0
_NETNS_ETC = Path("/etc/netns")
"""`ip netns exec NS` bind-mounts /etc/netns/NS/hosts over /etc/hosts: we give each rank one
naming every rank, so reverse lookups of peer addresses (c10d logs them) answer at once."""


class LinkError(RuntimeError):
    """The emulated link cannot be set up here (not root, no iproute2, kernel lacks a qdisc)."""


@dataclass(frozen=True, kw_only=True)
class LinkSpec:
    """One emulated link, applied to every rank's egress."""

    rate_bits_per_s: int
    """Line rate, e.g. 1_000_000_000 for `1gbit` (decimal units, as tc reads them)."""
    delay_us: float = 0.0
    """One-way latency added to every packet (tc netem); 0 for none."""

    def __post_init__(self) -> None:
        if self.rate_bits_per_s < 8_000:
            raise ValueError(f"LinkSpec.rate_bits_per_s must be >= 8kbit, got {self.rate_bits_per_s}")
        if self.delay_us < 0:
            raise ValueError(f"LinkSpec.delay_us must be >= 0, got {self.delay_us}")

    @classmethod
    def parse(cls, text: str) -> LinkSpec:
        """`RATE[,DELAY]`: `1gbit`, `100mbit,200us`, `10gbit,1ms`."""
        rate_text, _, delay_text = text.strip().lower().partition(",")
        m = re.fullmatch(r"([0-9.]+)\s*(bit|kbit|mbit|gbit|tbit)", rate_text.strip())
        if m is None:
            raise ValueError(f"--link {text!r}: rate must look like 1gbit, 100mbit, 500kbit")
        rate = round(float(m[1]) * _RATE_UNITS[m[2]])
        delay_us = 0.0
        if delay_text:
            d = re.fullmatch(r"([0-9.]+)\s*(us|ms|s)", delay_text.strip())
            if d is None:
                raise ValueError(f"--link {text!r}: delay must look like 200us, 1ms")
            delay_us = float(d[1]) * _DELAY_UNITS[d[2]]
        return cls(rate_bits_per_s=rate, delay_us=delay_us)

    @property
    def rate_gbps(self) -> float:
        """Line rate in GB/s (10^9 bytes), the unit of algbw/busbw in `bench comm`."""
        return self.rate_bits_per_s / 8e9

    @property
    def burst_bytes(self) -> int:
        """tbf bucket: 1 ms of line rate, at least a few frames (tbf never passes a packet larger
        than its bucket). Bigger buckets let short messages pass faster than the wire would."""
        return max(self.rate_bits_per_s // 8 // 1000, 16 * 1024)

    def __str__(self) -> str:
        rate = f"{self.rate_bits_per_s}bit"
        for unit in ("tbit", "gbit", "mbit", "kbit"):
            if self.rate_bits_per_s % _RATE_UNITS[unit] == 0:
                rate = f"{self.rate_bits_per_s // _RATE_UNITS[unit]}{unit}"
                break
        return f"{rate},{self.delay_us:g}us" if self.delay_us else rate


def active_link() -> str | None:
    """The link this rank runs over (its text), or None outside an emulated link."""
    return os.environ.get(LINK_ENV)


def check_prerequisites() -> None:
    """Raise `LinkError` saying what is missing: root, `ip`, `tc`."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise LinkError(
            f"--link needs iproute2 ({' and '.join(missing)} not found on PATH); "
            "install it (apt-get install iproute2) or run without --link"
        )
    if os.geteuid() != 0:
        raise LinkError(
            "--link creates network namespaces and tc qdiscs, which needs root; "
            "run as root (or with CAP_NET_ADMIN and CAP_SYS_ADMIN) or run without --link"
        )


def _sh(*cmd: str) -> None:
    """Run one iproute2 command; a failure becomes a `LinkError` quoting it and its stderr."""
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    if proc.returncode != 0:
        raise LinkError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip()}")


def list_namespaces() -> list[str]:
    """Names of all network namespaces `ip netns` knows."""
    out = subprocess.run(
        ["ip", "netns", "list"], check=False, capture_output=True, text=True, timeout=_CMD_TIMEOUT_S
    ).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_namespaces() -> list[str]:
    """Delete namespaces left by link runs whose launcher is gone; see [Note: link namespaces]."""
    stale = [ns for ns in list_namespaces() if (m := _NS_RE.match(ns)) and not _pid_alive(int(m[1]))]
    for ns in stale:
        _delete_ns(ns)
    return stale


def _delete_ns(ns: str) -> None:
    """Delete namespace `ns` (its veth ends and bridge go with it) and its /etc/netns entry;
    best effort, as it runs while exiting."""
    cmd = ["ip", "netns", "del", ns]
    try:
        subprocess.run(cmd, check=False, capture_output=True, timeout=_CMD_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        pass
    shutil.rmtree(_NETNS_ETC / ns, ignore_errors=True)


class EmulatedLink:
    """The namespaces, veths, bridge and qdiscs of one run, as a context manager.

    Torn down on leaving the `with` block however it is left: normally, by an exception, by
    Ctrl-C (SIGINT raises KeyboardInterrupt as usual) or SIGTERM/SIGHUP (turned into SystemExit
    while the link is up, so `finally` blocks run), or at interpreter exit (atexit).
    """

    def __init__(self, spec: LinkSpec, num_ranks: int) -> None:
        if not 1 <= num_ranks <= 250:
            raise ValueError(f"EmulatedLink: num_ranks must be in 1..250, got {num_ranks}")
        self.spec = spec
        self.num_ranks = num_ranks
        self.prefix = f"ovl{os.getpid()}"
        self.bridge_ns = f"{self.prefix}br"
        self._created: list[str] = []
        self._old_handlers: dict[int, Any] = {}

    def rank_ns(self, rank: int) -> str:
        return f"{self.prefix}r{rank}"

    def rank_addr(self, rank: int) -> str:
        return f"{SUBNET}.{rank + 1}"

    def __enter__(self) -> EmulatedLink:
        check_prerequisites()
        sweep_stale_namespaces()
        atexit.register(self.teardown)
        self._install_signal_handlers()
        try:
            self._build()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def _add_ns(self, name: str) -> None:
        _sh("ip", "netns", "add", name)
        self._created.append(name)
        _sh("ip", "-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        self._add_ns(self.bridge_ns)
        _sh("ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self.bridge_ns, "link", "set", "br0", "up")
        for rank in range(self.num_ranks):
            ns, port = self.rank_ns(rank), f"r{rank}"
            self._add_ns(ns)
            # Created inside the namespaces directly: no interface ever appears in the root one.
            _sh("ip", "-n", self.bridge_ns, "link", "add", port, "type", "veth",
                "peer", "name", IFNAME, "netns", ns)  # fmt: skip
            _sh("ip", "-n", self.bridge_ns, "link", "set", port, "master", "br0")
            _sh("ip", "-n", self.bridge_ns, "link", "set", port, "up")
            _sh("ip", "-n", ns, "addr", "add", f"{self.rank_addr(rank)}/24", "dev", IFNAME)
            _sh("ip", "-n", ns, "link", "set", IFNAME, "up")
            self._shape(ns)
        hosts = "".join(  # c10d's store sockets are IPv6 dual-stack: v4-mapped peers too
            f"{self.rank_addr(r)} rank{r}\n::ffff:{self.rank_addr(r)} rank{r}\n" for r in range(self.num_ranks)
        )
        for rank in range(self.num_ranks):
            etc = _NETNS_ETC / self.rank_ns(rank)
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(f"127.0.0.1 localhost\n{hosts}")

    def _shape(self, ns: str) -> None:
        """tbf for the rate; netem in front of it for the delay, when one is asked for."""
        tbf = ["tbf", "rate", f"{self.spec.rate_bits_per_s}bit",
               "burst", str(self.spec.burst_bytes), "latency", "100ms"]  # fmt: skip
        if not self.spec.delay_us:
            _sh("tc", "-n", ns, "qdisc", "add", "dev", IFNAME, "root", *tbf)
            return
        try:
            _sh("tc", "-n", ns, "qdisc", "add", "dev", IFNAME, "root", "handle", "1:",
                "netem", "delay", f"{self.spec.delay_us:g}us")  # fmt: skip
        except LinkError as e:
            if "unknown" not in str(e).lower():
                raise
            raise LinkError(
                f"{e}\nthe latency part of --link needs the kernel's netem qdisc "
                "(CONFIG_NET_SCH_NETEM), which this kernel lacks; use --link RATE without a delay"
            ) from None
        _sh("tc", "-n", ns, "qdisc", "add", "dev", IFNAME, "parent", "1:1", "handle", "10:", *tbf)

    def teardown(self) -> None:
        """Delete what this link created; idempotent, never raises (it runs on the way out)."""
        for ns in reversed(self._created):
            _delete_ns(ns)
        self._created.clear()
        self._restore_signal_handlers()
        atexit.unregister(self.teardown)

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set there; atexit and finally still clean up

        def exit_on(signum: int, _frame: FrameType | None) -> None:
            raise SystemExit(128 + signum)

        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, exit_on)

    def _restore_signal_handlers(self) -> None:
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()

    def rank_env(self, rank: int, num_threads: int) -> dict[str, str]:
        """The environment of rank `rank`: torchrun's variables, gloo pinned to the veth."""
        return {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(self.num_ranks),
            "LOCAL_WORLD_SIZE": str(self.num_ranks),
            "MASTER_ADDR": self.rank_addr(0),
            "MASTER_PORT": str(MASTER_PORT),
            "GLOO_SOCKET_IFNAME": IFNAME,
            "CUDA_VISIBLE_DEVICES": "",
            "OMP_NUM_THREADS": str(num_threads),
            LINK_ENV: str(self.spec),
        }

    def rank_command(self, rank: int, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.rank_ns(rank), *argv]


def run_linked_command(
    argv: Sequence[str], nproc: int, spec: LinkSpec, *, timeout_s: float = 900.0, num_threads: int | None = None
) -> None:
    """Run `argv` once per rank, each in its namespace of an `EmulatedLink`; wait for all.

    Rank 0's stdout is the caller's; the other ranks' is discarded (their stderr is kept, so
    errors show). A rank that exits non-zero stops the others and raises `RuntimeError` naming
    it; a world still running after `timeout_s` is stopped and raises `TimeoutError`.
    """
    threads = num_threads or max(1, num_cpu_cores() // nproc)
    with EmulatedLink(spec, nproc) as link:
        procs = [
            subprocess.Popen(
                link.rank_command(rank, argv),
                env=link.rank_env(rank, threads),
                stdout=None if rank == 0 else subprocess.DEVNULL,
            )
            for rank in range(nproc)
        ]
        try:
            _wait_all(procs, timeout_s)
        finally:
            _stop(procs)


def _wait_all(procs: list[subprocess.Popen[bytes]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        codes = [p.poll() for p in procs]
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            raise RuntimeError(f"linked rank {failed[0]} exited with code {codes[failed[0]]}")
        if all(c == 0 for c in codes):
            return
        if time.monotonic() > deadline:
            alive = [r for r, c in enumerate(codes) if c is None]
            raise TimeoutError(f"linked ranks {alive} still running after {timeout_s:.0f}s")
        time.sleep(0.05)


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """Terminate the ranks we started (by handle), then kill what lingers."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5)


def run_linked_world(
    fn: Callable[..., Any], nproc: int, *args: Any, spec: LinkSpec, timeout_s: float = 900.0
) -> list[Any]:
    """`overlap.launch.run_local_world` over an emulated link: `fn(rank, world_size, *args)`
    on `nproc` ranks, each in its own namespace; the ranks' return values in rank order.

    `fn` must be importable by name (a module-level function of a module, not of `__main__`):
    each rank is a fresh `python -m overlap.tools.worlds.link TASK_DIR` that unpickles it.
    """
    if fn.__module__ == "__main__":
        raise ValueError(
            f"run_linked_world: {fn.__qualname__} is defined in __main__; ranks start as new "
            "interpreters and cannot import it. Move it into a module, or use run_linked_command."
        )
    with tempfile.TemporaryDirectory(prefix="overlap-link-") as tmp:
        task_dir = Path(tmp)
        (task_dir / "task.pkl").write_bytes(pickle.dumps((fn, args)))
        argv = [sys.executable, "-m", "overlap.tools.worlds.link", str(task_dir)]
        run_linked_command(argv, nproc, spec, timeout_s=timeout_s)
        return [pickle.loads((task_dir / f"rank{r}.pkl").read_bytes()) for r in range(nproc)]


def _rank_main(task_dir: Path) -> None:
    """Body of one linked rank: join the world from the environment, run the task, save the
    return value where the launcher reads it."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    fn, args = pickle.loads((task_dir / "task.pkl").read_bytes())
    info = init_from_env()
    try:
        value = fn(info.rank, info.world_size, *args)
    finally:
        dist.destroy_process_group()
    out = task_dir / f"rank{info.rank}.pkl"
    out.with_suffix(".tmp").write_bytes(pickle.dumps(value))
    out.with_suffix(".tmp").replace(out)


if __name__ == "__main__":
    _rank_main(Path(sys.argv[1]))
