"""Command-line flags generated from a config dataclass, and the dataclass built back from them.

A command declares its options once, as a frozen dataclass with documented fields; `add_flags`
turns each field into a flag and `from_flags` builds the dataclass from the parsed arguments
(torchtitan's ConfigManager does the same for its JobConfig). `to_flags` writes the flags that
build a given config back, so every config round-trips: flags -> dataclass -> flags.

    field              flag
    dim: int = 512     --dim N              (type and default from the field)
    link: str | None   --link TEXT          (None when not given)
    model: Literal[..] --model {w1,gpt}     (the literal's values are the choices)
    nproc: tuple[int, ...]  --nproc 1,2,4   (a comma list)
    memory: bool = True     --no-memory     (a flag that turns the default around)

The help text is the field's attribute docstring unless its metadata says otherwise. Metadata,
written with `flag(...)`, renames a flag (`--json` for `json_path`), gives a metavar, a parser
for the text, choices, a repeatable flag (`repeat=True`: one value per use), the constant of an
optional switch (`const=False` on a `bool | None` field: `--no-...` sets False, absent keeps
None), a group title, or leaves a field off the command line (`flag(cli=False)`).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import json
import textwrap
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

C = TypeVar("C")

_KEY = "overlap.flag"


def flag(
    *,
    name: str | None = None,
    help: str | None = None,
    metavar: str | None = None,
    parse: Callable[[str], Any] | None = None,
    choices: Iterable[Any] | None = None,
    repeat: bool = False,
    const: bool | None = None,
    group: str | None = None,
    cli: bool = True,
) -> dict[str, Any]:
    """A field's `metadata` for the command line (see the module docstring)."""
    spec = {"name": name, "help": help, "metavar": metavar, "parse": parse, "repeat": repeat,
            "choices": None if choices is None else tuple(choices), "const": const,
            "group": group, "cli": cli}  # fmt: skip
    return {_KEY: spec}


def comma_list(item: Callable[[str], Any]) -> Callable[[str], tuple[Any, ...]]:
    """A parser of "a,b,c" into a tuple of `item(part)`; argparse reports what fails."""

    def parse(text: str) -> tuple[Any, ...]:
        try:
            return tuple(item(part.strip()) for part in text.split(",") if part.strip())
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"expected a comma list, got {text!r} ({e})") from None

    parse.__name__ = f"comma list of {getattr(item, '__name__', 'values')}"
    return parse


def write_json(path: str | Path, payload: Any) -> Path:
    """Write a command's JSON result to `path` (its folder made), say so, and return the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {out}")
    return out


def option_name(f: dataclasses.Field[Any]) -> str:
    """The flag of field `f`: its metadata name, else `--` and the name with dashes."""
    return _spec(f)["name"] or "--" + f.name.replace("_", "-")


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of `cls` and its dataclass bases: the string after each field."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or klass is object:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, after in zip(body, body[1:]):
            named = isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
            if named and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                docs[node.target.id] = " ".join(str(after.value.value).split())
    return docs


def add_flags(
    parser: argparse.ArgumentParser | Any,
    cls: type,
    *,
    only: Iterable[str] | None = None,
    skip: Iterable[str] = (),
    defaults: Mapping[str, Any] | None = None,
    required_none: bool = False,
) -> None:
    """One flag per field of the dataclass `cls` (those in `only`, less `skip` and those marked
    `cli=False`). `defaults` replaces field defaults on the command line; `required_none` makes
    every default None, so `given_flags` can tell what the command line set."""
    hints = typing.get_type_hints(cls)
    groups: dict[str, Any] = {}
    for f in _fields(cls, only, skip):
        spec = _spec(f)
        target = parser
        if spec["group"]:
            if spec["group"] not in groups:
                groups[spec["group"]] = parser.add_argument_group(spec["group"])
            target = groups[spec["group"]]
        default = _default(f) if not defaults or f.name not in defaults else defaults[f.name]
        kwargs = _argparse_kwargs(cls, f, hints[f.name], None if required_none else default)
        name = _switch_name(f, spec, default) if _base(hints[f.name]) is bool else option_name(f)
        target.add_argument(name, dest=f.name, **kwargs)


def from_flags(cls: type[C], args: argparse.Namespace, **given: Any) -> C:
    """`cls` from the parsed flags of its fields (a list from a repeatable flag made a tuple);
    `given` sets fields directly (those with no flag, or computed from other flags)."""
    values = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in given or not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        values[f.name] = tuple(value) if isinstance(value, list) else value
    return cls(**values, **given)


def given_flags(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The fields of `cls` the command line set (flags added with `required_none=True`)."""
    out = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        value = getattr(args, f.name, None)
        if value is not None:
            out[f.name] = tuple(value) if isinstance(value, list) else value
    return out


def command(
    cls: type[C], work: Callable[[C], Any], name: str, exit_code: Callable[[Any], int] = lambda _: 0
) -> tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]:
    """A command's `add_arguments` and `run` (overlap/tools/cli.py): the flags of `cls`, then
    `work(cls(...))`; a config that refuses its values is a one-line error naming the command
    (`name`), and `exit_code(what work returned)` is the exit status."""

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        add_flags(parser, cls)

    def run(args: argparse.Namespace) -> int:
        return exit_code(work(config_or_exit(name, lambda: from_flags(cls, args))))

    return add_arguments, run


