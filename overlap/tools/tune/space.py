"""The search space of `overlap tune`: which values of which `OverlapConfig` fields are tried.

A `TuneSpace` holds absolute values (elements, bytes, depths), so a grid is the same on every
rank and its JSON names exactly what was searched (it is part of the cache key).
`default_space(model)` derives those values from the model's own unit sizes.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

import torch
import torch.nn as nn

from overlap.compression import GRAD_CODECS, PARAM_CODECS
from overlap.config import OverlapConfig
from overlap.engine.units import find_unit_modules, group_units
from overlap.tools.flags import comma_list, flag

SPACE = "search space (default: sized to the model's units)"


def count(text: str) -> int:
    """ "50e6" -> 50000000: a count or byte size, written as a number."""
    return int(float(text))


def cap(text: str) -> int | None:
    """ "none" -> None (no cap), else a byte count."""
    return None if text.lower() == "none" else count(text)


class Codec(NamedTuple):
    """One compression choice: the weight all-gather's codec, the gradient reduce-scatter's, and
    whether quantization residuals are fed back (`OverlapConfig.error_feedback`)."""

    param: str | None = None
    grad: str | None = None
    error_feedback: bool = False

    @classmethod
    def parse(cls, text: str) -> Codec:
        """`none`, `int8` (both ways), `bf16/int8` (weights/gradients), `+ef` for error feedback:
        `int8+ef`, `fp8/int4+ef`, `none/int8`."""
        raw = text.strip().lower()
        body, plus, suffix = raw.partition("+")
        if plus and suffix != "ef":
            raise ValueError(f"codec {text!r}: the only suffix is '+ef' (error feedback)")
        param_text, slash, grad_text = body.partition("/")
        if not slash:
            grad_text = param_text
        param, grad = (None if t in ("none", "") else t for t in (param_text, grad_text))
        codec = cls(param, grad, bool(plus))
        codec.validate()
        return codec

    def validate(self) -> None:
        if self.param not in PARAM_CODECS:  # the registry: codecs registered here are tunable too
            raise ValueError(f"codec {self}: weight codec must be one of {tuple(PARAM_CODECS)}")
        if self.grad not in GRAD_CODECS:
            raise ValueError(f"codec {self}: gradient codec must be one of {tuple(GRAD_CODECS)}")
        if self.error_feedback and self.grad is None:
            raise ValueError(f"codec {self}: error feedback needs a gradient codec")

    @property
    def lossless(self) -> bool:
        return self.param is None and self.grad is None

    def overrides(self) -> dict[str, Any]:
        return {"param_compression": self.param, "grad_compression": self.grad, "error_feedback": self.error_feedback}

    def __str__(self) -> str:
        p, g = self.param or "none", self.grad or "none"
        text = p if p == g else f"{p}/{g}"
        return text + ("+ef" if self.error_feedback else "")


NO_CODEC = Codec()
DEFAULT_CODECS = (NO_CODEC, Codec("bf16", "bf16"), Codec("int8", "int8", True))
"""The codecs `default_space(..., allow_compression=True)` tries: none, bf16 both ways, int8 both
ways with error feedback (the configuration measured 1.35x faster on the 1 Gbit link)."""


def _as_tuple(name: str, values: Any) -> tuple[Any, ...]:
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise ValueError(f"TuneSpace.{name} must be a sequence of values, got {values!r}")
    out = tuple(values)
    if not out:
        raise ValueError(f"TuneSpace.{name} must hold at least one value")
    if len(set(out)) != len(out):
        raise ValueError(f"TuneSpace.{name} has repeated values: {out}")
    return out


@dataclass(frozen=True, kw_only=True)
class TuneSpace:
    """Values tried per `OverlapConfig` field; the grid is their product (in field order)."""

    min_unit_numel: tuple[int, ...] = field(
        default=(0,), metadata=flag(group=SPACE, parse=comma_list(count), metavar="N,N,...")
    )
    """Shard granularity: consecutive units merge until each holds this many elements."""

    prefetch_depth: tuple[int, ...] = field(
        default=(1, 2), metadata=flag(group=SPACE, parse=comma_list(count), metavar="D,D,...")
    )
    """Units all-gathered ahead of use."""

    max_inflight_allgather_bytes: tuple[int | None, ...] = field(
        default=(None,),
        metadata=flag(name="--max-inflight-bytes", group=SPACE, parse=comma_list(cap), metavar="none,B,..."),
    )
    """Byte caps on unsharded parameters in flight (None: only the depth limits)."""

    reduce_scatter_bucket_bytes: tuple[int, ...] = field(
        default=(0,), metadata=flag(name="--bucket-bytes", group=SPACE, parse=comma_list(count), metavar="B,B,...")
    )
    """Gradient bucket sizes (0: every unit reduced on its own)."""

    max_reduce_inputs: tuple[int, ...] = field(
        default=(1,), metadata=flag(group=SPACE, parse=comma_list(count), metavar="K,K,...")
    )
    """Reduce-scatter inputs alive at once (2 lets a second reduce-scatter queue on a slow link:
    autotune found it 13% faster behind 1 Gbit, RESULTS.md "Self-tuning")."""

    reshard_after_forward: tuple[bool, ...] = field(default=(True,), metadata=flag(cli=False))
    """ZeRO-3 (True) and/or ZeRO-2 (False). Only (True,) by default: ZeRO-2 trades memory for
    speed, which is the user's decision, not a measurement's."""

    codecs: tuple[Codec, ...] = field(
        default=(NO_CODEC,),
        metadata=flag(group=SPACE, parse=comma_list(Codec.parse), metavar="C,C,...",
                      help="e.g. none,bf16,int8+ef,fp8/int4+ef (a lossy one needs --allow-compression)"),
    )  # fmt: skip
    """Compression choices (strings such as "int8+ef" are parsed). Anything lossy changes the
    numerics: `overlap.tune` refuses it unless compression is allowed."""

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name != "codecs":
                object.__setattr__(self, f.name, _as_tuple(f.name, getattr(self, f.name)))
        codecs = tuple(Codec.parse(c) if isinstance(c, str) else Codec(*c) for c in self.codecs)
        for codec in codecs:
            codec.validate()
        object.__setattr__(self, "codecs", _as_tuple("codecs", codecs))
        for value in self.reshard_after_forward:
            if not isinstance(value, bool):
                raise TypeError(f"TuneSpace.reshard_after_forward holds bools, got {value!r}")
        # Let OverlapConfig name any bad value (negative depth, zero cap, ...) up front.
        self.candidates(OverlapConfig())

    def axes(self) -> tuple[tuple[Any, ...], ...]:
        """The values of every field, in field order: the grid's axes."""
        return tuple(getattr(self, f.name) for f in fields(self))

    @property
    def size(self) -> int:
        return math.prod(len(values) for values in self.axes())

    @property
    def lossless(self) -> bool:
        """True when no candidate compresses (every candidate trains exactly like DDP)."""
        return all(c.lossless for c in self.codecs)

    def candidates(self, base: OverlapConfig) -> list[OverlapConfig]:
        """The grid: `base` with every combination of the values, in a fixed order (the same on
        every rank; candidates are named by their index in it)."""
        names = [f.name for f in fields(self)]  # OverlapConfig's own names, and `codecs`
        out = []
        for values in itertools.product(*self.axes()):
            chosen = dict(zip(names, values, strict=True))
            codec = chosen.pop("codecs")
            out.append(base.replace(**chosen, **codec.overrides()))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "min_unit_numel": list(self.min_unit_numel),
            "prefetch_depth": list(self.prefetch_depth),
            "max_inflight_allgather_bytes": list(self.max_inflight_allgather_bytes),
            "reduce_scatter_bucket_bytes": list(self.reduce_scatter_bucket_bytes),
            "max_reduce_inputs": list(self.max_reduce_inputs),
            "reshard_after_forward": list(self.reshard_after_forward),
            "codecs": [str(c) for c in self.codecs],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TuneSpace:
        return cls(**{k: tuple(v) for k, v in data.items()})


