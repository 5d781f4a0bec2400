"""The `overlap` console script: one entry point, one subcommand per task.

Each subcommand lives in its own module exposing `add_arguments(parser)` and `run(args) -> int`
(and an importable function doing the work, taking a config dataclass whose fields are the
command's flags: overlap/tools/flags.py); adding one is one row in `COMMANDS`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("overlap.tools.demo", "train a small GPT on the Python stdlib's source with overlap.wrap"),
    "report": ("overlap.observe.report", "summarize an overlap trace (exposed comm per unit) and draw its timeline"),
    "plan": (
        "overlap.tools.plan.command",
        "predict step time, tokens/s, MFU, memory and cost on a cluster; best config; scaling curve",
    ),
    "bench": (
        "overlap.tools.bench",
        "benchmarks: collective bandwidth (comm), comm/compute overlap (overlap), training step vs FSDP2/DDP (step), per-unit overhead, memory, FSDP x TP (mesh)",
    ),
    "tune": (
        "overlap.tools.tune.command",
        "measure and pick the fastest OverlapConfig for a model on this world; writes its JSON",
    ),
}
"""Subcommand -> (module, one-line help). Modules are imported only when their command runs,
so `overlap --help` stays fast and a broken subcommand cannot break the others."""


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The top-level parser; only `command`'s module is imported to add its flags."""
    parser = argparse.ArgumentParser(prog="overlap", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            importlib.import_module(module).add_arguments(p)
    return parser


def _command_in(argv: Sequence[str]) -> str | None:
    """The subcommand: the first argument that is not an option (the top level has no values)."""
    first = next((a for a in argv if not a.startswith("-")), None)
    return first if first in COMMANDS else None


def main(argv: Sequence[str] | None = None) -> int:
    """Parse `argv` (default: sys.argv[1:]) and run the chosen subcommand; its exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = _command_in(argv)
    args = build_parser(command).parse_args(argv)
    return int(importlib.import_module(COMMANDS[args.command][0]).run(args))


if __name__ == "__main__":
    sys.exit(main())
