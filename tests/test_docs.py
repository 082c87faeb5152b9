"""The docs describe the code as it is: every flag of every command appears in docs/, every
relative link (and its #anchor) in README.md and docs/*.md resolves, every repository path the
docs name in backticks exists, and the README stays short enough to read in five minutes."""

import argparse
import re
from pathlib import Path

import pytest

from localllm.app.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS]
README_MAX_LINES = 250
# Folders whose files the docs may name as `path/to/file.py`; such a name must exist.
REPO_DIRS = ("app/", "engine/", "kernels/", "offload/", "media/", "tests/", "packaging/", "docs/",
             ".ci/")  # fmt: skip
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.DOTALL | re.MULTILINE)


def _flags(parser: argparse.ArgumentParser, command: str) -> list[tuple[str, str]]:
    """(command, option string) for every flag of `parser` and of its subcommands' parsers."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _flags(sub, f"{command} {name}")
        else:
            found += [(command, opt) for opt in action.option_strings]
    return found


def test_the_walk_sees_every_command():
    commands = {c for c, _ in _flags(build_parser(), "localllm")}
    for name in ("run", "serve", "pull", "ls", "rm", "bench", "tui", "transcribe", "tts",
                 "doctor", "completion"):  # fmt: skip
        assert f"localllm {name}" in commands


def test_every_flag_is_documented():
    text = "\n".join(p.read_text() for p in DOCS)
    missing = [
        f"{command}: {flag}"
        for command, flag in _flags(build_parser(), "localllm")
        # the flag as a word of its own: `--temp` is not found inside `--temperature`
        if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text)
    ]
    assert not missing, "flags missing from docs/*.md:\n" + "\n".join(missing)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*)$", line)
        if not m:
            continue
        slug = _slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    bad = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not bad, f"{page.relative_to(ROOT)}:\n" + "\n".join(bad)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_repository_paths_exist(page):
    bad = []
    for span in CODE_SPAN.findall(page.read_text()):
        for word in span.split():
            word = word.rstrip(".,;:)")
            named = word.startswith(REPO_DIRS) and not re.search(r"[<>*{}$]|\.\.\.", word)
            if named and not (ROOT / word).exists():
                bad.append(word)
    assert not bad, f"{page.relative_to(ROOT)} names paths that do not exist: {sorted(set(bad))}"


def test_readme_is_short():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES})"