TUNED_FIELDS = (
    "min_unit_numel",
    "prefetch_depth",
    "max_inflight_allgather_bytes",
    "reduce_scatter_bucket_bytes",
    "max_reduce_inputs",
    "reshard_after_forward",
    "param_compression",
    "grad_compression",
    "error_feedback",
)
"""The OverlapConfig fields a TuneSpace sets; everything else comes from the base config."""


def tuned_fields(config: OverlapConfig) -> dict[str, Any]:
    return {name: getattr(config, name) for name in TUNED_FIELDS}


def _si(value: float) -> str:
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= div:
            return f"{value / div:.3g}{suffix}"
    return f"{value:g}"


def describe(config: OverlapConfig) -> str:
    """A short label of the tuned fields, e.g. `unit>=6.3M d2 cap- bucket25.2MB int8+ef`."""
    codec = Codec(config.param_compression, config.grad_compression, config.error_feedback)
    cap = config.max_inflight_allgather_bytes
    parts = [
        f"unit>={_si(config.min_unit_numel)}",
        f"d{config.prefetch_depth}",
        f"cap{'-' if cap is None else _si(cap) + 'B'}",
        f"bucket{_si(config.reduce_scatter_bucket_bytes)}B",
    ]
    if config.max_reduce_inputs != 1:
        parts.append(f"inputs{config.max_reduce_inputs}")
    if not config.reshard_after_forward:
        parts.append("zero2")
    parts.append(str(codec))
    return " ".join(parts)


