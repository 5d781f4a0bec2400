"""The documents stay true to the repository: every relative link in README.md, docs/*.md and
benchmarks/RESULTS.md resolves (the file, and the heading a `#anchor` names), every repository
path they mention exists, and the README stays a short front page."""

from __future__ import annotations

import glob
import re
from pathlib import Path

import pytest

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())
DOCUMENTS = sorted([ROOT / "README.md", ROOT / "benchmarks" / "RESULTS.md", *(ROOT / "docs").glob("*.md")])
README_MAX_LINES = 300

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^\s*```")
_PREFIXES = ("overlap/", "benchmarks/", "tests/", "csrc/", "docs/")
# A path in backticks may name a folder; a bare one must end in a file extension.
_TICKED = re.compile(r"`([^`\s]+)`")
_BARE = re.compile(
    r"(?<![\w./-])((?:overlap|benchmarks|tests|csrc|docs)/[\w./*-]*\w\.(?:py|md|json|cu|cpp|h|sh|png|toml))"
)


def _prose(text: str) -> str:
    """The text outside fenced code blocks (links in code are code)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return "\n".join(lines)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for line in _prose(path.read_text()).splitlines():
        match = re.match(r"#{1,6}\s+(.*)", line)
        if match:
            slug = _slug(match.group(1))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("document", DOCUMENTS, ids=_name)
def test_relative_links_resolve(document: Path) -> None:
    broken = []
    for target in _LINK.findall(_prose(document.read_text())):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        linked = (document.parent / file_part).resolve() if file_part else document
        if not linked.exists():
            broken.append(f"{target}: no file {linked}")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target}: no heading #{anchor} in {_name(linked)}")
    assert broken == [], f"{_name(document)}:\n" + "\n".join(broken)


def _mentioned_paths(text: str) -> set[str]:
    found = {p for p in _TICKED.findall(text) if p.startswith(_PREFIXES)}
    found |= set(_BARE.findall(text))
    # `overlap/engine/state.py:86`, `tests/test_x.py::test_y`: the file is what must exist.
    return {re.split(r"::|:\d", p)[0].rstrip(".,;") for p in found}


@pytest.mark.parametrize("document", DOCUMENTS, ids=_name)
def test_repository_paths_exist(document: Path) -> None:
    missing = sorted(p for p in _mentioned_paths(document.read_text()) if not glob.glob(str(ROOT / p)))
    assert missing == [], f"{_name(document)} names paths that do not exist: {missing}"


def test_path_finder_sees_ticked_bare_and_globbed_paths() -> None:
    text = "`overlap/engine/` and overlap/config.py, `tests/test_x.py::test_y`, `docs/a*.png`, out/x.json"
    assert _mentioned_paths(text) == {"overlap/engine/", "overlap/config.py", "tests/test_x.py", "docs/a*.png"}


def test_slugs_follow_github() -> None:
    assert _slug("W1 step on the emulated 1 Gbit link") == "w1-step-on-the-emulated-1-gbit-link"
    assert _slug("Peak memory: overlap bench memory") == "peak-memory-overlap-bench-memory"
    assert _slug("The model at the Intel machine's compute") == "the-model-at-the-intel-machines-compute"
    assert _slug("2-D and 3-D against torchtitan") == "2-d-and-3-d-against-torchtitan"
    assert _slug("`overlap plan`") == "overlap-plan"


def test_readme_is_a_front_page() -> None:
    num_lines = len((ROOT / "README.md").read_text().splitlines())
    assert num_lines <= README_MAX_LINES, f"README.md has {num_lines} lines; move detail to docs/*.md"
