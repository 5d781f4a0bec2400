"""A wrapped model goes when it is dropped, and a process leaves no native thread mid-work at exit
([Note: a wrapped model is collectable] in engine/state.py, [Note: quiet exit] in teardown.py)."""

from __future__ import annotations

import ctypes
import gc
import threading
import time
import weakref

import torch

import overlap
from overlap.engine import teardown


def _three_linears() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(3)))


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 16)).square().sum().backward()
    opt.step()
    opt.zero_grad()


def _dropped_model_is_collected(rank: int, world_size: int) -> dict:
    model = _three_linears()
    wrapped = overlap.wrap(model, unit_policy={torch.nn.Linear})
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    for _ in range(2):
        _train_step(wrapped, opt)
    state = wrapped._overlap_state
    refs = {
        "state": weakref.ref(state),
        "runtime": weakref.ref(state.runtime),
        "model": weakref.ref(wrapped),
        "shard": weakref.ref(state.units[0].shard),  # a unit's flat shard: the bulk of its memory
    }
    del model, wrapped, opt, state
    gc.collect()
    return {name: ref() is None for name, ref in refs.items()}


def test_a_dropped_wrapped_model_is_collected(world2):
    # the parameters' post-accumulate-grad hooks used to hold the state: a cycle through C++
    # that the collector cannot see, so nothing of a wrapped model was ever freed
    for collected in world2.run(_dropped_model_is_collected):
        assert collected == {"state": True, "runtime": True, "model": True, "shard": True}, collected


def _graph_outlives_its_model(rank: int, world_size: int) -> tuple[bool, bool]:
    model = overlap.wrap(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)))
    loss = model(torch.randn(2, 4)).sum()
    ref = weakref.ref(model._overlap_state)
    del model
    gc.collect()
    kept = ref() is not None  # the graph's hooks hold the state: its backward still runs
    loss.backward()
    del loss
    gc.collect()
    return kept, ref() is None


def test_a_graph_that_outlives_its_model_still_runs_and_then_lets_go(world2):
    assert world2.run(_graph_outlives_its_model) == [(True, True), (True, True)]


def test_wait_threads_idle_needs_two_quiet_looks_in_a_row():
    looks = iter([[7], [7], [], [7], [], []])
    calls = []

    def runnable():
        calls.append(1)
        return next(looks)

    assert teardown.wait_threads_idle(timeout_s=60, poll_s=0, runnable=runnable)
    assert len(calls) == 6  # quiet after [7] did not count; the last two did


def test_wait_threads_idle_gives_up_at_its_deadline():
    assert not teardown.wait_threads_idle(timeout_s=0.05, poll_s=0.001, runnable=lambda: [7])
    # never quiet twice in a row: the deadline ends it too
    flips = iter([[], [7]] * 10_000)
    assert not teardown.wait_threads_idle(timeout_s=0.05, poll_s=0.001, runnable=lambda: next(flips))


def test_runnable_threads_tells_busy_threads_from_blocked_ones():
    blocked = threading.Event()
    sleeper_id: list[int] = []

    def sleeper():
        sleeper_id.append(threading.get_native_id())
        blocked.wait(60)

    t = threading.Thread(target=sleeper)
    t.start()
    while not sleeper_id:
        pass
    try:
        while sleeper_id[0] in teardown.runnable_threads():
            time.sleep(0.001)  # on its way into the wait
        for _ in range(5):  # once blocked, it stays out of the list
            assert sleeper_id[0] not in teardown.runnable_threads()
            time.sleep(0.001)
    finally:
        blocked.set()
        t.join()

    # native work without the GIL (ctypes releases it): runnable, or waiting for a core, which
    # is the same state; seen at some look while it lasts
    size = 64 << 20
    buffer = ctypes.create_string_buffer(size)
    memset = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)(
        ctypes.cast(ctypes.memset, ctypes.c_void_p).value
    )
    busy_id: list[int] = []
    done, stop = threading.Event(), threading.Event()

    def busy():
        busy_id.append(threading.get_native_id())
        for i in range(200):  # seconds of writes at most; stopped once seen
            if stop.is_set():
                break
            memset(ctypes.addressof(buffer), i, size)
        done.set()

    t = threading.Thread(target=busy)
    t.start()
    seen = False
    while not done.is_set() and not seen:
        seen = bool(busy_id) and busy_id[0] in teardown.runnable_threads()
    stop.set()
    t.join()
    assert seen
    assert threading.get_native_id() not in teardown.runnable_threads()  # never the caller


_EXIT_SCRIPT = """
import torch, torch.distributed as dist
import overlap
from overlap.engine import teardown
def reported(*args, **kwargs):
    print("quiet exit ran", flush=True)
    return True
teardown.wait_threads_idle = reported  # what the exit hook calls, once the script has ended
dist.init_process_group("gloo", init_method="file://{store}", rank=0, world_size=1)
model = overlap.wrap(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)))
model(torch.randn(2, 4)).sum().backward()
dist.destroy_process_group()
print("script done", flush=True)
"""


