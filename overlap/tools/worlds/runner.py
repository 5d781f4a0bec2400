"""Where a benchmark runs: torchrun's world, an emulated link, or a spawned local world."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch.distributed as dist

from overlap.tools.flags import write_json
from overlap.tools.worlds.launch import default_world, in_torchrun, init_from_env, run_local_world
from overlap.tools.worlds.link import LinkSpec, run_linked_world


def run_bench(rank_fn: Callable[[int, int, Any], Any], cfg: Any) -> Any:
    """`rank_fn(rank, world_size, cfg)` on every rank of the right world; its result on the
    process holding rank 0 (None elsewhere), written to `cfg.json_path` (via `to_json()`) there.

    `cfg` is a dataclass with `link`, `nproc` and `json_path` fields, and optionally
    `timeout_s`: the deadline of a world behind an emulated link (default 900 s)."""
    if in_torchrun():
        if cfg.link is not None:
            print("WARNING: --link is ignored under torchrun (it applies to spawned local worlds)")
        info = init_from_env()
        try:
            report = rank_fn(info.rank, info.world_size, cfg)
        finally:
            dist.destroy_process_group()
    else:
        nproc, backend = default_world()
        nproc = cfg.nproc or nproc
        if cfg.link is not None:
            spec = LinkSpec.parse(cfg.link)
            timeout_s = getattr(cfg, "timeout_s", None) or 900.0
            report = run_linked_world(rank_fn, nproc, replace(cfg, json_path=None), spec=spec, timeout_s=timeout_s)[0]
        else:
            report = run_local_world(rank_fn, nproc, cfg, backend=backend)[0]
    if report is not None and cfg.json_path:
        write_json(cfg.json_path, report.to_json())
    return report