def config_or_exit(name: str, build: Callable[[], C]) -> C:
    """`build()`, the config of command `name`; a value it refuses (ValueError, TypeError) is a
    one-line error naming the command, not a traceback."""
    try:
        return build()
    except (ValueError, TypeError) as e:
        raise SystemExit(f"{name}: {e}") from None


def to_flags(cfg: Any, *, only: Iterable[str] | None = None, skip: Iterable[str] = ()) -> list[str]:
    """The command line that builds `cfg` back with `add_flags`/`from_flags` (fields left at
    their defaults are left out)."""
    hints = typing.get_type_hints(type(cfg))
    argv: list[str] = []
    for f in _fields(type(cfg), only, skip):
        value = getattr(cfg, f.name)
        if value == _default(f):
            continue
        spec, kind = _spec(f), _base(hints[f.name])
        if kind is bool:
            argv.append(_switch_name(f, spec, _default(f)))
        elif spec["repeat"]:
            for item in value:
                argv += [option_name(f), str(item)]
        elif isinstance(value, tuple):
            argv += [option_name(f), ",".join("none" if v is None else str(v) for v in value)]
        else:
            argv += [option_name(f), str(value)]
    return argv


# ---------------------------------------------------------------------------------------------
# the metadata of fields several commands share

JSON_FLAG = flag(name="--json", metavar="PATH")
LINK_FLAG = flag(metavar="RATE[,DELAY]", help="ranks behind an emulated link, e.g. 1gbit, 1gbit,200us")
WORLD_SIZES_FLAG = flag(parse=comma_list(int), metavar="N[,N...]")
OVERLAP_CONFIG_FLAG = flag(
    name="--overlap-config",
    repeat=True,
    metavar="KEY=VALUE,...",
    help="one more overlap contender with these OverlapConfig overrides (repeatable)",
)


# ---------------------------------------------------------------------------------------------


def _spec(f: dataclasses.Field[Any]) -> dict[str, Any]:
    return f.metadata.get(_KEY) or flag()[_KEY]


def _fields(cls: type, only: Iterable[str] | None, skip: Iterable[str]) -> list[dataclasses.Field[Any]]:
    chosen = [f for f in dataclasses.fields(cls) if _spec(f)["cli"]]  # type: ignore[arg-type]
    skipped = set(skip)
    if only is not None:
        wanted = list(only)
        by_name = {f.name: f for f in chosen}
        unknown = [n for n in wanted if n not in by_name]
        if unknown:
            raise TypeError(f"{cls.__name__} has no command-line field(s) {unknown}")
        chosen = [by_name[n] for n in wanted]
    return [f for f in chosen if f.name not in skipped]


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise TypeError(f"field {f.name} has no default: give it on the command line's `given`")


def _base(hint: Any) -> Any:
    """`X` of `X | None`; the hint itself otherwise."""
    if get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return _base(args[0])
    return hint


def _switch_name(f: dataclasses.Field[Any], spec: dict[str, Any], default: Any) -> str:
    """The flag of a bool field: it sets the value that is not the default."""
    if spec["name"]:
        return spec["name"]
    sets = spec["const"] if default is None else not default
    return ("--" if sets else "--no-") + f.name.replace("_", "-")


def _parser_of(hint: Any) -> tuple[Callable[[str], Any] | None, tuple[Any, ...] | None]:
    """(text -> value, choices) for a scalar hint."""
    if get_origin(hint) is Literal:
        values = get_args(hint)
        return type(values[0]), values
    if hint in (int, float, str):
        return hint, None
    item = _base(hint)
    if item is not hint:
        return _parser_of(item)
    return None, None


def _argparse_kwargs(cls: type, f: dataclasses.Field[Any], hint: Any, default: Any) -> dict[str, Any]:
    spec = _spec(f)
    doc = spec["help"] if spec["help"] is not None else field_docs(cls).get(f.name)
    kwargs: dict[str, Any] = {"help": doc.replace("%", "%%") if doc else None}
    kind = _base(hint)
    if kind is bool:
        sets = spec["const"] if default is None else not default  # what the switch sets
        kwargs.update(action="store_const", const=bool(sets), default=default)
        return kwargs
    if get_origin(kind) is tuple:
        item = get_args(kind)[0]
        parse, choices = _parser_of(item)
        parse = spec["parse"] or parse
        if spec["repeat"]:
            kwargs.update(action="append", type=parse, default=None if default is None else list(default))
        else:
            kwargs.update(type=spec["parse"] or comma_list(parse or str), default=default)
        kwargs["metavar"] = spec["metavar"] or ("A,B,..." if not spec["repeat"] else None)
        if kwargs["metavar"] is None:
            del kwargs["metavar"]
        return kwargs
    parse, choices = _parser_of(kind)
    parse = spec["parse"] or parse
    if parse is None:
        raise TypeError(
            f"{cls.__name__}.{f.name}: no command-line form for {hint}; give flag(parse=...) or flag(cli=False)"
        )
    kwargs.update(type=parse, default=default)
    if spec["choices"] or choices:
        kwargs["choices"] = spec["choices"] or choices
    if spec["metavar"]:
        kwargs["metavar"] = spec["metavar"]
    return kwargs