def test_wrap_registers_the_quiet_exit_and_it_runs_at_interpreter_exit(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "exit.py"
    script.write_text(_EXIT_SCRIPT.format(store=tmp_path / "store"))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["script", "done", "quiet", "exit", "ran"], proc.stdout


def _live_states() -> int:
    gc.collect()
    return sum(type(o).__name__ == "OverlapState" for o in gc.get_objects())


def _tuner_trials_release_their_models(rank: int, world_size: int) -> list[int]:
    import torch.distributed as dist

    from overlap.config import OverlapConfig
    from overlap.tools.tune.measure import MeasuredTrial

    configs = [OverlapConfig(prefetch_depth=d) for d in (0, 1, 2)]
    counts = []
    for keep in (False, True):
        trial = MeasuredTrial(
            _three_linears, _train_step, lambda ps: torch.optim.AdamW(ps, lr=1e-3), dist.group.WORLD, None, 1, keep
        )
        for config in configs:
            trial(config, 1)
        counts.append(_live_states())  # keep=False: none; keep=True: every candidate so far
        trial.retain([configs[1]])  # the round's survivor
        counts.append(_live_states())
        trial.close()
        counts.append(_live_states())
    return counts


def test_tuner_trials_release_the_models_they_let_go(world2):
    # the tuner keeps survivors' models on the CPU and releases the others each round; before
    # [Note: a wrapped model is collectable] every released model stayed in memory
    for counts in world2.run(_tuner_trials_release_their_models):
        assert counts == [0, 0, 0, 3, 1, 0], counts


_EXIT_CHECK_SCRIPT = """
import torch, torch.distributed as dist
import overlap
from overlap.transport import fingerprint
class NeverDone:  # a CUDA event the host ran ahead of: only a wait reads its copy
    def record(self, stream): pass
    def query(self): return False
    def synchronize(self): pass
fingerprint._current_stream = lambda device: "stream"
torch.cuda.Event = NeverDone
dist.init_process_group("gloo", init_method="file://{store}", rank=0, world_size=1)
model = overlap.wrap(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)))
model(torch.randn(2, 4)).sum().backward()
# the tags of the run's last all-gather, on their way to the host as on CUDA: one rank's differ
mine = fingerprint.Tag(1, 2, 0, 0).pack()
tags = torch.tensor([mine, 0] * 2 + [mine + 1, 0] * 2, dtype=torch.int64)
model._overlap_state.runtime.fingerprints.defer(tags, 2, mine, "all-gather of unit 0")
model._overlap_state.runtime.fingerprints.check_pending()  # the step's end: not complete yet
print("script done", flush=True)
"""


def test_the_last_steps_deferred_checks_are_logged_at_exit(tmp_path):
    """A run that ends without a checkpoint still hears of its last step
    ([Note: final checks] in late_checks.py). Logged, not raised: the process group may be gone."""
    import subprocess
    import sys

    script = tmp_path / "exit.py"
    script.write_text(_EXIT_CHECK_SCRIPT.format(store=tmp_path / "store"))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["script", "done"], proc.stdout
    assert (
        "overlap: rank 0: at exit, the last step's deferred checks: overlap: rank 0: the ranks' collectives diverged"
        in proc.stderr
    ), proc.stderr
    assert "rank 1: step 2 backward of unit 0" in proc.stderr, proc.stderr


class _Busy:
    """A CUDA stream stand-in whose work never finishes (a collective hung behind it)."""

    def record_event(self):
        return self

    def query(self) -> bool:
        return False


def test_exit_does_not_wait_forever_on_a_hung_device(monkeypatch):
    """At exit the deferred checks are read only once the comm streams are done, polled for a
    bounded time: a hung collective must not turn the exit into a hang."""
    from types import SimpleNamespace

    from overlap.engine import late_checks

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Busy())

    def never(wait: bool = False) -> None:
        raise AssertionError("read while the device was busy")

    executor = SimpleNamespace(gather_stream=_Busy(), reduce_stream=None, all_reduce_stream=None)
    transport = SimpleNamespace(executor=executor)
    fingerprints = SimpleNamespace(check_pending=never)
    runtime = SimpleNamespace(transport=transport, device=torch.device("cpu"), fingerprints=fingerprints,
                              param_codec=None, grad_codec=None)  # fmt: skip
    (message,) = late_checks.report_at_exit([SimpleNamespace(rank=3, runtime=runtime)], timeout_s=0)
    assert (
        message
        == "overlap: rank 3: at exit, the last step's deferred checks: not read: the device did not finish the last step within 0 s"
    )
