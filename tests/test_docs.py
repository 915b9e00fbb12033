"""The documentation holds together: README.md stays short, and every relative link in README.md
and docs/*.md points at a file that exists and, for ``#anchor`` links, at a heading of that file
(GitHub's heading slugs)."""

from __future__ import annotations

import re
import urllib.parse
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 300

_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def doc_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def _prose_lines(text: str):
    """(line number, line) of the lines outside fenced code blocks, code spans blanked out."""
    fenced = False
    for no, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield no, _CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line)


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its rendered text lower-cased, every character that is not
    a letter, digit, ``_``, ``-`` or space dropped, spaces turned into ``-``."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file; a repeated slug gets ``-1``, ``-2``, ... as on GitHub."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else _HEADING.match(line)
        if m:
            slug = github_slug(m.group(2))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link and image in a Markdown file (code left out)."""
    found = []
    for no, line in _prose_lines(path.read_text(encoding="utf-8")):
        found += [(no, m.group(1)) for m in _INLINE_LINK.finditer(line)]
        ref = _REF_DEF.match(line)
        if ref:
            found.append((no, ref.group(1)))
    return found


def broken_links(path: Path, root: Path = ROOT, allow_missing: frozenset[str] = frozenset()) -> list[str]:
    """What is wrong with the relative links of ``path``: a missing file, or an anchor that names no
    heading of its Markdown file. Links with a scheme (https:, mailto:) are not checked;
    ``allow_missing`` (paths relative to ``root``) may be absent."""
    problems = []
    for no, target in links(path):
        if _SCHEME.match(target) or target.startswith("//"):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / urllib.parse.unquote(file_part)).resolve() if file_part else path.resolve()
        where = f"{path.relative_to(root)}:{no}: {target}"
        if not dest.exists():
            rel = dest.relative_to(root).as_posix() if dest.is_relative_to(root) else str(dest)
            if rel not in allow_missing:
                problems.append(f"{where}: no such file")
            continue
        if anchor and dest.suffix == ".md" and dest.is_file():
            if urllib.parse.unquote(anchor).lower() not in anchors(dest):
                problems.append(f"{where}: no heading with this anchor in {dest.name}")
    return problems


def test_readme_is_at_most_300_lines() -> None:
    n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; at most {README_MAX_LINES}: move detail to docs/"


def test_every_relative_link_in_readme_and_docs_resolves() -> None:
    problems = [p for f in doc_files() for p in broken_links(f)]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_github_slugs() -> None:
    assert github_slug("What worldloop is") == "what-worldloop-is"
    assert github_slug("Does RL improve on the warm start? (`bench/learning.py`)") == \
        "does-rl-improve-on-the-warm-start-benchlearningpy"
    assert github_slug("Report runs on 512 seeds (the bench's design until 2026-11-26)") == \
        "report-runs-on-512-seeds-the-benchs-design-until-2026-11-26"
    assert github_slug("Evaluation (`worldloop eval`)") == "evaluation-worldloop-eval"
    assert github_slug("max_staleness and [the link](x.md)") == "max_staleness-and-the-link"


def test_the_checker_finds_a_missing_file_and_a_missing_anchor(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## Two words\n\n## Two words\n")
    readme = tmp_path / "README.md"
    readme.write_text(
        "# Top\n\n"
        "[ok](docs/a.md) [ok](docs/a.md#two-words) [ok](docs/a.md#two-words-1) [ok](#top)\n"
        "[web](https://example.com/x.md) `[in code](nowhere.md)`\n"
        "```\n[in a fence](nowhere.md)\n```\n"
        "[gone](docs/b.md) [bad anchor](docs/a.md#three-words) [bad here](#nothing)\n"
        "[allowed](docs/c.md)\n"
    )
    problems = broken_links(readme, root=tmp_path, allow_missing=frozenset({"docs/c.md"}))
    assert [p.split(": ")[1] for p in problems] == ["docs/b.md", "docs/a.md#three-words", "#nothing"], problems
    assert all(p.startswith("README.md:8:") for p in problems), problems


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_doc_page_has_a_title(path: Path) -> None:
    first = path.read_text(encoding="utf-8").lstrip().splitlines()[0]
    assert first.startswith("# "), f"{path.relative_to(ROOT)} should start with a '# ' title, got {first!r}"
