"""The C++ extension's build lock ([Note: a build killed midway] in overlap/kernels/cpu.py): a
build killed midway never blocks the next one, and ranks that start together build once."""

import signal
import subprocess
import sys
import threading
import time

from overlap.kernels import cpu

_HOLD = """
import fcntl, sys, time
handle = open(sys.argv[1], "a")
fcntl.flock(handle, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(600)
"""


def test_stale_cpp_extension_lock_is_removed_before_compiling(tmp_path):
    """A killed build leaves cpp_extension's `lock` file: the next build removes it and compiles."""
    (tmp_path / "lock").write_text("")
    done = tmp_path / "built.ok"
    seen = []

    def compile_module():
        seen.append((tmp_path / "lock").exists())

    assert cpu.build_once(tmp_path, done, compile_module) is True
    assert seen == [False] and done.is_file()
    assert cpu.build_once(tmp_path, done, lambda: seen.append("again")) is False  # built: not again
    assert seen == [False]


def test_build_waits_for_a_live_builder_and_not_for_a_killed_one(tmp_path):
    """While another process holds the build lock this one waits; once that process dies (its
    lock released by the kernel, as a Ctrl-C or a killed rank leaves it) the build goes on."""
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(tmp_path / "overlap.flock")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        (tmp_path / "lock").write_text("")  # what the killed build left
        finished = threading.Event()
        compiled = []

        def build():
            compiled.append(cpu.build_once(tmp_path, tmp_path / "built.ok", lambda: None))
            finished.set()

        thread = threading.Thread(target=build, daemon=True)
        thread.start()
        time.sleep(0.5)
        assert not finished.is_set(), "built although another process held the build lock"
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
        assert finished.wait(timeout=120), "the build still waited after the lock's holder was killed"
        assert compiled == [True] and not (tmp_path / "lock").exists()
    finally:
        holder.kill()
        holder.wait(timeout=60)
