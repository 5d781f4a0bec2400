"""The tuning cache: a key naming everything a tuned config depends on, and one JSON file per key.

[Note: tune cache key]
A tuned config is only valid for the run it was measured on. The key hashes: the model signature
(every parameter's name, shape, dtype and trainability, and the root class), the world size, the
backend, the device kind, the emulated link if any (`OVERLAP_LINK`), the search space, the base
config (mixed precision and the other fields the grid keeps fixed), the caller's `key_extra`
(batch shape, sequence length: the model signature cannot see the workload) and a version of the
tuner itself. The same key returns the cached config without measuring; any change re-tunes.
Only rank 0 reads and writes the cache; it broadcasts what it found, so ranks on machines with
different file systems still agree.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from overlap.config import OverlapConfig

TUNER_VERSION = 1
"""Bumped when the tuner's decisions change meaning: old cache entries then miss."""


def model_signature(model: nn.Module) -> str:
    """sha256 over the root class and every parameter's name, shape, dtype and trainability."""
    h = hashlib.sha256(type(model).__qualname__.encode())
    for name, p in model.named_parameters():
        h.update(f"|{name}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad}".encode())
    return h.hexdigest()


def _policy_text(policy: Any) -> str:
    if policy == "auto":
        return "auto"
    if isinstance(policy, frozenset):
        return "classes:" + ",".join(sorted(f"{c.__module__}.{c.__qualname__}" for c in policy))
    return f"callable:{getattr(policy, '__module__', '?')}.{getattr(policy, '__qualname__', policy)}"


def config_fields(config: OverlapConfig) -> dict[str, Any]:
    """A JSON-able view of every field (the unit policy by name, dtypes as strings)."""
    out: dict[str, Any] = {}
    for name, value in vars(config).items():
        if name == "unit_policy":
            out[name] = _policy_text(value)
        elif isinstance(value, torch.dtype):
            out[name] = str(value).removeprefix("torch.")
        else:
            out[name] = value
    return out


@dataclass(frozen=True, kw_only=True)
class TuneKey:
    """What a tuned config depends on (see [Note: tune cache key])."""

    model: str
    world_size: int
    backend: str
    device: str
    dtypes: tuple[str, ...]
    link: str | None
    space: Mapping[str, Any]
    base: Mapping[str, Any]
    extra: Mapping[str, Any] = field(default_factory=dict)
    version: int = TUNER_VERSION

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "world_size": self.world_size,
            "backend": self.backend,
            "device": self.device,
            "dtypes": list(self.dtypes),
            "link": self.link,
            "space": dict(self.space),
            "base": dict(self.base),
            "extra": dict(self.extra),
            "version": self.version,
        }

    @property
    def digest(self) -> str:
        """24 hex digits of sha256 over the canonical JSON of the fields."""
        text = json.dumps(self.to_dict(), sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:24]


def default_cache_dir() -> Path:
    """`$OVERLAP_CACHE_DIR/tune`, else `$XDG_CACHE_HOME/overlap/tune`, else ~/.cache/overlap/tune."""
    if "OVERLAP_CACHE_DIR" in os.environ:
        return Path(os.environ["OVERLAP_CACHE_DIR"]) / "tune"
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "overlap" / "tune"


def cache_path(cache_dir: str | Path, key: TuneKey) -> Path:
    return Path(cache_dir) / f"{key.digest}.json"


def read_entry(cache_dir: str | Path, key: TuneKey) -> dict[str, Any] | None:
    """The stored entry for `key`, or None (no file, unreadable, or a different key inside)."""
    path = cache_path(cache_dir, key)
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(entry, dict) or entry.get("key") != key.digest:
        return None
    return entry


def write_entry(cache_dir: str | Path, key: TuneKey, entry: Mapping[str, Any]) -> Path:
    """Store `entry` under `key` atomically (write, then rename); returns the file."""
    path = cache_path(cache_dir, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({**entry, "key": key.digest, "key_fields": key.to_dict()}, indent=2))
    tmp.replace(path)
    return path