# --------------------------------------------------------------------------------------------
# a default space from the model's units


def unit_numels(model: nn.Module, unit_policy: Any) -> dict[str, int]:
    """Elements per unit module (FQN -> numel), as `overlap.wrap` would group them before any
    merging; a parameter shared by several modules counts once, for the first."""
    seen: set[int] = set()
    numels: dict[str, int] = {}
    modules = dict(model.named_modules())
    for fqn in find_unit_modules(model, unit_policy):
        total = 0
        for p in modules[fqn].parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
        numels[fqn] = total
    return numels


def default_space(model: nn.Module, *, base: OverlapConfig | None = None, allow_compression: bool = False) -> TuneSpace:
    """A grid sized to `model`: unit granularity of 1, 2 and 4 of its (largest) units per shard
    unit, prefetch depth 1, 2 and 4, gradient buckets of 0, 2 and 4 units' gradient bytes, 1 or 2
    reduce-scatter inputs alive, and `DEFAULT_CODECS` when compression is allowed. 54 candidates
    without compression.

    Granularities that group the units the same way are tried once.
    """
    base = base or OverlapConfig()
    numels = unit_numels(model, base.unit_policy)
    if not numels:
        raise ValueError(
            "overlap.tune.default_space: the unit policy finds no units in this model (one unit "
            "only: nothing to tune); pass a TuneSpace or another OverlapConfig.unit_policy"
        )
    largest = max(numels.values())
    fqns = list(numels)
    granularities: list[int] = []
    groupings: set[tuple[tuple[str, ...], ...]] = set()
    for factor in (0, 2, 4):
        value = factor * largest
        grouping = tuple(group_units(fqns, numels, value))
        if grouping not in groupings:
            groupings.add(grouping)
            granularities.append(value)
    dtype = base.reduce_dtype or base.param_dtype or next(model.parameters()).dtype
    grad_unit_bytes = largest * torch.empty(0, dtype=dtype).element_size()
    return TuneSpace(
        min_unit_numel=tuple(granularities),
        prefetch_depth=(1, 2, 4),
        reduce_scatter_bucket_bytes=(0, 2 * grad_unit_bytes, 4 * grad_unit_bytes),
        max_reduce_inputs=(1, 2),
        codecs=DEFAULT_CODECS if allow_compression else (NO_CODEC,),
    )
